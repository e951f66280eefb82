# ruff: noqa: RUF001, RUF002 -- pages write the multiplication sign and en dashes, so does this file
"""The hand-written pages say what the code and the benchmarks say.

Two kinds of drift this catches:

- **Benchmark figures.** Every figure a page shows from a benchmark is checked against the last
  run in ``benchmarks/results/*.json``: ``tests/docs_figures.py`` lists, for each paragraph or
  table row that shows one, the JSON value behind each figure in it, in order, and the page
  must show that value rounded as written. A scan then reads every paragraph and table row that
  reads as a measurement (the whole benchmarks page; elsewhere, text that says "benchmark",
  "measured", "median", a results file, a p50/p99 or a ratio such as ``1.3×``) and fails on a
  figure that no entry accounts for: a new figure is checked, or said not to be a benchmark's
  output (a workload's size, a target, an earlier run), with the reason.
- **Names.** Every ``SPOTGPU_*`` variable, every ``PREFECT_*`` variable a page has you set,
  every ``spotgpu ...`` command and its ``--options``, and every job variable a page names
  exists in the code: the settings, ``protocol``'s constants, the variables the package reads,
  Prefect's settings, the typer app's commands and the worker's job configuration.

Generated reference pages (``docs/reference/``, written by ``docs/gen_reference.py``) are
checked by ``tests/test_docs.py``; this file reads every other page and the README.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from docs_figures import FIGURES, Shown
from test_docs import GENERATED  # the reference pages the generator writes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"


def hand_written_pages() -> dict[str, str]:
    """Every page a person writes, by its path under ``docs/`` (the README as ``README.md``)."""
    pages = {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")}
    for path in sorted(DOCS.rglob("*.md")):
        name = path.relative_to(DOCS).as_posix()
        if name not in GENERATED and name != "changelog.md":
            pages[name] = path.read_text(encoding="utf-8")
    return pages


# =========================================================================== blocks of a page


@dataclass(frozen=True)
class Block:
    """One paragraph, list item, heading or table row of a page, on one line; ``context``
    is the text that says what its figures are (a table row: its table's header and the
    paragraph before the table)."""

    text: str
    context: str
    header: bool = False  # a table's header row: its labels, no figures


_FENCE = re.compile(r"^\s*(```|~~~)")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")
_TABLE_RULE = re.compile(r"^\s*\|[\s:|-]+\|\s*$")


def blocks(page: str) -> list[Block]:
    """The page's blocks in order, code blocks and HTML comments left out."""
    found: list[Block] = []
    lines: list[str] = []
    fence = None
    previous_paragraph, table_header = "", None

    def flush() -> None:
        nonlocal previous_paragraph
        if lines:
            text = " ".join(line.strip() for line in lines)
            found.append(Block(text, text))
            previous_paragraph = text
            lines.clear()

    for line in re.sub(r"<!--.*?-->", "", page, flags=re.S).splitlines():
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        if match := _FENCE.match(line):
            flush()
            fence = match.group(1)
            continue
        stripped = line.strip()
        if stripped.startswith("|"):
            flush()
            if _TABLE_RULE.match(line):
                continue
            header = table_header is None
            if header:
                table_header = stripped
            context = f"{previous_paragraph} {table_header} {stripped}"
            found.append(Block(stripped, context, header))
            continue
        table_header = None
        if not stripped or stripped.startswith("#") or _ITEM.match(line):
            flush()
            if stripped.startswith("#"):
                found.append(Block(stripped, stripped))
                continue
        if stripped:
            lines.append(stripped)
    flush()
    return found


# =========================================================================== figures in a block

_UNIT = r"(?:\s?[×%]|\s(?:ms|s|KB|MB|GB/s|GiB|points|bids/s|reads/s))"
FIGURE = re.compile(
    r"(?<![\w.\-:=<>#@])(?<!\w/)"  # not inside a name, a version, a path or an anchor
    r"(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?"
    rf"({_UNIT})?"
    r"(?![\w.]*\d|[\w-]|:\S|/[^\d\s])"
)
"""A number as a page shows a measurement: ``0.74 s``, ``1.33×``, ``57 %``, ``2,189``."""
_PAIRED = re.compile(rf"\s?[–/]\s?[\d,.]+{_UNIT}")
"""What follows the first number of a range or a pair that shares its unit (``5–10 s``,
``19 / 121 ms``)."""


