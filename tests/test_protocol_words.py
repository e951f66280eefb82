"""Words that cross a process are the protocol's (docs/development/code-style.md#style-12): in
the worker, the agent, the launcher and the CLI, no string literal equals a member of a protocol
StrEnum (a status, an event kind, a reason, a runner, a capacity, a Prefect state name of ours,
an event's placement); the code names the member instead. Docstrings are prose and not
looked at; a few literals that only look like a member are listed below, each with why."""

from __future__ import annotations

import ast
import enum
import pathlib

import prefect_spotgpu
from prefect_spotgpu import protocol
from prefect_spotgpu.market.decision import PlacementKind

PACKAGE = pathlib.Path(prefect_spotgpu.__file__).parent
SCOPE = ("worker", "agent", "cli", "launch.py")

NOT_THE_PROTOCOLS = {
    ("agent/keeper.py", "failed"): "START_FAILED, the keeper's own handshake key, defined there",
    ("agent/reports.py", "failed"): "a key of the job's acknowledgement file (handshake.py)",
    ("worker/placement.py", "spot"): "prose: 'Moving to spot capacity'",
    ("worker/placement.py", "on-demand"): "prose: 'Moving to on-demand capacity'",
    ("worker/pacing.py", "on-demand"): "prose: a plan described in words",
    ("worker/attempt.py", "Starting"): "prose: the log line 'Starting on node ...'",
    ("worker/reactions.py", "Preempted"): "prose: the message 'Preempted on node ...'",
    ("worker/config.py", "process"): "a Literal is spelled out: the form's choice, PROCESS_IMAGE",
    ("cli/pool.py", "spot"): "the default work pool's name",
    ("cli/demo.py", "spot"): "the demo's work pool's name",
    ("cli/demo.py", "job finished"): "prose: the demo's timeline",
    ("cli/nodes.py", "live"): "the command's name: spotgpu node live",
    ("cli/market_cmds.py", "on-demand"): "a column heading",
    ("cli/app.py", "on-demand"): "a column heading",
}


def protocol_words() -> dict[str, str]:
    """Each protocol StrEnum member's value -> its name, for the message."""
    words: dict[str, str] = {}
    enums = [v for v in vars(protocol).values() if isinstance(v, type)]
    for kind in [*enums, PlacementKind]:
        if issubclass(kind, enum.StrEnum):
            for member in kind:
                words.setdefault(member.value, f"{kind.__name__}.{member.name}")
    return words


def literals(path: pathlib.Path):
    """(line, value) of every string literal of a module but its docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_text and id(node) not in docstrings:
            yield node.lineno, node.value


def scope() -> list[pathlib.Path]:
    paths = []
    for part in SCOPE:
        where = PACKAGE / part
        paths += sorted(where.rglob("*.py")) if where.is_dir() else [where]
    return paths


def test_no_literal_in_the_worker_agent_launcher_or_cli_spells_a_protocol_word():
    words = protocol_words()
    assert {"AwaitingGPU", "promoted", "live", "migration", "reclaimed"} <= set(words)
    found, excused = [], set()
    for path in scope():
        name = path.relative_to(PACKAGE).as_posix()
        for line, value in literals(path):
            if value not in words:
                continue
            if (name, value) in NOT_THE_PROTOCOLS:
                excused.add((name, value))
                continue
            found.append(f"{name}:{line}: {value!r} is {words[value]}")
    assert not found, "name the protocol's member instead:\n" + "\n".join(found)
    assert excused == set(NOT_THE_PROTOCOLS), (
        f"no longer needed: {sorted(set(NOT_THE_PROTOCOLS) - excused)}"
    )


def test_the_scan_finds_a_protocol_word_spelled_out(tmp_path):
    """The test above can fail: a module that compares with "migration" is found."""
    module = tmp_path / "m.py"
    module.write_text('"""A docstring that says migration is prose."""\nok = kind == "migration"\n')
    found = [(line, v) for line, v in literals(module) if v in protocol_words()]
    assert found == [(2, "migration")]


def test_event_placements_cover_the_markets_placement_kinds():
    assert {k.value for k in PlacementKind} < {p.value for p in protocol.EventPlacement}
