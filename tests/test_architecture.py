"""market/ is pure: no database, web, Prefect or NVML imports, no I/O, no clock
(docs/development/code-style.md#style-1)."""

import ast
import pathlib
import subprocess
import sys

import pytest

import prefect_spotgpu.market

FORBIDDEN = (
    "sqlalchemy",
    "fastapi",
    "prefect",
    "pynvml",
    "httpx",
    "boto3",
    "starlette",
    "uvicorn",
    "requests",
    "socket",
    "time",
    "datetime",
    "os",
    "subprocess",
    "asyncio",
)
MARKET = pathlib.Path(prefect_spotgpu.market.__file__).parent


def test_market_sources_import_nothing_impure():
    for path in sorted(MARKET.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "prefect_spotgpu":
                    assert name.startswith("prefect_spotgpu.market"), f"{path.name}: {name}"
                assert top not in FORBIDDEN, f"{path.name} imports {name}"


def test_importing_the_market_loads_no_forbidden_module():
    code = (
        "import sys, prefect_spotgpu.market, prefect_spotgpu.market.optimum\n"
        f"bad = [m for m in {FORBIDDEN[:5]!r} if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_market_reads_no_clock():
    for path in sorted(MARKET.glob("*.py")):
        text = path.read_text()
        for call in ("time.time(", "datetime.now(", "perf_counter(", "monotonic("):
            assert call not in text, f"{path.name} reads the clock: {call}"


def test_the_checkpoint_core_does_not_import_prefect():
    code = "import sys, prefect_spotgpu.checkpoint\nprint('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the house's rooms

PACKAGE = MARKET.parent
PURE_CORES = (
    "protocol.py",
    "economics/deadline.py",
    "economics/schedules.py",
    "economics/replay.py",
    "economics/steering.py",
    "economics/anywhere.py",
    "economics/regions.py",
    "economics/bound.py",
    "worker/reactions.py",
    "worker/report.py",
    "worker/pacing.py",
    "agent/gpu_book.py",
    "agent/reports.py",
    "agent/leaving.py",
    "agent/reactions.py",
)
"""Modules that decide without I/O frameworks: no Prefect, no HTTP, no database."""
IMPURE = ("prefect", "httpx", "sqlalchemy", "fastapi", "starlette", "uvicorn", "requests")


def imported_names(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def module_file(name: str) -> pathlib.Path | None:
    """The source of ``prefect_spotgpu.a.b`` (module or package), if it is ours."""
    parts = name.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def our_closure(path: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """Every module of ours that ``path`` imports, directly or through ours, with its imports
    (a package's ``__init__`` counts only when it is imported by name)."""
    seen: dict[pathlib.Path, list[str]] = {}
    todo = [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen[current] = imported_names(current)
        for name in seen[current]:
            if name.split(".")[0] == "prefect_spotgpu":
                found = module_file(name)
                if found is not None:
                    todo.append(found)
    return seen


@pytest.mark.parametrize("core", PURE_CORES)
def test_the_pure_cores_import_no_framework_even_through_our_modules(core):
    for path, names in our_closure(PACKAGE / core).items():
        for name in names:
            assert name.split(".")[0] not in IMPURE, (
                f"{core} reaches {name} through {path.relative_to(PACKAGE)}"
            )


def test_the_protocol_imports_only_the_standard_library_and_the_market():
    for name in imported_names(PACKAGE / "protocol.py"):
        if name.split(".")[0] == "prefect_spotgpu":
            assert name.startswith("prefect_spotgpu.market"), name
        else:
            assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name


def test_the_shared_messages_import_only_pydantic_and_the_protocol():
    for name in imported_names(PACKAGE / "messages.py"):
        root = name.split(".")[0]
        if root == "prefect_spotgpu":
            assert name.startswith("prefect_spotgpu.protocol"), name
        else:
            assert root in sys.stdlib_module_names or root in ("__future__", "pydantic"), name


def test_nothing_imports_the_cli():
    cli = PACKAGE / "cli"
    for path in sorted(PACKAGE.rglob("*.py")):
        if cli in path.parents:
            continue
        for name in imported_names(path):
            assert not name.startswith("prefect_spotgpu.cli"), (
                f"{path.relative_to(PACKAGE)} imports {name}: the CLI is the outermost layer"
            )


def test_no_module_is_much_over_500_lines():
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines <= 550, f"{path.relative_to(PACKAGE)} has {lines} lines: split it"


def test_the_worker_entry_points_keep_working():
    code = (
        "from prefect_spotgpu.worker import SpotGPUWorker\n"
        "import prefect_spotgpu.launch, prefect_spotgpu.cli.app\n"
        "print(SpotGPUWorker.type)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "spot-gpu"


LAYOUT_PAGE = PACKAGE.parents[1] / "docs" / "development" / "layout.md"


def documented_layout() -> tuple[set[str], set[str]]:
    """The Layout of ``src/prefect_spotgpu/`` in the documentation (``docs/development/
    layout.md``, its first code block): the paths it lists as entries, and every module it
    names (entries, and ``name.py`` mentioned in a package's description)."""
    text = LAYOUT_PAGE.read_text()
    block = text.split("```", 2)[1]
    entries, named, package = set(), set(), ""
    for line in block.splitlines():
        if not line.startswith("  ") or not line.strip():
            if line and not line.startswith(" "):
                package = None if not line.startswith("src/") else ""
            continue
        if package is None:
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if indent == 2:
            package = first if first.endswith("/") else ""
            entry = first
        elif indent == 4:
            entry = package + first
        else:
            entry = None
        if entry and (entry.endswith(".py") or entry.endswith("/")):
            entries.add(entry)
        for word in line.split():
            word = word.strip("(),;:`")
            if word.endswith(".py"):
                named.add(word if "/" in word else package + word)
    return entries, named


def test_the_documented_layout_is_the_tree():
    entries, named = documented_layout()
    for entry in sorted(entries):
        assert (PACKAGE / entry).exists(), f"{LAYOUT_PAGE.name} lists {entry}, which is not there"
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name in ("__init__.py", "__main__.py") or "migrations" in relative:
            continue
        package = relative.rsplit("/", 1)[0] + "/" if "/" in relative else ""
        depth = relative.count("/")
        if depth >= 2:  # a subpackage's modules: its listing is enough
            assert package.split("/")[0] + "/" + package.split("/")[1] + "/" in entries or (
                relative in named
            ), f"{LAYOUT_PAGE.name} does not list {relative}"
            continue
        assert relative in named, f"{LAYOUT_PAGE.name} does not name {relative}"


ARROWS = {
    "market": {"market"},
    "protocol": {"market"},
    "api_client": set(),
    "prefect_internals": set(),
    "messages": {"protocol"},
    "economics": {"market", "protocol"},
    "checkpoint": {"protocol"},
    "agent": {"market", "protocol", "checkpoint", "api_client", "messages"},
    "service": {"market", "protocol", "economics", "messages"},
    "worker": {
        "market",
        "protocol",
        "economics",
        "blocks",
        "api_client",
        "checkpoint",
        "prefect_internals",
        "messages",
    },
    "blocks": {"api_client", "checkpoint", "protocol"},
    "launch": {"protocol", "checkpoint", "prefect_internals"},
    "deploy": {"worker", "economics", "market"},
    "bundles": {"protocol", "checkpoint", "launch", "blocks", "prefect_internals"},
    "decorators": {"worker", "protocol", "market", "prefect_internals"},
    "fanout": {
        "market",
        "decorators",
        "worker",
        "protocol",
        "messages",
        "checkpoint",
        "child_runs",
    },
    "child_runs": {"decorators", "worker", "protocol", "blocks", "bundles", "prefect_internals"},
    "dask": {"market", "protocol", "messages", "blocks", "checkpoint", "fanout"},
}
"""What each room of ours may import of ours (docs/operators/architecture.md#design-2: the
arrows point one way). The worker and the agent reach the service over HTTP only; ``cli`` (the
outermost) may import anything."""


@pytest.mark.parametrize("room", sorted(ARROWS))
def test_the_arrows_point_one_way(room):
    base = PACKAGE / room
    paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    for path in paths:
        for name in imported_names(path):
            parts = name.split(".")
            if parts[0] != "prefect_spotgpu" or len(parts) < 2 or parts[1] == room:
                continue
            assert parts[1] in ARROWS[room], (
                f"{path.relative_to(PACKAGE)} imports {name}: {room} may use only "
                f"{sorted(ARROWS[room])}"
            )


IMPORT_EACH_ALONE = """
import importlib, os, sys
for heavy in ("prefect", "prefect.flows", "prefect.workers.base", "sqlalchemy", "fastapi",
              "httpx", "pydantic", "numpy", "boto3", "typer", "rich", "alembic", "uvicorn",
              "psycopg", "prefect_docker", "distributed", "sqlalchemy.orm", "prometheus_client",
              "cryptography.fernet"):
    importlib.import_module(heavy)  # third parties once; nothing of ours is imported yet
for extra in ("torch", "torch.distributed.checkpoint", "transformers.trainer_callback",
              "lightning.pytorch.callbacks", "prefect_dask"):  # the extras, where installed
    try:  # (each costs seconds of CPU: paid once here, not once per module that uses it)
        importlib.import_module(extra)
    except ImportError:
        pass
assert not any(m.startswith("prefect_spotgpu") for m in sys.modules)
failed, children = [], {}
for name in sys.argv[1:]:
    if len(children) >= (os.cpu_count() or 1):  # one child per core at a time
        pid, status = os.wait()
        if status:
            failed.append(children[pid])
        del children[pid]
    pid = os.fork()
    if pid == 0:  # a child with nothing of ours imported: this module alone
        try:
            importlib.import_module(name)
        except BaseException as exc:
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)
        os._exit(0)
    children[pid] = name
for pid, name in children.items():
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """No import cycle that only an import order hides: each module of the package imported
    first, alone (in a forked child of an interpreter that holds only third-party packages)."""
    modules = sorted(
        ".".join(
            ("prefect_spotgpu", *path.relative_to(PACKAGE).with_suffix("").parts)
        ).removesuffix(".__init__")
        for path in PACKAGE.rglob("*.py")
        if ("migrations" not in path.parts or path.name == "__init__.py")
        and path.name != "__main__.py"  # runs a program when imported
    )
    assert "prefect_spotgpu.economics.steering" in modules and len(modules) > 100
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, *modules],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


STATUS_FIELDS = {"status", "state"}
ROW_CLASSES = {
    "BidRow": "BID",
    "NodeRow": "NODE",
    "AllocationRow": "ALLOCATION",
    "WebhookDelivery": "DELIVERY",
}


def status_writes(source: str) -> list[str]:
    """Every write of a row's status or state in ``source`` other than a creation in an
    initial state of its table: assignments to ``.status``/``.state`` (plain, augmented, in a
    tuple), ``.values(status=...)``, ``setattr(..., "status", ...)``."""
    from prefect_spotgpu.market.transitions import NODE_NEW_STATES
    from prefect_spotgpu.protocol import BID_NEW_STATES, DELIVERY_NEW_STATES

    initial = {
        "BID": {s.name for s in BID_NEW_STATES},
        "NODE": {s.name for s in NODE_NEW_STATES},
        "DELIVERY": {s.name for s in DELIVERY_NEW_STATES},
    }
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(leaf, ast.Attribute) and leaf.attr in STATUS_FIELDS:
                    found.append(f"line {node.lineno}: assigns .{leaf.attr}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        keywords = {k.arg: k.value for k in node.keywords if k.arg in STATUS_FIELDS}
        if name == "values" and keywords and _updates_a_stateful_row(func.value):
            found.append(f"line {node.lineno}: .values({', '.join(keywords)}=...)")
        if name == "setattr" and len(node.args) > 1:
            field = node.args[1]
            if isinstance(field, ast.Constant) and field.value in STATUS_FIELDS:
                found.append(f"line {node.lineno}: setattr {field.value}")
        if name in ROW_CLASSES and keywords:
            for value in keywords.values():
                chain = ast.unparse(value).split(".")
                table = ROW_CLASSES[name]
                if table not in initial or len(chain) < 2 or chain[-2] not in initial[table]:
                    found.append(f"line {node.lineno}: {name} created {ast.unparse(value)}")
    return found


def _updates_a_stateful_row(chain: ast.expr) -> bool:
    """Whether a ``....values()`` chain updates a bid, node, allocation or webhook delivery
    row (or a table it cannot tell: counted, to be safe); ``update(Tenant)`` and the like are
    not."""
    for node in ast.walk(chain):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "update":
            target = node.args[0] if node.args else None
            return not isinstance(target, ast.Name) or target.id in ROW_CLASSES
    return True


def test_only_the_gate_changes_a_bid_node_allocation_or_delivery_status():
    """Statuses change through ``service/gate.py`` alone (a compare-and-set checked against the
    transition tables); rows are created only in an initial state of their table."""
    source = "row.status = 'x'\nrow.a, node.state = 1, 2\nupdate(BidRow).values(status=1)\n"
    assert status_writes(source + "update(WebhookDelivery).values(status=1)") == [
        "line 1: assigns .status",
        "line 2: assigns .state",
        "line 3: .values(status=...)",
        "line 4: .values(status=...)",
    ]
    assert status_writes("update(Tenant).values(status=1)") == []
    assert status_writes("BidRow(status=BidStatus.HELD.value)") != []
    assert status_writes("BidRow(status=BidStatus.OPEN.value)") == []
    offenders = {}
    for path in sorted((PACKAGE / "service").rglob("*.py")):
        if path.name == "gate.py" or "migrations" in path.parts:
            continue
        found = status_writes(path.read_text())
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_the_gate_enforces_the_transition_tables():
    """Every table's final states lead nowhere; the allocation gate reads the same table."""
    from prefect_spotgpu.market import AllocationStatus
    from prefect_spotgpu.market.transitions import ALLOCATION_FROM_STATES, NODE_FROM_STATES
    from prefect_spotgpu.protocol import BID_FROM_STATES, BidStatus
    from prefect_spotgpu.service import gate

    for to, sources in BID_FROM_STATES.items():
        assert not sources & gate.FINAL_BID_STATUSES, to
    for to, sources in ALLOCATION_FROM_STATES.items():
        assert not any(s.is_terminal() for s in sources), to
    for current in AllocationStatus:
        for to in AllocationStatus:
            allowed = current in ALLOCATION_FROM_STATES.get(to, ()) and not current.is_terminal()
            assert (gate.check_transition(current, to) is None) == allowed
    assert set(NODE_FROM_STATES) == set(NODE_FROM_STATES[next(iter(NODE_FROM_STATES))]) | {"lost"}
    assert BidStatus.CANCELLED not in BID_FROM_STATES[BidStatus.OPEN]
    from prefect_spotgpu.protocol import DELIVERY_FROM_STATES

    for to, sources in DELIVERY_FROM_STATES.items():
        assert not sources & gate.FINAL_DELIVERY_STATUSES, to


def _private_prefect_uses(path: pathlib.Path, worker_privates: set[str]) -> list[str]:
    """Where ``path`` reaches Prefect's private internals: an import of a private Prefect
    module or name, or a worker's private attribute read off another object than ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "prefect":
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in node.module.split(".")) or any(
                n.startswith("_") for n in names
            ):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "prefect" and any(p.startswith("_") for p in parts):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in worker_privates
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_only_the_shim_reaches_prefects_private_internals():
    """``prefect_internals.py`` is the one module that imports Prefect's private modules and
    names or reads a worker's private attributes from outside it; a ``BaseWorker`` subclass
    may still use its own inherited members (``self._logger``, ``self._propose_*``)."""
    from prefect.workers.base import BaseWorker

    worker_privates = {
        name
        for klass in BaseWorker.__mro__
        for name in vars(klass)
        if name.startswith("_") and not name.startswith("__")
    } | {"_work_pool", "_work_pool_name", "_runs_task_group", "_client", "_limiter"}
    offenders = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "prefect_internals.py"
        and (uses := _private_prefect_uses(path, worker_privates))
    }
    assert not offenders, offenders
    shim = _private_prefect_uses(PACKAGE / "prefect_internals.py", worker_privates)
    assert shim, "the shim reaches nothing private: is this test still looking?"


def test_a_delivery_records_its_outcome_only_from_pending_and_only_for_its_own_attempt(
    tmp_path,
):
    """The webhook gate on a real database: a delivered or failed delivery is final, and an
    attempt whose lease another attempt took over records nothing."""
    from datetime import UTC, datetime

    from sqlalchemy import create_engine, insert, select
    from sqlalchemy.orm import Session

    from prefect_spotgpu.protocol import DeliveryStatus
    from prefect_spotgpu.service import gate
    from prefect_spotgpu.service.errors import TransitionRejected
    from prefect_spotgpu.service.models import Base, EventRow, Tenant, WebhookDelivery

    engine = create_engine(f"sqlite:///{tmp_path / 'gate.db'}")
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        now = datetime.now(UTC)
        session.execute(insert(Tenant), [{"id": 1, "name": "t", "created_at": now}])
        session.execute(insert(EventRow), [{"id": 1, "tenant_id": 1, "bid_id": 1, "node_id": 1,
                                             "allocation_id": 1, "kind": "noticed",
                                             "payload": {}, "created_at": now}])  # fmt: skip
        gate.create_deliveries(session=session, rows=[
            {"tenant_id": 1, "event_id": 1, "url": "https://x", "status": "pending",
             "attempts": 1, "next_attempt_at": 0.0, "updated_at": now}])  # fmt: skip
        with pytest.raises(TransitionRejected):
            gate.create_deliveries(session=session, rows=[{"status": "delivered"}])
        assert not gate.set_delivery_status(
            session=session, delivery_id=1, attempts=2, to=DeliveryStatus.DELIVERED
        )  # not this attempt's: another claimed it since
        assert gate.set_delivery_status(
            session=session, delivery_id=1, attempts=1, to=DeliveryStatus.DELIVERED
        )
        assert not gate.set_delivery_status(
            session=session, delivery_id=1, attempts=1, to=DeliveryStatus.FAILED
        )  # delivered is final: the row is no longer pending
        status = session.scalar(select(WebhookDelivery.status))
    assert status == "delivered"


def test_nothing_reassigns_an_objects_class():
    """A class is made, not swapped in (docs/development/code-style.md#style-15): no
    ``obj.__class__ = ...`` in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


ENVIRON_WRITES = {"agent/configure.py"}
"""The one module that changes its process's environment: the agent drops its own token from
it (``agent_token``), so that nothing it starts inherits the key."""


def test_nothing_writes_the_environment_to_reach_another_process():
    """A subprocess is given what it needs, not a changed ``os.environ``
    (docs/development/code-style.md#style-15): no ``os.environ[...] = ``, ``update``,
    ``setdefault``, ``pop``, ``putenv`` in the package but where ``ENVIRON_WRITES`` says."""
    writes = {"update", "setdefault", "pop", "popitem", "clear", "putenv", "unsetenv"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            hit = False
            if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
                hit = any(
                    isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ"
                    for t in targets
                )
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                hit = node.func.attr in writes and owner in ("os.environ", "os")
            if hit:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert {f.split(":")[0] for f in found} <= ENVIRON_WRITES, found


def test_the_worker_and_the_agent_read_models_not_string_keys():
    """What crosses a process is a shared model (``messages``) or a named constant: a string
    key subscript in worker/ and agent/ is left only where it reads or writes a shape that is
    not ours (docker-py's keyword arguments and pull stream, httpx's links, a pydantic
    ``model_copy`` update), at most 10."""
    import re

    pattern = re.compile(r"\[\"[a-z_]+\"\]|\['[a-z_]+'\]")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for room in ("worker", "agent")
        for path in sorted((PACKAGE / room).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line) and "Literal[" not in line and '[["' not in line
    ]
    assert len(found) <= 10, found