def _plain(text: str) -> str:
    """The text without what is not prose: code spans, link targets, anchors, HTML tags."""
    text = re.sub(r"(`+).+?\1", lambda m: " " * len(m.group(0)), text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"\{#[^}]*\}", " ", text)
    text = re.sub(r"https?://\S+", " ", text)
    return re.sub(r"<[^>]+>", " ", text)


def figures(block: Block) -> list[str]:
    """The block's figures, in order: a decimal number, a number with a unit (s, ms, ×, %,
    KB, MB, GB/s, GiB, points, bids/s, reads/s) or sharing one with the next (``5–10 s``), or a
    number that begins a table's cell. A table row's first cell, its label, is left out."""
    if block.header:
        return []
    text = _plain(block.text)
    found = []
    for match in FIGURE.finditer(text):
        whole, decimals, unit = match.group(0), match.group(2), match.group(3)
        before = text[text.rfind("|", 0, match.start()) + 1 : match.start()]
        leads_a_cell = block.text.startswith("|") and not before.strip(" *")
        paired = _PAIRED.match(text, match.end())
        in_the_label = block.text.startswith("|") and text.find("|", 1) > match.start()
        if (decimals or unit or leads_a_cell or paired) and not in_the_label:
            found.append(whole.strip())
    return found


MEASUREMENT = re.compile(
    r"(?i:benchmark|measured|median|results/|\bp50\b|\bp90\b|\bp99\b)|\d\s?×(?!\s*[\dA-Z])"
)
"""What makes a paragraph or a table outside the benchmarks page read as a measurement."""
MEASUREMENT_PAGES = {"explanation/benchmarks.md"}
"""Pages that are measurements throughout."""


def measured_blocks(name: str, page: str) -> list[Block]:
    """The blocks of ``page`` whose figures must be accounted for."""
    every = name in MEASUREMENT_PAGES
    return [
        block
        for block in blocks(page)
        if figures(block) and (every or MEASUREMENT.search(block.context))
    ]


# =========================================================================== the results files


@cache
def results(name: str):
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def lookup(data, path: str):
    """``data`` at a dotted ``path``; a key may itself hold dots or spaces (the longest key
    that matches is taken), a list is indexed by number."""
    rest = path
    while rest:
        if isinstance(data, list):
            index, _, rest = rest.partition(".")
            data = data[int(index)]
            continue
        for key in sorted(data, key=len, reverse=True):
            if rest == key or rest.startswith(key + "."):
                data, rest = data[key], rest[len(key) + 1 :]
                break
        else:
            raise KeyError(f"no {rest!r} in {sorted(data)[:12]}")
    return data


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def value_of(spec: str, default_file: str) -> float:
    """The number a figure's ``spec`` names: a JSON path in ``default_file``, ``FILE:path``
    for another file, or arithmetic over ``{path}`` terms (``{a} / {b}``, ``{p} * 100``)."""
    terms: list[float] = []

    def term(path: str) -> float:
        file, _, inner = path.partition(".json:") if ".json:" in path else ("", "", path)
        value = lookup(results(f"{file}.json" if file else default_file), inner)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{path} is {value!r}, not a number")
        terms.append(float(value))
        return f"_[{len(terms) - 1}]"

    if "{" not in spec:
        term(spec)
        return terms[0]
    expression = re.sub(r"\{([^}]+)\}", lambda m: term(m.group(1)), spec)
    return _evaluate(ast.parse(expression, mode="eval").body, terms)


def _evaluate(node, terms: list[float]) -> float:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, terms), _evaluate(node.right, terms))
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.Subscript):  # _[i]: a term
        return terms[node.slice.value]
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def shows(figure: str, value: float) -> bool:
    """Whether ``figure`` (as the page writes it) is ``value`` rounded to its own precision."""
    number = re.match(r"[\d,]+(?:\.(\d+))?", figure)
    shown = float(number.group(0).replace(",", ""))
    decimals = len(number.group(1) or "")
    return abs(value - shown) <= 0.5 * 10**-decimals + 1e-9


# =========================================================================== checking figures


