"""Generate the Reference pages from the code into ``docs/reference/``, where they are committed.

    python docs/gen_reference.py --write     # after a change to what a page describes
    python docs/gen_reference.py --check     # exit 1 naming each page the code has left behind

The pages are files of the repository, so a reader without a built site has the reference too;
``tests/test_docs.py`` fails when a committed page is not what this script writes now, naming the
command above. mkdocs serves the committed files as any other page. Each page has one
``render_*`` function:

- ``reference/cli.md``: the typer app's commands, walked recursively (hidden ones skipped).
- ``reference/rest-api.md``: the service's OpenAPI schema (the app built over a throwaway SQLite
  database in a temporary home, never started) and the route roles of ``service/roles.py``.
- ``reference/job-variables.md``: the worker's ``SpotGPUJobConfiguration`` and the cross-field rules
  of its job configuration.
- ``reference/settings.md``: ``ServiceSettings`` as ``SPOTGPU_*`` variables, and every other
  ``SPOTGPU_*`` variable the package reads; a variable nobody describes fails the script.
- ``reference/events.md``: the enums and labels of ``prefect_spotgpu.protocol``.
- ``reference/metrics.md``: the Prometheus metrics of ``service/metrics.py``.

Descriptions come from the code (docstrings, attribute docstrings, ``Field(description=...)``,
inline comments). Where the code has none, the small mappings below supply one, keyed by the
constant; a key that no longer exists in the code fails the script, and so does a constant that
neither the code nor a mapping describes.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "prefect_spotgpu"
DOCS = ROOT / "docs"
THIS = "docs/gen_reference.py"
REGENERATE = f"python {THIS} --write"
"""The one command that brings the committed pages up to date with the code."""

ENV_NAME = re.compile(r"\bSPOTGPU_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")
"""A ``SPOTGPU_*`` environment variable's name, wherever it is written (a family written with a
wildcard, ``SPOTGPU_RETENTION_*_DAYS``, names no variable of its own)."""

# --------------------------------------------------------------------------- descriptions the
# code does not (yet) carry. Each is keyed by the constant; a stale key fails the script.

SETTING_DESCRIPTIONS = {
    "host": "Interface the API listens on (``spotgpu server start --host``).",
    "port": "Port the API listens on (``spotgpu server start --port``).",
    "tick_seconds": "The clearing interval: the market clears and bills every this many seconds.",
    "starting_credit": "Credit a new tenant starts with.",
    "notice_seconds": "Notice a running allocation gets before a reclaim, an outbid, a closing "
    "window or a reserve above its bid stops it: the time for its final save.",
    "hysteresis": "The margin a waiting bid must outbid a running one by (a fraction of its "
    "price) before the running one gets a notice.",
    "heartbeat_timeout_seconds": "A node silent this long is lost, whatever its state: its "
    "allocations end at once, noticed ones too.",
    "webhook_max_attempts": "Delivery attempts per webhook event before it is given up.",
    "webhook_backoff_seconds": "The first retry's delay; each later one doubles it "
    "(1, 2, 4, 8 ... s).",
}
"""``ServiceSettings`` fields without a ``description=``."""

JOB_ENV_DESCRIPTIONS = {
    "ALLOCATION_ID": "The allocation the job runs as (the launcher and the checkpointer "
    "identify themselves by it).",
    "ALLOCATION_EPOCH": "The allocation's epoch: which start of the allocation this process is.",
    "BID_ID": "The market bid the allocation serves.",
    "CHECKPOINT_KEY": "The bid's name for its checkpoints (``bid-<id>``), given by the agent; "
    "the checkpoint library does not read it: ``checkpointer_for_run`` keys a run's checkpoints "
    "by its flow run (``flow-run-<id>``), the same key across every bid and attempt of the run.",
    "CHECKPOINT_URL": "Where the run's checkpoints go: a directory or ``s3://bucket/prefix``.",
    "CHECKPOINT_SIGNING_KEY": "The key the run's checkpoints are signed with (the worker gives "
    "each flow run its own); a checkpoint that does not verify is refused at restore.",
}
"""``protocol.JOB_ENV`` fields without an attribute docstring, by field name."""

ENV_DESCRIPTIONS = {
    "SPOTGPU_API_KEY": "A tenant's API key, for the commands that act as that tenant "
    "(``--api-key-file`` takes it from a file instead; never from the command line).",
    "SPOTGPU_AGENT_TOKEN": "The node agent's token (``sgn_...``) when ``--token-file`` is not "
    "given; the agent removes it from its own environment once read.",
    "SPOTGPU_HOME": "The node agent's default state directory is ``$SPOTGPU_HOME/agent-NAME`` "
    "(default ``~/.spotgpu``, or ``/var/lib/spotgpu`` for root); the market service keeps "
    "its key files and SQLite database here (the setting above).",
    "SPOTGPU_PACE_SECONDS": "In the worker's environment: how often it asks a paced run's "
    "bidding policy again (seconds, default 60).",
    # a SpotGPUCluster's worker job (protocol.DASK_ENV): set by the cluster in the bid's
    # sealed job.env, read by python -m prefect_spotgpu.dask.worker_job on the node
    "SPOTGPU_DASK_SCHEDULER": "In a Dask worker job: its scheduler's address as the nodes "
    "reach it (``tls://host:port``), set by ``SpotGPUCluster``.",
    "SPOTGPU_DASK_TLS_CA": "In a Dask worker job: the cluster's CA certificate (PEM), made "
    "for that cluster alone.",
    "SPOTGPU_DASK_TLS_CERT": "In a Dask worker job: the cluster's certificate (PEM).",
    "SPOTGPU_DASK_TLS_KEY": "In a Dask worker job: the cluster's private key (PEM); the market "
    "gives it only to the node holding the bid's allocation.",
    "SPOTGPU_DASK_NTHREADS": "In a Dask worker job: the worker's threads (``nthreads``).",
    "SPOTGPU_DASK_RESOURCES": "In a Dask worker job: its abstract resources, ``NAME=amount`` "
    "separated by spaces (``GPU=1``).",
    "SPOTGPU_DASK_MEMORY_LIMIT": "In a Dask worker job: its memory limit (``0``: none).",
    "SPOTGPU_DASK_JOIN_TIMEOUT": "In a Dask worker job: seconds it tries to reach the "
    "scheduler before the job fails, saying so.",
    "SPOTGPU_DASK_WORKER_HOST": "In a Dask worker job: where the worker listens (other workers "
    "fetch its results there); default: the node's address on its route to the scheduler.",
}
"""Other ``SPOTGPU_*`` variables the package reads by name, without a documented constant."""

WORKER_EVENT_DESCRIPTIONS = {
    "CREATED": "The worker placed a bid for the flow run.",
    "ALLOCATED": "The run's bid got GPUs: the worker handed the flow run to the allocation's "
    "job (payload: ``allocation_id``, ``node_id``).",
    "RESUMED": "As ``allocated``, for a run that resumes (from its checkpoint) after a preemption.",
    "NOTICED": "The running allocation got its notice (payload: the market event's, with its "
    "``deadline`` and ``reason``).",
    "PREEMPTED": "The allocation was preempted; the run is rescheduled to resume, or fails "
    "after ``max_preemptions``.",
    "ON_DEMAND": "The run's bidding policy moved it to on-demand capacity (payload: ``plan``).",
}
"""``protocol.WorkerEvent`` members without a docstring or comment."""

VALIDATOR_RULES = {
    "_timezone_is_known": "``timezone`` must be a known IANA time zone.",
    "_one_deadline": "Give ``deadline`` or ``deadline_hours``, not both.",
    "_fewest_nodes_within_the_gang": "``min_node_count`` is at most ``node_count`` (empty: "
    "the gang runs whole, always).",
    "_pacing_needs_work_and_a_deadline": "``gpu_hours`` needs a deadline (``deadline`` or "
    "``deadline_hours``): the bidding policy paces the work to it; with ``deadline_hours``, "
    "``gpu_hours`` cannot exceed it.",
}
"""Model validators of the worker's job configuration without a docstring, by name."""