def figure_problems(shown: Shown, page: str) -> list[str]:
    """What is wrong with one entry of the table against its page (nothing: [])."""
    label = f"{shown.page}: {shown.where!r}"
    holding = [block for block in blocks(page) if shown.where in block.text]
    if len(holding) != 1:
        return [f"{label}: found in {len(holding)} paragraphs or rows, not one"]
    on_page = figures(holding[0])
    listed = [figure.partition(" = ")[0] for figure in shown.figures]
    if on_page != listed:
        return [f"{label}: the page shows {on_page}, the table lists {listed}"]
    problems = []
    for figure in shown.figures:
        text, _, spec = figure.partition(" = ")
        if not spec:
            if not shown.why:
                problems.append(f"{label}: {text!r} is not checked, and no why says what it is")
            continue
        try:
            value = value_of(spec, shown.results)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            problems.append(f"{label}: {text!r} = {spec}: {exc}")
            continue
        if not shows(text, value):
            problems.append(f"{label}: shows {text!r}, but {shown.results} {spec} is now {value:g}")
    return problems


def unaccounted(name: str, page: str, table: tuple[Shown, ...]) -> list[str]:
    """The measured blocks of a page no entry of the table finds, each with a template."""
    wheres = [shown.where for shown in table if shown.page == name]
    missing = []
    for block in measured_blocks(name, page):
        if not any(where in block.text for where in wheres):
            listed = ", ".join(f'"{figure}"' for figure in figures(block))
            missing.append(f'{name}: Shown("{name}", "{block.text[:50]}", "?.json", ({listed},))')
    return missing


def test_every_benchmark_figure_shows_its_results_file():
    pages = hand_written_pages()
    problems = []
    for shown in FIGURES:
        if shown.page not in pages:
            problems.append(f"{shown.page}: no such page")
            continue
        problems += figure_problems(shown, pages[shown.page])
    assert not problems, "\n".join(problems)


def test_no_figure_of_a_measurement_goes_unchecked():
    """A paragraph or table row that reads as a measurement is in ``tests/docs_figures.py``."""
    missing = []
    for name, page in hand_written_pages().items():
        missing += unaccounted(name, page, FIGURES)
    assert not missing, "add each to tests/docs_figures.py:\n" + "\n".join(missing)


# =========================================================================== names a page uses

SPOTGPU_NAME = re.compile(r"\bSPOTGPU_[A-Z0-9_]*[A-Z0-9]\b")
PREFECT_NAME = re.compile(r"\bPREFECT_[A-Z0-9_]*[A-Z0-9]\b")
ENV_NAME = re.compile(r"\b(?:SPOTGPU|PREFECT)_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9])(_?\*)?")
"""A variable's name on a page; ``SPOTGPU_DASK_*`` names a family by its prefix."""


def _texts(root: Path, suffixes: tuple[str, ...]):
    for path in sorted(root.rglob("*")):
        if path.suffix in suffixes and "__pycache__" not in path.parts:
            yield path, path.read_text(encoding="utf-8", errors="replace")


@cache
def known_variables() -> frozenset[str]:
    """Every environment variable a page may name: the service's settings (``SPOTGPU_`` and
    the field), every ``SPOTGPU_*`` name the package, its tests and its benchmarks read or set,
    Prefect's settings and the ``PREFECT_*`` names Prefect's own code reads
    (``PREFECT__FLOW_RUN_ID``)."""
    import prefect
    from prefect.settings import Settings
    from prefect.settings.legacy import _get_valid_setting_names

    from prefect_spotgpu.service.settings import ServiceSettings

    prefix = ServiceSettings.model_config["env_prefix"]
    names = {prefix + field.upper() for field in ServiceSettings.model_fields}
    for root, suffixes in (
        (ROOT / "src", (".py", ".js", ".html", ".css")),
        (ROOT / "tests", (".py",)),
        (ROOT / "benchmarks", (".py",)),
    ):
        for path, text in _texts(root, suffixes):
            if path != Path(__file__):  # this file names made-up ones on purpose
                names.update(SPOTGPU_NAME.findall(text))
    names.update(_get_valid_setting_names(Settings))
    for _, text in _texts(Path(prefect.__file__).parent, (".py",)):
        names.update(PREFECT_NAME.findall(text))
    return frozenset(names)


def unknown_variables(text: str) -> list[str]:
    """The ``SPOTGPU_*`` and ``PREFECT_*`` names in ``text`` nothing defines or reads."""
    known = known_variables()
    unknown = []
    for match in ENV_NAME.finditer(text):
        name, family = match.group(0).rstrip("_*"), match.group(1)
        found = any(k.startswith(name + "_") for k in known) if family else name in known
        if not found:
            unknown.append(match.group(0))
    return unknown


# --------------------------------------------------------------------------- spotgpu commands

_FENCED = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n(.*?)^[ \t]*\1", re.S | re.M)
_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def code_of(page: str) -> list[str]:
    """What a page shows as code: each fenced block's lines (a line ending in ``\\`` joined to
    the next), and each code span of its prose."""
    fragments = []
    for match in _FENCED.finditer(page):
        fragments += match.group(2).replace("\\\n", " ").splitlines()
    prose = _FENCED.sub("", page)
    fragments += [match.group(2) for match in _SPAN.finditer(prose)]
    return fragments


_INVOCATION = re.compile(r"(?:^|(?<=[\s(\[\"'`]))(?:\S*/bin/)?spotgpu(?=\s+[a-z.…])")
"""``spotgpu`` as the command it is: at a word's start (or a ``bin/`` path's end), followed
by a subcommand; never ``prefect-spotgpu`` or ``prefect_spotgpu``."""
_NOT_THE_COMMAND = re.compile(
    r"(?:^|\s)(?:-[A-Za-z]|--[\w-]+|useradd|groupadd|chown|createuser|createdb"
    r"|the|a|an|its|your)\s+$"
)
"""What makes ``spotgpu`` after it a user's or a database's name (``sudo -u spotgpu``), or
the command's name in a sentence (``the spotgpu command``)."""
_SHELL_BREAK = re.compile(r"\s(?:&&|\|\||\||;|&)(?:\s|$)|[;)]\s|\$\(")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@cache
def spotgpu_command():
    import typer

    from prefect_spotgpu.cli.app import app

    return typer.main.get_command(app)


def _is_group(command) -> bool:
    return callable(getattr(command, "list_commands", None))  # typer's own click's Group


def _subcommand(group, name: str):
    context = group.make_context(group.name or "spotgpu", [], resilient_parsing=True)
    return group.get_command(context, name)