# --------------------------------------------------------------------------- markdown helpers

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def prose(text: str | None) -> str:
    """Plain text (a docstring, a help text) as Markdown: code spans kept, anything that would
    read as HTML or emphasis escaped."""
    if not text:
        return ""
    out, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape(text[last : match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(_escape(text[last:]))
    return "".join(out)


def _escape(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("&", "&amp;")
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    for char in "*[]":
        text = text.replace(char, "\\" + char)
    return re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", text)


def cell(text: str | None, markdown: bool = False) -> str:
    """Text for one table cell (plain text, or ``markdown`` already): one line, pipes escaped
    (code spans keep theirs); empty: a dash."""
    text = text if markdown else prose(text)
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    out, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        out.append(text[last : match.start()].replace("|", "\\|"))
        out.append(match.group(0))
        last = match.end()
    out.append(text[last:].replace("|", "\\|"))
    return "".join(out) or "—"


def code(value: object) -> str:
    """``value`` as a code span."""
    text = str(value)
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`" if text else "`''`"


def table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if getattr(obj, "__doc__", None) else ""


def generated_from(*sources: str) -> str:
    names = ", ".join(code(s) for s in sources)
    return (
        f'!!! note "Generated"\n    This page is generated from {names} by `{REGENERATE}`: '
        "edit the code, then run that command; a test fails while the page and the code "
        "differ.\n\n"
    )


def src_files() -> Iterator[Path]:
    """The package's text files (sources, templates, static files), sorted."""
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            try:
                path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield path


def module_of(path: Path) -> str:
    return str(path.relative_to(SRC))


# --------------------------------------------------------------------------- the code's own
# documentation of constants: attribute docstrings and inline comments


@functools.cache
def _parsed(path: str) -> tuple[ast.Module, dict[int, str]]:
    source = Path(path).read_text(encoding="utf-8")
    comments = {}
    for token in tokenize.generate_tokens(iter(source.splitlines(keepends=True)).__next__):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    return ast.parse(source), comments


def _assigned_name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
    elif isinstance(node, ast.AnnAssign):
        target = node.target
    else:
        return None
    return target.id if isinstance(target, ast.Name) else None


def _body_docs(body: list[ast.stmt], comments: dict[int, str]) -> dict[str, str]:
    """Each assignment's attribute docstring (the string right after it), else its comment on
    the same line."""
    docs = {}
    for i, node in enumerate(body):
        name = _assigned_name(node)
        if name is None:
            continue
        following = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[name] = inspect.cleandoc(following.value.value)
        elif node.end_lineno in comments:
            comment = comments[node.end_lineno]
            docs[name] = comment[:1].upper() + comment[1:]
    return docs


def member_docs(cls: type) -> dict[str, str]:
    """The documentation of each attribute of ``cls`` (an enum's members, a dataclass's
    fields), from its source."""
    tree, comments = _parsed(inspect.getsourcefile(cls))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return _body_docs(node.body, comments)
    raise RuntimeError(f"no source for class {cls.__qualname__}")


def module_docs(path: Path) -> dict[str, str]:
    """The documentation of each module-level assignment in ``path``."""
    tree, comments = _parsed(str(path))
    return _body_docs(tree.body, comments)


# --------------------------------------------------------------------------- JSON schemas

CONSTRAINTS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "&gt; {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "&lt; {}"),
    ("minLength", "length ≥ {}"),
    ("maxLength", "length ≤ {}"),
    ("minItems", "items ≥ {}"),
    ("maxItems", "items ≤ {}"),
    ("minProperties", "entries ≥ {}"),
    ("maxProperties", "entries ≤ {}"),
    ("multipleOf", "multiple of {}"),
)


def schema_anchor(name: str) -> str:
    return slug("schema", name)


def schema_type(schema: dict, link: bool = True) -> str:
    """A JSON schema's type, in words (``$ref``: a link to the schema's section)."""
    if not schema:
        return "any"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{schema_anchor(name)})" if link else code(name)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            parts = [schema_type(s, link) for s in schema[key]]
            return " or ".join(dict.fromkeys(parts))
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    if "enum" in schema:
        return " or ".join(
            code(json.dumps(v) if not isinstance(v, str) else v) for v in schema["enum"]
        )
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(schema_type({**schema, "type": k}, link) for k in kind)
    if kind == "array":
        items = schema.get("items")
        return f"array of {schema_type(items, link)}" if items else "array"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return f"object of {schema_type(extra, link)}"
        return "object"
    if kind:
        return f"{kind} ({schema['format']})" if "format" in schema else kind
    return "any"


def schema_constraints(schema: dict) -> list[str]:
    """The schema's constraints (and its alternatives'), in words."""
    found = []
    for key, words in CONSTRAINTS:
        if key in schema:
            found.append(words.format(number(schema[key])))
    if "pattern" in schema:
        found.append(f"pattern {code(schema['pattern'])}")
    if schema.get("uniqueItems"):
        found.append("unique items")
    for key in ("anyOf", "oneOf", "allOf"):
        for alternative in schema.get(key, ()):
            found += schema_constraints(alternative)
    if isinstance(schema.get("items"), dict):
        found += [f"each {c}" for c in schema_constraints(schema["items"])]
    return list(dict.fromkeys(found))


def number(value: object) -> object:
    """``1.0`` as ``1``: JSON schemas write integer bounds as floats."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)
    return value


def json_value(value: object) -> str:
    return code(json.dumps(value))


# =========================================================================== reference/cli.md


def _typer_context():
    """The Context class of the click the typer app is built on (typer may vendor its own)."""
    import typer

    command = typer.main.get_command(_cli_app())
    return command, type(command.make_context("spotgpu", [], resilient_parsing=True))


def _cli_app():
    from prefect_spotgpu.cli.app import app

    return app


def cli_commands() -> list[tuple[str, object, object]]:
    """Every visible command and group of ``spotgpu``: (full name, command, its context)."""
    root, context_class = _typer_context()
    found = []

    def walk(command, name: str, context) -> None:
        if getattr(command, "hidden", False):
            return
        found.append((name, command, context))
        if hasattr(command, "list_commands"):
            for sub_name in command.list_commands(context):
                sub = command.get_command(context, sub_name)
                if sub is None:
                    continue
                walk(
                    sub,
                    f"{name} {sub_name}",
                    context_class(sub, info_name=sub_name, parent=context),
                )

    walk(root, "spotgpu", context_class(root, info_name="spotgpu"))
    return found


def _param_type(param, context) -> str:
    choices = getattr(getattr(param, "type", None), "choices", None)
    try:
        shown = param.display_type(context)  # typer's own parameters
    except (AttributeError, TypeError):
        shown = getattr(getattr(param, "type", None), "name", "") or ""
    shown = shown.strip("<>")
    if choices is None and re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", shown):
        choices = shown.split("|")
    if choices:
        return "one of " + ", ".join(code(c) for c in choices)
    if shown.endswith(" range"):
        shown = shown.removesuffix(" range")
        low, high = getattr(param, "min", None), getattr(param, "max", None)
        bounds = [f"≥ {low}" if low is not None else "", f"≤ {high}" if high is not None else ""]
        return f"{shown}, " + ", ".join(b for b in bounds if b)
    return shown or "text"


def _param_default(param) -> str:
    if param.required:
        return "required"
    default = param.default
    if callable(default):
        return "computed"
    if getattr(param, "is_flag", False) and getattr(param, "secondary_opts", None):
        return code(param.opts[0] if default else param.secondary_opts[0])
    if default is None or default == () or getattr(param, "show_default", True) is False:
        return "—"
    if isinstance(default, enum.Enum):
        default = default.value
    return code(default)


def _param_names(param) -> str:
    if param.param_type_name == "argument":
        return code(param.name.upper())
    names = list(param.opts) + list(getattr(param, "secondary_opts", ()) or ())
    return " / ".join(code(n) for n in names)


def cli_envvars() -> dict[str, list[tuple[str, object]]]:
    """Each ``SPOTGPU_*`` variable an option reads: the commands and the option."""
    found: dict[str, list[tuple[str, object]]] = {}
    for name, command, _ in cli_commands():
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            envvars = param.envvar or ()
            for envvar in [envvars] if isinstance(envvars, str) else envvars:
                found.setdefault(envvar, []).append((name, param))
    return found


def render_cli() -> str:
    commands = cli_commands()
    out = ["# Command line\n\n", generated_from("prefect_spotgpu.cli.app:app")]
    out.append(
        "`spotgpu` is installed with the package. Every command takes `--help`; options that "
        "can come from an environment variable name it in the *env var* column. Keys are "
        "taken from files or the environment, never from the command line.\n\n"
    )
    out.append("## Commands {#commands}\n\n")
    out.append(
        table(
            ["Command", "What it does"],
            (
                [f"[{code(name)}](#{slug(name)})", cell(command.get_short_help_str(limit=200))]
                for name, command, _ in commands[1:]
            ),
        )
    )
    for name, command, context in commands:
        depth = name.count(" ")
        level = "#" * min(2 + max(depth - 1, 0), 4)
        out.append(f"\n{level} {name} {{#{slug(name)}}}\n\n")
        if command.help:
            out.append(prose(inspect.cleandoc(command.help).replace("\b\n", "")) + "\n\n")
        if getattr(command, "deprecated", False):
            out.append('!!! warning "Deprecated"\n    This command is deprecated.\n\n')
        usage = " ".join(command.collect_usage_pieces(context))
        out.append(f"```text\n{name} {usage}\n```\n\n")
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        if params:
            rows = []
            for param in params:
                envvars = param.envvar or ()
                envvars = [envvars] if isinstance(envvars, str) else list(envvars)
                rows.append(
                    [
                        _param_names(param),
                        cell(_param_type(param, context), markdown=True),
                        _param_default(param),
                        ", ".join(code(e) for e in envvars) or "—",
                        cell(getattr(param, "help", None) or ""),
                    ]
                )
            out.append(table(["Option / argument", "Type", "Default", "Env var", "Help"], rows))
        if hasattr(command, "list_commands"):
            subs = [(n, c) for n, c, _ in commands if n.rsplit(" ", 1)[0] == name and n != name]
            if subs:
                out.append(
                    "\n"
                    + table(
                        ["Subcommand", "What it does"],
                        (
                            [f"[{code(n)}](#{slug(n)})", cell(c.get_short_help_str(limit=200))]
                            for n, c in subs
                        ),
                    )
                )
    return "".join(out)


# =========================================================================== reference/rest-api.md


@contextlib.contextmanager
def throwaway_home() -> Iterator[Path]:
    """A temporary ``SPOTGPU_HOME`` (mode 0700), set in the environment meanwhile: nothing the
    script does reaches ``~/.spotgpu``."""
    saved = os.environ.get("SPOTGPU_HOME")
    with tempfile.TemporaryDirectory(prefix="spotgpu-docs-") as directory:
        os.environ["SPOTGPU_HOME"] = directory
        try:
            yield Path(directory)
        finally:
            if saved is None:
                os.environ.pop("SPOTGPU_HOME", None)
            else:
                os.environ["SPOTGPU_HOME"] = saved


def openapi_schema() -> tuple[dict, object]:
    """The service's OpenAPI schema, from an app built over a throwaway SQLite database
    (migrated, never served; no tick), and the app."""
    from prefect_spotgpu.service.api import create_app
    from prefect_spotgpu.service.settings import ServiceSettings

    with throwaway_home() as home:
        settings = ServiceSettings(
            home=home,
            db_url=f"sqlite:///{home / 'market.db'}",
            admin_key="sgadm_docs-build-only",
            run_ticker=False,
        )
        app = create_app(settings, background=False)
        schema = app.openapi()
        app.state.engine.dispose()
    return schema, app


def _role_words() -> dict[str, str]:
    from prefect_spotgpu.service.roles import Role

    docs = member_docs(Role)
    return {role.value: docs.get(role.name, "") for role in Role}


def render_rest_api() -> str:
    from prefect_spotgpu.service.roles import ROUTE_ROLES, Role

    schema, _ = openapi_schema()
    info = schema["info"]
    out = [
        "# REST API\n\n",
        generated_from(
            "prefect_spotgpu.service.api:create_app", "prefect_spotgpu.service.roles.ROUTE_ROLES"
        ),
    ]
    out.append(
        f"**{prose(info['title'])}** {code(info.get('version', ''))}: "
        f"{prose(info.get('description', ''))}\n\n"
    )
    out.append(
        "Every route answers JSON. A route that needs a key takes it as "
        "`Authorization: Bearer <key>`; a missing or unknown key is a 401, a key of the wrong "
        "role a 403. A running service serves the same schema at `/openapi.json` and its "
        "interactive form at `/docs`.\n\n"
    )
    out.append("## Roles {#roles}\n\n")
    words = _role_words()
    out.append(table(["Role", "Who"], ([code(r.value), cell(words[r.value])] for r in Role)))

    operations: dict[str, list[tuple[str, str, dict]]] = {}
    seen = set()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            if method.startswith("x-") or method == "parameters":
                continue
            tag = (operation.get("tags") or ["other"])[0]
            operations.setdefault(tag, []).append((method.upper(), path, operation))
            seen.add((method.upper(), path))

    out.append("\n## Routes {#routes}\n\n")
    out.append(
        table(
            ["Route", "Roles", "Summary"],
            (
                [
                    f"[{code(method + ' ' + path)}](#{slug(method, path)})",
                    _roles(ROUTE_ROLES, method, path),
                    cell(op.get("summary", "")),
                ]
                for tag in operations
                for method, path, op in operations[tag]
            ),
        )
    )
    for tag, ops in operations.items():
        out.append(f"\n## {tag} {{#tag-{slug(tag)}}}\n")
        for method, path, op in ops:
            out.append(f"\n### `{method} {path}` {{#{slug(method, path)}}}\n\n")
            if op.get("summary"):
                out.append(f"**{prose(op['summary'])}**\n\n")
            if op.get("description"):
                out.append(prose(op["description"]) + "\n\n")
            if op.get("deprecated"):
                out.append('!!! warning "Deprecated"\n    This route is deprecated.\n\n')
            out.append(f"**Roles:** {_roles(ROUTE_ROLES, method, path)}\n\n")
            params = op.get("parameters", [])
            if params:
                out.append(
                    table(
                        [
                            "Parameter",
                            "In",
                            "Type",
                            "Required",
                            "Default",
                            "Constraints",
                            "Description",
                        ],
                        (
                            [
                                code(p["name"]),
                                p["in"],
                                cell(schema_type(p.get("schema", {})), markdown=True),
                                "yes" if p.get("required") else "no",
                                json_value(p["schema"]["default"])
                                if "default" in p.get("schema", {})
                                else "—",
                                cell(
                                    ", ".join(schema_constraints(p.get("schema", {}))) or "—",
                                    markdown=True,
                                ),
                                cell(
                                    p.get("description")
                                    or p.get("schema", {}).get("description", "")
                                ),
                            ]
                            for p in params
                        ),
                    )
                    + "\n"
                )
            body = op.get("requestBody")
            if body:
                for media, content in body.get("content", {}).items():
                    required = "" if body.get("required") else " (optional)"
                    out.append(
                        f"**Request body{required}:** {code(media)} "
                        f"{schema_type(content.get('schema', {}))}\n\n"
                    )
            responses = op.get("responses", {})
            out.append(
                table(
                    ["Status", "Description", "Body"],
                    (
                        [
                            code(status),
                            cell(response.get("description", "")),
                            cell(
                                " ".join(
                                    schema_type(c["schema"])
                                    for c in response.get("content", {}).values()
                                    if c.get("schema")
                                ),
                                markdown=True,
                            ),
                        ]
                        for status, response in responses.items()
                    ),
                )
            )

    hidden = sorted(key for key in ROUTE_ROLES if key not in seen)
    if hidden:
        out.append("\n## Routes outside the schema {#routes-outside-the-schema}\n\n")
        out.append(
            "Routes of the role table that the OpenAPI schema leaves out: they answer pages, a "
            "stream or Prometheus text rather than JSON.\n\n"
        )
        out.append(
            table(
                ["Route", "Roles"],
                ([code(f"{m} {p}"), _roles(ROUTE_ROLES, m, p)] for m, p in hidden),
            )
        )

    schemas = schema.get("components", {}).get("schemas", {})
    out.append("\n## Schemas {#schemas}\n")
    for name, definition in sorted(schemas.items()):
        out.append(f"\n### {name} {{#{schema_anchor(name)}}}\n\n")
        if definition.get("description"):
            out.append(prose(inspect.cleandoc(definition["description"])) + "\n\n")
        if "enum" in definition:
            out.append(
                f"A {definition.get('type', 'value')}, one of: "
                + ", ".join(json_value(v) for v in definition["enum"])
                + "\n"
            )
            continue
        properties = definition.get("properties", {})
        if not properties:
            out.append(f"Type: {schema_type(definition)}\n")
            continue
        required = set(definition.get("required", ()))
        out.append(
            table(
                ["Field", "Type", "Required", "Default", "Constraints", "Description"],
                (
                    [
                        code(field),
                        cell(schema_type(prop), markdown=True),
                        "yes" if field in required else "no",
                        json_value(prop["default"]) if "default" in prop else "—",
                        cell(", ".join(schema_constraints(prop)) or "—", markdown=True),
                        cell(prop.get("description", "")),
                    ]
                    for field, prop in properties.items()
                ),
            )
        )
    return "".join(out)


def _roles(route_roles: dict, method: str, path: str) -> str:
    roles = route_roles.get((method, path))
    if roles is None:
        raise RuntimeError(f"{method} {path} has no entry in service/roles.py's ROUTE_ROLES")
    from prefect_spotgpu.service.roles import Role

    return ", ".join(f"[{code(r.value)}](#roles)" for r in sorted(roles, key=list(Role).index))


# =========================================================================== job-variables.md


def render_job_variables() -> str:
    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    model = SpotGPUJobConfiguration
    schema = model.model_json_schema()
    definitions = schema.get("definitions", {}) | schema.get("$defs", {})
    out = [
        "# Job variables\n\n",
        generated_from("prefect_spotgpu.worker.config.SpotGPUJobConfiguration"),
    ]
    out.append(
        f"{prose(doc(model))} A deployment overrides any of them in its `job_variables`; the "
        "work pool's base job template holds the defaults below.\n\n"
    )
    out.append(
        table(
            ["Variable", "Title", "Type", "Default", "Constraints", "Choices"],
            (
                _variable_row(name, prop, definitions, model)
                for name, prop in schema["properties"].items()
            ),
        )
    )
    out.append("\n## Variables {#variables}\n")
    base = set(getattr(model.__mro__[1], "model_fields", {}))  # BaseJobConfiguration
    for name, prop in schema["properties"].items():
        out.append(f"\n### `{name}` {{#{slug(name)}}}\n\n")
        if prop.get("title"):
            out.append(f"**{prose(prop['title'])}**")
            out.append(" (Prefect's own, on every work pool)\n\n" if name in base else "\n\n")
        out.append(prose(prop.get("description", "")) + "\n")
        if name == "gpu_model":
            out.append("\n" + _gpu_models())

    rules = []
    for klass in (SpotGPUJobConfiguration,):
        validators = klass.__pydantic_decorators__.model_validators
        for name, decorator in validators.items():
            text = doc(decorator.func) or VALIDATOR_RULES.get(name)
            if not text:
                raise RuntimeError(
                    f"{klass.__qualname__}.{name} has no docstring: add one, or describe it "
                    f"in {THIS}'s VALIDATOR_RULES"
                )
            rules.append((klass.__name__, name, text))
    known = {name for _, name, _ in rules}
    stale = sorted(set(VALIDATOR_RULES) - known)
    if stale:
        raise RuntimeError(f"{THIS}: VALIDATOR_RULES names no validator: {stale}")
    if rules:
        out.append("\n## Rules across variables {#rules}\n\n")
        out.append(
            "Besides each variable's own constraints, a flow run's job configuration (the "
            "variables, templated) is refused before any bid is placed unless:\n\n"
        )
        for klass, name, text in rules:
            out.append(f"- {prose(text)} (`{klass}.{name}`)\n")
    return "".join(out)


def _gpu_models() -> str:
    """The market's GPU models (``market.gpus.DEFAULT_CATALOG``), as a table."""
    from prefect_spotgpu.market import DEFAULT_CATALOG

    models = sorted(DEFAULT_CATALOG, key=lambda m: m.on_demand_price)
    return (
        "The models the market sells (`prefect_spotgpu.market.gpus.DEFAULT_CATALOG`); any "
        "spelling below, or NVML's name of the card, is accepted and normalised. Unknown "
        "names are refused with the list of known models; `GpuCatalog.register` adds "
        "others.\n\n"
        + table(
            ["Model", "Memory", "On-demand price / GPU-hour", "Other spellings accepted"],
            (
                [
                    code(m.name),
                    f"{m.memory_gb} GB",
                    f"{m.on_demand_price:.2f}",
                    ", ".join(code(a) for a in m.aliases) or "—",
                ]
                for m in models
            ),
        )
    )


def _variable_row(name: str, prop: dict, definitions: dict, model) -> list[str]:
    choices = prop.get("enum")
    if choices is None:
        for alternative in prop.get("anyOf", ()):
            if "enum" in alternative:
                choices = (choices or []) + alternative["enum"]
    kind = schema_type(prop, link=False)
    if choices:
        kind = prop.get("type") or "string"
    field = model.model_fields[name]
    if "default" in prop:
        default = json_value(prop["default"])
    elif field.is_required():
        default = "required"
    else:
        default = "—"
    return [
        f"[{code(name)}](#{slug(name)})",
        cell(prop.get("title", "")),
        cell(kind, markdown=True),
        default,
        cell(", ".join(schema_constraints(prop)) or "—", markdown=True),
        cell(", ".join(code(c) for c in choices) if choices else "", markdown=True),
    ]


# =========================================================================== settings.md


def _annotation(annotation) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(typing|pathlib|pydantic\.types|pydantic)\.", "", str(annotation))


def _setting_default(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
        home = Path.home()
        if isinstance(value, Path) and value.is_relative_to(home):
            return code("~/" + str(value.relative_to(home)))
        return code(value)
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "—"
    if isinstance(field.default, enum.Enum):
        return code(field.default.value)
    return code(field.default)


def _files_reading(name: str, *spellings: str) -> list[str]:
    """The package's files that name ``name`` (or one of ``spellings``), its definition in
    ``protocol.py`` aside."""
    found = []
    for path in src_files():
        text = path.read_text(encoding="utf-8")
        if path.name == "protocol.py" and path.parent == PACKAGE:
            continue
        if re.search(rf"\b{re.escape(name)}\b", text) or any(s in text for s in spellings):
            found.append(module_of(path))
    return found


def render_settings() -> str:
    from prefect_spotgpu import protocol
    from prefect_spotgpu.service.settings import ServiceSettings

    covered: set[str] = set()
    anchored: set[str] = set()

    def var(env: str) -> str:
        """The variable's name, with an anchor (``settings.md#spotgpu-db-url``) the first
        time."""
        if env in anchored:
            return code(env)
        anchored.add(env)
        return f'<a id="{slug(env)}"></a>{code(env)}'

    out = [
        "# Settings and environment variables\n\n",
        generated_from(
            "prefect_spotgpu.service.settings.ServiceSettings",
            "prefect_spotgpu.protocol.JOB_ENV",
            "the command line's options",
            "the package's SPOTGPU_* constants",
        ),
    ]
    out.append(
        "Every `SPOTGPU_*` variable the package reads, by who reads it. A variable added to "
        "the code without a description here fails the reference's generation.\n\n"
    )

    # -- the market service
    prefix = ServiceSettings.model_config.get("env_prefix", "")
    properties = ServiceSettings.model_json_schema().get("properties", {})
    out.append("## The market service {#service}\n\n")
    out.append(
        f"{prose(doc(ServiceSettings))} Read by `spotgpu server start` (and by `spotgpu admin` "
        "commands, which find the admin key the same way).\n\n"
    )
    stale = sorted(set(SETTING_DESCRIPTIONS) - set(ServiceSettings.model_fields))
    if stale:
        raise RuntimeError(f"{THIS}: SETTING_DESCRIPTIONS names no setting: {stale}")
    rows = []
    for name, field in ServiceSettings.model_fields.items():
        env = f"{prefix}{name}".upper()
        covered.add(env)
        description = field.description or SETTING_DESCRIPTIONS.get(name)
        if not description:
            raise RuntimeError(
                f"ServiceSettings.{name} has no description: give it one, or describe it in "
                f"{THIS}'s SETTING_DESCRIPTIONS"
            )
        rows.append(
            [
                var(env),
                cell(_annotation(field.annotation)),
                _setting_default(field),
                cell(", ".join(schema_constraints(properties.get(name, {}))) or "—", markdown=True),
                cell(description),
            ]
        )
    out.append(table(["Variable", "Type", "Default", "Constraints", "Description"], rows))

    # -- the command line
    out.append("\n## The command line {#cli}\n\n")
    out.append(
        "Options that fall back on an environment variable (see the [command line](cli.md)).\n\n"
    )
    rows = []
    for env, uses in sorted(cli_envvars().items()):
        if not env.startswith("SPOTGPU_"):
            continue
        covered.add(env)
        helps = list(dict.fromkeys(getattr(p, "help", None) or "" for _, p in uses))
        options = sorted({p.opts[0] for _, p in uses})
        commands = ", ".join(f"[{code(n)}](cli.md#{slug(n)})" for n, _ in uses)
        rows.append(
            [
                var(env),
                ", ".join(code(o) for o in options),
                commands,
                _param_default(uses[0][1]),
                cell(" ".join(helps)),
            ]
        )
    out.append(table(["Variable", "Option", "Commands", "Default", "Description"], rows))

    # -- what a job gets
    job_docs = member_docs(type(protocol.JOB_ENV))
    stale = sorted(set(JOB_ENV_DESCRIPTIONS) - set(vars(protocol.JOB_ENV)))
    if stale:
        raise RuntimeError(f"{THIS}: JOB_ENV_DESCRIPTIONS names no JOB_ENV field: {stale}")
    out.append("\n## What a job gets {#job}\n\n")
    out.append(prose(doc(type(protocol.JOB_ENV))) + "\n\n")
    rows = []
    for attr, env in vars(protocol.JOB_ENV).items():
        description = job_docs.get(attr) or JOB_ENV_DESCRIPTIONS.get(attr)
        if not description:
            raise RuntimeError(
                f"protocol.JOB_ENV.{attr} ({env}) has no description: give it an attribute "
                f"docstring, or describe it in {THIS}'s JOB_ENV_DESCRIPTIONS"
            )
        covered.add(env)
        spellings = [f"JOB_ENV.{attr}"]
        if env in getattr(protocol, "GANG_ENV_NAMES", ()):
            spellings.append("GANG_ENV_NAMES")
        readers = _files_reading(env, *spellings)
        rows.append(
            [
                var(env),
                code(f"JOB_ENV.{attr}"),
                cell(description),
                ", ".join(code(r) for r in readers) or "—",
            ]
        )
    out.append(table(["Variable", "Constant", "Description", "Read or set in"], rows))
    torch_env = getattr(protocol, "TORCH_ENV", None)
    if torch_env is not None:
        torch_docs = member_docs(type(torch_env))
        out.append(
            "\nA gang member also gets torch.distributed's own variables: "
            + ", ".join(
                code(v) + (f" ({prose(torch_docs[a])})" if a in torch_docs else "")
                for a, v in vars(torch_env).items()
            )
            + ".\n"
        )

    # -- the rest: constants of the package's modules, and names read directly
    others: dict[str, tuple[str, str]] = {}
    for path in src_files():
        if path.suffix != ".py":
            continue
        try:
            tree, _ = _parsed(str(path))
        except SyntaxError:
            continue
        docs = module_docs(path)
        for node in tree.body:
            name = _assigned_name(node)
            value = getattr(node, "value", None)
            if (
                name
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
                and ENV_NAME.fullmatch(value.value)
                and value.value not in covered
            ):
                module = module_of(path).removesuffix(".py").replace("/", ".")
                description = docs.get(name) or ENV_DESCRIPTIONS.get(value.value)
                if not description:
                    raise RuntimeError(
                        f"{module}.{name} ({value.value}) has no description: give it an "
                        f"attribute docstring, or describe it in {THIS}'s ENV_DESCRIPTIONS"
                    )
                others[value.value] = (f"{module}.{name}", description)
    for env, description in ENV_DESCRIPTIONS.items():
        if env not in others:
            others[env] = ("", description)
    rows = []
    dask_env = getattr(protocol, "DASK_ENV", None)  # read through the constant's name
    dask_spellings = {v: f"DASK_ENV.{a}" for a, v in vars(dask_env or object()).items()}
    for env, (constant, description) in sorted(others.items()):
        spellings = [constant.rsplit(".", 1)[-1]] if constant else []
        spellings += [dask_spellings[env]] if env in dask_spellings else []
        readers = _files_reading(env, *spellings)
        if not readers:
            raise RuntimeError(f"{THIS}: ENV_DESCRIPTIONS names {env}, which nothing reads")
        covered.add(env)
        rows.append(
            [
                var(env),
                code(constant) if constant else "—",
                cell(description),
                ", ".join(code(r) for r in readers),
            ]
        )
    out.append("\n## The node agent, the worker and the local stack {#other}\n\n")
    out.append(table(["Variable", "Constant", "Description", "Read in"], rows))

    # -- no drift: every SPOTGPU_* name in the package is on this page
    missing: dict[str, list[str]] = {}
    for path in src_files():
        for env in ENV_NAME.findall(path.read_text(encoding="utf-8")):
            if env not in covered:
                missing.setdefault(env, []).append(module_of(path))
    if missing:
        raise RuntimeError(
            "SPOTGPU_* variables with no description in the settings reference (give the "
            f"constant a docstring, or describe it in {THIS}'s ENV_DESCRIPTIONS): "
            + "; ".join(f"{env} in {sorted(set(files))}" for env, files in sorted(missing.items()))
        )
    return "".join(out)


# =========================================================================== events.md

EVENT_ENUM_ORDER = (
    "WorkerEvent",
    "EventKind",
    "BidStatus",
    "AllocationStatus",
    "ReportOutcome",
    "NoticeReason",
    "EndReason",
    "Capacity",
)
"""The order of the events page's sections; any other enum of ``protocol`` follows."""


def render_events() -> str:
    from prefect_spotgpu import protocol

    enums = {
        name: value
        for name, value in vars(protocol).items()
        if isinstance(value, type)
        and issubclass(value, enum.Enum)
        and value is not enum.StrEnum
        and issubclass(value, str)
    }
    ordered = [n for n in EVENT_ENUM_ORDER if n in enums] + sorted(
        n for n in enums if n not in EVENT_ENUM_ORDER
    )
    out = ["# Events and statuses\n\n", generated_from("prefect_spotgpu.protocol")]
    out.append(prose(doc(protocol).split("\n\n")[0]) + "\n\n")
    out.append(
        "The worker's Prefect events appear in Prefect's event feed (and can trigger "
        "automations); a bid's own events are what `GET /api/v1/bids/{bid_id}/events`, the "
        "webhooks and the node agents' feed carry.\n"
    )
    groups = {
        name: value
        for name, value in vars(protocol).items()
        if isinstance(value, tuple | frozenset)
        and value
        and all(isinstance(v, enum.Enum) for v in value)
    }
    module_notes = module_docs(Path(inspect.getsourcefile(protocol)))
    for name in ordered:
        cls = enums[name]
        docs = member_docs(cls)
        out.append(f"\n## {name} {{#{slug(name)}}}\n\n")
        out.append(f"`{cls.__module__}.{cls.__qualname__}`")
        if cls.__module__ != protocol.__name__:
            out.append(" (re-exported by `prefect_spotgpu.protocol`)")
        out.append("\n\n" + prose(doc(cls)) + "\n\n")
        is_worker_event = name == "WorkerEvent"
        if is_worker_event:
            stale = sorted(set(WORKER_EVENT_DESCRIPTIONS) - set(cls.__members__))
            if stale:
                raise RuntimeError(f"{THIS}: WORKER_EVENT_DESCRIPTIONS names no member: {stale}")
        rows = []
        for member in cls:
            text = docs.get(member.name, "")
            if is_worker_event:
                text = text or WORKER_EVENT_DESCRIPTIONS.get(member.name, "")
                if not text:
                    raise RuntimeError(
                        f"WorkerEvent.{member.name} has no description: document it, or "
                        f"describe it in {THIS}'s WORKER_EVENT_DESCRIPTIONS"
                    )
                shown = code(member.event)
            else:
                shown = code(member.value)
            rows.append([shown, code(member.name), cell(text)])
        heading = "Prefect event" if is_worker_event else "Value"
        out.append(table([heading, "Member", "Meaning"], rows))
        for group, members in groups.items():
            if all(isinstance(m, cls) for m in members):
                note = module_notes.get(group, "")
                out.append(
                    f"\n`{group}`: "
                    + ", ".join(code(m.value) for m in sorted(members, key=list(cls).index))
                    + (f" — {prose(note)}" if note else "")
                    + "\n"
                )

    labels = getattr(protocol, "LABELS", None)
    if labels is not None:
        docs = member_docs(type(labels))
        out.append("\n## Labels {#labels}\n\n")
        out.append(prose(doc(type(labels))) + "\n\n")
        out.append(
            table(
                ["Label", "Constant", "Meaning"],
                (
                    [code(value), code(f"LABELS.{attr}"), cell(docs.get(attr, ""))]
                    for attr, value in vars(labels).items()
                ),
            )
        )
    return "".join(out)


# =========================================================================== metrics.md


def render_metrics() -> str:
    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.metrics_core import Metric

    from prefect_spotgpu.service import metrics

    found: list[tuple[str, str, tuple, str, str, object]] = []

    def add_wrapper(wrapper, where: str) -> None:
        buckets = getattr(wrapper, "_upper_bounds", None)
        found.append(
            (
                wrapper._name,
                wrapper._type,
                tuple(wrapper._labelnames),
                wrapper._documentation,
                where,
                buckets,
            )
        )

    for name, value in vars(metrics).items():  # module-level metrics (the global registry)
        if isinstance(value, MetricWrapperBase):
            add_wrapper(value, f"{metrics.__name__}.{name}")
    for cls_name, cls in vars(metrics).items():
        if not (isinstance(cls, type) and cls.__module__ == metrics.__name__):
            continue
        if cls_name == "ServiceMetrics" or _makes_wrappers(cls):
            instance = cls()
            for attr, value in vars(instance).items():
                if isinstance(value, MetricWrapperBase):
                    add_wrapper(value, f"{cls_name}.{attr}")
        describe = getattr(cls, "describe", None)
        if describe is not None and callable(describe):
            collector = cls.__new__(cls)
            for family in describe(collector):
                if isinstance(family, Metric):
                    found.append(
                        (
                            family.name,
                            family.type,
                            tuple(getattr(family, "_labelnames", ())),
                            family.documentation,
                            f"{cls_name} (read at each scrape)",
                            None,
                        )
                    )
    if not found:
        raise RuntimeError("service/metrics.py defines no metric the generator can find")
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "summary": ["_sum", "_count"],
    }
    out = ["# Metrics\n\n", generated_from("prefect_spotgpu.service.metrics")]
    out.append(
        f"The market service serves Prometheus metrics at {code(metrics.PATH)} (text "
        "format, no key).\n\n"
    )
    out.append(
        table(
            ["Metric", "Type", "Labels", "Help", "Defined by"],
            (
                [
                    f"[{code(name)}](#{slug(name)})",
                    kind,
                    ", ".join(code(label) for label in labels) or "—",
                    cell(help_text),
                    code(where.partition(" ")[0]) + (" " + where.partition(" ")[2]).rstrip(),
                ]
                for name, kind, labels, help_text, where, _ in found
            ),
        )
    )
    for name, kind, labels, help_text, where, buckets in found:
        out.append(f"\n### `{name}` {{#{slug(name)}}}\n\n")
        out.append(f"{prose(help_text)}\n\n")
        exposed = [name + s for s in suffixes.get(kind, [""])]
        out.append(f"- Type: {kind}; exposed as " + ", ".join(code(e) for e in exposed) + "\n")
        if labels:
            out.append("- Labels: " + ", ".join(code(label) for label in labels) + "\n")
        if buckets:
            shown = [b for b in buckets if b != float("inf")]
            out.append("- Buckets (seconds): " + ", ".join(f"{b:g}" for b in shown) + "\n")
        owner, _, note = where.partition(" ")
        out.append(f"- Defined by: {code(owner)}{' ' + note if note else ''}\n")
    out.append("\n## Who writes them {#who-writes-them}\n\n")
    out.append(_rst_to_markdown(doc(metrics).split("\n\n", 1)[1]) + "\n")
    return "".join(out)


def _makes_wrappers(cls: type) -> bool:
    """Whether ``cls.__init__`` creates metrics (and takes no required argument)."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return False
    if any(
        p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in signature.parameters.values()
    ):
        return False
    source = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
    return bool(re.search(r"\b(Counter|Gauge|Histogram|Summary|Info|Enum)\(", source))


def _rst_to_markdown(text: str) -> str:
    """A module docstring's prose as Markdown: its ``code`` spans and **bold** read alike;
    only bare HTML-like text needs escaping."""
    lines = (
        prose(line) if not line.startswith("- ") else "- " + prose(line[2:])
        for line in text.splitlines()
    )
    return "\n".join(lines).replace("\\*\\*", "**")


# =========================================================================== write the pages

PAGES = {
    "reference/cli.md": render_cli,
    "reference/rest-api.md": render_rest_api,
    "reference/job-variables.md": render_job_variables,
    "reference/settings.md": render_settings,
    "reference/events.md": render_events,
    "reference/metrics.md": render_metrics,
}


def render_pages() -> dict[str, str]:
    """Every generated page's text, by its path under ``docs/``."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    prefect_home = None
    if "PREFECT_HOME" not in os.environ:  # Prefect (the worker's config imports it): a throwaway
        prefect_home = tempfile.mkdtemp(prefix="spotgpu-docs-prefect-")
        os.environ["PREFECT_HOME"] = prefect_home
    try:
        with throwaway_home():
            return {page: render() for page, render in PAGES.items()}
    finally:
        if prefect_home is not None:
            os.environ.pop("PREFECT_HOME", None)
            shutil.rmtree(prefect_home, ignore_errors=True)


def stale_pages(pages: dict[str, str], docs: Path = DOCS) -> list[str]:
    """The pages whose committed file under ``docs`` is missing or not ``pages``' text."""
    stale = []
    for page, text in pages.items():
        path = docs / page
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(page)
    return stale


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Generate the Reference pages from the code into docs/reference/."
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="write the stale pages")
    action.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming each stale page"
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs directory (%(default)s)")
    args = parser.parse_args(argv)
    pages = render_pages()
    stale = stale_pages(pages, args.docs)
    if args.check:
        for page in stale:
            print(f"{_shown(args.docs / page)} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for page in stale:
        path = args.docs / page
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(pages[page], encoding="utf-8")
        print(f"wrote {_shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