def _options(command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(
            o for o in (*param.opts, *getattr(param, "secondary_opts", ())) if o.startswith("--")
        )
    return names


def command_problems(fragment: str) -> list[str]:
    """Each ``spotgpu ...`` invocation in ``fragment`` whose commands or ``--options`` the
    typer app does not have. Words after the command that are not subcommands are its
    arguments (``NAME``, ``alice``); ``a|b`` and ``a/b`` name alternatives; ``...`` stops."""
    problems = []
    for match in _INVOCATION.finditer(fragment):
        if _NOT_THE_COMMAND.search(fragment[: match.start()]):
            continue
        rest = fragment[match.end() :]
        following = _INVOCATION.search(rest)
        rest = rest[: following.start()] if following else rest
        cut = _SHELL_BREAK.search(rest)
        words = (rest[: cut.start()] if cut else rest).split()
        command, path = spotgpu_command(), ["spotgpu"]
        options_known = True
        for word in words:
            word = word.strip("`'\"(),[]")
            if not _is_group(command) or word.startswith("-") or not word:
                break
            if word in ("...", "…") or not re.fullmatch(r"[a-z][a-z0-9|/-]*", word):
                break
            choices = re.split(r"[|/]", word)
            found = [_subcommand(command, choice) for choice in choices]
            missing = [c for c, sub in zip(choices, found, strict=True) if sub is None]
            if missing:
                problems.append(f"`{' '.join(path)} {word}`: no command {', '.join(missing)}")
                options_known = False
                break
            path.append(word)
            if len(found) > 1:
                options_known = False  # alternatives: whose options would they be?
                break
            command = found[0]
        if not options_known:
            continue
        known = _options(command)
        for option in _OPTION.findall(" ".join(words)):
            if option not in known:
                problems.append(f"`{' '.join(path)}` has no option {option}")
    return problems


# --------------------------------------------------------------------------- job variables


@cache
def known_job_variables() -> frozenset[str]:
    """The worker's job variables: its job configuration's fields, which are also the pool's
    variables (``SpotGPUWorker``'s base job template)."""
    from prefect_spotgpu.worker import SpotGPUWorker
    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    template = SpotGPUWorker.get_default_base_job_template()
    return frozenset(SpotGPUJobConfiguration.model_fields) | frozenset(
        template["variables"]["properties"]
    )


_YAML_KEY = re.compile(r"^(\s*)(?:-\s+)?([A-Za-z_][\w-]*):")
_NAMED_IN_PROSE = re.compile(
    r"job variables?\s+`(\w+)`|`(\w+)`\s+(?:job\s+)?variables?\b(?!\s*[=(])"
)
_VARIABLE_TABLE_HEADER = re.compile(r"\|\s*variable\s*\|", re.I)


def job_variables_named(page: str) -> list[str]:
    """The job variables ``page`` names: keys under a YAML ``job_variables:``, keyword
    arguments of ``spot_job_variables(...)`` and ``@spot_gpu(...)`` and the keys of a
    ``job_variables={...}`` in its Python, a code span called a (job) variable in its prose,
    and the first column of a table headed ``variable``."""
    named = []
    for match in _FENCED.finditer(page):
        code = match.group(2)
        named += _python_job_variables(code)
        named += _yaml_job_variables(code)
    prose = _FENCED.sub("", page)
    for match in _NAMED_IN_PROSE.finditer(prose):
        named.append(match.group(1) or match.group(2))
    in_table = False
    for line in prose.splitlines():
        stripped = line.strip()
        if not stripped.startswith("|"):
            in_table = False
            continue
        if _VARIABLE_TABLE_HEADER.match(stripped):
            in_table = True
            continue
        if in_table and not _TABLE_RULE.match(line):
            first = stripped.split("|")[1]
            named += re.findall(r"`(\w+)`", first)
    return named


def _python_job_variables(code: str) -> list[str]:
    """From a block of Python, or from each of its lines alone when the block is a sketch
    that does not parse (a decorator without its function)."""
    try:
        trees = [ast.parse(code)]
    except SyntaxError:
        trees = []
        for line in code.splitlines():
            with contextlib.suppress(SyntaxError):
                trees.append(ast.parse(line.strip().removeprefix("@")))
    named = []
    for node in (node for tree in trees for node in ast.walk(tree)):
        if not isinstance(node, ast.Call):
            continue
        function = (
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        )
        if function in ("spot_job_variables", "spot_gpu"):
            named += [k.arg for k in node.keywords if k.arg not in (None, "work_pool", "launcher")]
        for keyword in node.keywords:
            if keyword.arg == "job_variables" and isinstance(keyword.value, ast.Dict):
                named += [
                    k.value
                    for k in keyword.value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                ]
    return named


def _yaml_job_variables(code: str) -> list[str]:
    named = []
    under = child = None  # the indentation of a ``job_variables:`` and of its keys
    for line in code.splitlines():
        match = _YAML_KEY.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        if under is not None and indent <= under:
            under = None
        if under is not None:
            child = indent if child is None else child
            if indent == child:
                named.append(match.group(2))
        elif match.group(2) == "job_variables":
            under, child = indent, None
    return named


# =========================================================================== the tests of names


def test_every_variable_a_page_names_exists():
    unknown = [
        f"{name}: {variable}"
        for name, page in hand_written_pages().items()
        for variable in unknown_variables(page)
    ]
    assert not unknown, "\n".join(unknown)


def test_every_spotgpu_command_and_option_a_page_names_exists():
    problems = [
        f"{name}: {problem}"
        for name, page in hand_written_pages().items()
        for fragment in code_of(page)
        for problem in command_problems(fragment)
    ]
    assert not problems, "\n".join(problems)


def test_every_job_variable_a_page_names_exists():
    named = {name: job_variables_named(page) for name, page in hand_written_pages().items()}
    assert sum(len(found) for found in named.values()) > 20  # the pages are read
    unknown = [
        f"{name}: {variable}"
        for name, found in named.items()
        for variable in found
        if variable not in known_job_variables()
    ]
    assert not unknown, "\n".join(unknown)


MADE_UP = """\
Set `SPOTGPU_NO_SUCH` and `SPOTGPU_TICK_SECONDS`, or `PREFECT_NO_SUCH_SETTING` and
`PREFECT_API_URL`; the Dask worker's `SPOTGPU_DASK_*` and `SPOTGPU_NOTHING_*`.

```bash
sudo -u spotgpu sh -c 'exec spotgpu server start --migrate --no-such-flag'
spotgpu agent start --gpus A100-80G:2 --region eu-west & spotgpu no-such-command --help
spotgpu admin image add/remove NAME
```

Run `spotgpu prices --forecast`, `spotgpu prices|estimate|bids`, `spotgpu admin nope NAME`.

```yaml
deployments:
  - name: x
    job_variables:
      max_price: 1.2
      max_prize: 1.2
      env:
        NOT_A_VARIABLE: "1"
```

```python
spot_job_variables(gpu_model="A100-80G", gpu_cuont=1)
flow.with_options(job_variables={"region": "any", "regoin": "any"})
@spot_gpu(work_pool="spot", max_price=1.2, imgae="process")
```

The job variable `deadlin` and the `gpu_hours` job variable.

| variable | meaning |
|---|---|
| `timezone` or `tz` | a made-up one in a variables table |
"""


def test_the_checkers_catch_made_up_names():
    """The name checkers on a small text: each made-up name is found, and only those."""
    assert unknown_variables(MADE_UP) == [
        "SPOTGPU_NO_SUCH",
        "PREFECT_NO_SUCH_SETTING",
        "SPOTGPU_NOTHING_*",
    ]
    problems = [p for fragment in code_of(MADE_UP) for p in command_problems(fragment)]
    assert problems == [
        "`spotgpu server start` has no option --no-such-flag",
        "`spotgpu no-such-command`: no command no-such-command",
        "`spotgpu admin nope`: no command nope",
    ]
    named = job_variables_named(MADE_UP)
    assert sorted(v for v in named if v not in known_job_variables()) == [
        "deadlin",
        "gpu_cuont",
        "imgae",
        "max_prize",
        "regoin",
        "tz",
    ]
    assert {"max_price", "region", "gpu_hours", "timezone", "env"} <= set(named)


# =========================================================================== the figure checkers


def test_what_reads_as_a_figure():
    block = Block(
        "took 0.44–0.49 s (1.41× the plain run's, 17 % of them; 19 / 121 ms), 2,189 bids/s, "
        "4 agents, `--repeat 9` and a 1.2.3 version at 18:00, 10⁶ bids, 1/2/4/8 GPUs",
        "",
    )
    assert figures(block) == [
        "0.44", "0.49 s", "1.41×", "17 %", "19", "121 ms", "2,189 bids/s",
    ]  # fmt: skip
    row = Block("| 100 × 0.2 s, calm | 222 s | 11.3 a second | 16 of 16 | ≤ 1 frame |", "")
    assert figures(row) == ["222 s", "11.3", "16"]
    assert figures(Block("| a | 1 s | 10 s |", "", header=True)) == []
    assert shows("0.74 s", 0.741) and shows("1.65 s", 1.649) and shows("2,189", 2189.4)
    assert not shows("0.94 s", 0.741) and not shows("1.6×", 1.66)


def test_the_figure_checkers_catch_drift_and_new_figures():
    """A figure that no longer shows its results file fails, and so does a new measured
    figure that no entry of the table accounts for."""
    name = "users/deploying.md"
    page = hand_written_pages()[name]
    (entry,) = [s for s in FIGURES if s.page == name]
    assert figure_problems(entry, page) == []
    drifted = page.replace("bid for 0.74 s after", "bid for 0.94 s after")
    (edited,) = figure_problems(entry, drifted)  # the page alone was edited
    assert "the page shows ['0.94 s'," in edited and "the table lists ['0.74 s'," in edited
    rerun = Shown(name, entry.where, entry.results, ("0.94 s = ours_1s_poll.pickup_s.median",
                                                     *entry.figures[1:]), entry.why)  # fmt: skip
    assert figure_problems(rerun, drifted) == [  # the results changed under page and table
        f"{name}: {entry.where!r}: shows '0.94 s', but recovery.json "
        "ours_1s_poll.pickup_s.median is now 0.741"
    ]
    wrong_path = Shown(name, entry.where, entry.results,
                       ("0.74 s = ours_1s_poll.nope", *entry.figures[1:]), entry.why)  # fmt: skip
    assert "no 'nope'" in figure_problems(wrong_path, page)[0]
    assert unaccounted(name, page, FIGURES) == []
    added = page + "\n\nMeasured by `benchmarks/recovery.py`: a resume takes 3.1 s.\n"
    (missing,) = unaccounted(name, added, FIGURES)
    assert '"3.1 s"' in missing


def test_the_gpu_hosts_page_starts_the_first_hours_development_agents():
    """The development agents the GPU hosts page shows are the ones the first hour starts
    (and ``tests/test_manual_path.py`` runs): the same names, GPUs and reserves."""

    def agents(page: str) -> set[str]:
        return {
            " ".join(line.split())
            for line in code_of((DOCS / page).read_text(encoding="utf-8"))
            if line.lstrip().startswith("spotgpu agent start --token-file ~/.spotgpu/")
        }

    first_hour = agents("get-started/first-hour.md")
    assert len(first_hour) == 3, first_hour
    assert agents("operators/gpu-hosts.md") == first_hour
