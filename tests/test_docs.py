"""The documentation site: it builds strictly, its generated Reference pages are committed and
say what the code says now, and nothing in the repository cites documents a reader does not
have.

The Reference pages (``docs/gen_reference.py``) are files of the repository: one test runs the
generator and compares what it writes with the committed files, the others read the committed
files; the slow one runs ``mkdocs build --strict`` and reads the HTML.
"""

from __future__ import annotations

import difflib
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GEN_SCRIPT = DOCS / "gen_reference.py"
REGENERATE = "python docs/gen_reference.py --write"
GENERATED = (
    "reference/cli.md",
    "reference/rest-api.md",
    "reference/job-variables.md",
    "reference/settings.md",
    "reference/events.md",
    "reference/metrics.md",
)
ENV_NAME = re.compile(r"\bSPOTGPU_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")
"""A ``SPOTGPU_*`` variable's name (a family written ``SPOTGPU_X_*`` is none)."""


def _text_files(*roots: Path):
    for root in roots:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if any(part.endswith(".egg-info") for part in path.parts):
                continue  # a build's copy of the README, not a source
            try:
                yield path, path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # images, archives


@pytest.fixture(scope="module")
def generator() -> dict:
    """``docs/gen_reference.py``'s functions (the script, loaded without running it)."""
    return runpy.run_path(str(GEN_SCRIPT), run_name="gen_reference")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    """The committed Reference pages, by their path under ``docs/``."""
    return {page: (DOCS / page).read_text(encoding="utf-8") for page in GENERATED}


def test_generated_pages_are_committed_and_served_as_they_are(generator):
    assert generator["REGENERATE"] == REGENERATE
    assert set(generator["PAGES"]) == set(GENERATED)
    for page in (*GENERATED, "reference/python-api.md", "reference/allocation-states.md"):
        assert (DOCS / page).is_file(), f"docs/{page} is missing: run `{REGENERATE}`"
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert "gen-files" not in mkdocs, "mkdocs serves the committed pages: nothing generates them"


def test_the_committed_reference_is_what_the_code_says_now(generator):
    """A change to the commands, routes, settings, job variables, events or metrics that the
    committed pages do not show yet fails here, naming the command that regenerates them."""
    written = generator["render_pages"]()
    assert set(written) == set(GENERATED)
    stale = generator["stale_pages"](written)
    diffs = []
    for page in stale:
        path = DOCS / page
        committed = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        diff = difflib.unified_diff(
            committed, written[page].splitlines(), f"docs/{page}", "the code now", lineterm=""
        )
        diffs.append("\n".join(list(diff)[:40]))
    assert not stale, (
        f"the committed Reference pages are stale: {', '.join(stale)}; run `{REGENERATE}` and "
        "commit them\n" + "\n".join(diffs)
    )


def test_a_page_changed_or_missing_is_named_stale(generator, tmp_path, capsys):
    pages = {"reference/a.md": "# A\n", "reference/b.md": "# B\n", "reference/c.md": "# C\n"}
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "a.md").write_text("# A\n")
    (tmp_path / "reference" / "b.md").write_text("# B, edited by hand\n")
    assert generator["stale_pages"](pages, tmp_path) == ["reference/b.md", "reference/c.md"]
    assert generator["main"](["--check", "--docs", str(tmp_path)]) == 1
    said = capsys.readouterr().err
    assert f"reference/cli.md is stale: run `{REGENERATE}`" in said
    assert generator["main"](["--write", "--docs", str(tmp_path)]) == 0
    assert (tmp_path / "reference" / "cli.md").is_file()
    assert generator["main"](["--check", "--docs", str(tmp_path)]) == 0


def test_cli_page_names_every_command(pages):
    import typer

    from prefect_spotgpu.cli.app import app

    cli = pages["reference/cli.md"]
    assert "spotgpu server start" in cli
    assert "{#spotgpu-server-start}" in cli  # a stable anchor
    root = typer.main.get_command(app)
    context = root.make_context("spotgpu", [], resilient_parsing=True)
    for name in root.list_commands(context):
        command = root.get_command(context, name)
        if not command.hidden:
            assert f"spotgpu {name}" in cli, name


def test_rest_page_lists_every_route_with_its_roles(pages):
    from prefect_spotgpu.service.roles import ROUTE_ROLES

    rest = pages["reference/rest-api.md"]
    assert "/api/v1/bids" in rest
    for method, path in ROUTE_ROLES:
        assert f"`{method} {path}`" in rest, (method, path)
    assert "### BidCreate {#schema-bidcreate}" in rest


def test_settings_page_names_every_setting(pages):
    from prefect_spotgpu.service.settings import ServiceSettings

    settings = pages["reference/settings.md"]
    assert "SPOTGPU_DB_URL" in settings and "SPOTGPU_ADMIN_KEY" in settings
    for name in ServiceSettings.model_fields:
        assert f"SPOTGPU_{name.upper()}" in settings, name


def test_every_spotgpu_variable_in_src_is_on_the_settings_page(pages):
    """No drift: a ``SPOTGPU_*`` name anywhere in the package is described there (the build
    itself refuses one without a description)."""
    settings = pages["reference/settings.md"]
    found: dict[str, set[str]] = {}
    for path, text in _text_files(ROOT / "src"):
        for name in ENV_NAME.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert found
    missing = {name: sorted(files) for name, files in found.items() if name not in settings}
    assert not missing, missing


def test_events_page_names_every_protocol_enum(pages):
    from prefect_spotgpu import protocol

    events = pages["reference/events.md"]
    for event in protocol.WorkerEvent:
        assert event.event in events, event
    for enum_class in (
        protocol.EventKind,
        protocol.BidStatus,
        protocol.ReportOutcome,
        protocol.NoticeReason,
        protocol.EndReason,
        protocol.AllocationStatus,
    ):
        for member in enum_class:
            assert f"`{member.value}`" in events, member


def test_job_variables_and_metrics_pages(pages):
    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    variables = pages["reference/job-variables.md"]
    for name in SpotGPUJobConfiguration.model_fields:
        assert f"`{name}`" in variables, name
    metrics = pages["reference/metrics.md"]
    for name in ("spotgpu_tick_duration_seconds", "spotgpu_pool_clearing_price", "spotgpu_bids"):
        assert name in metrics, name


def test_allocation_states_page_names_every_status():
    from prefect_spotgpu.market import AllocationStatus

    text = (DOCS / "reference" / "allocation-states.md").read_text()
    diagram = re.search(r"```text\n(.*?)```", text, flags=re.S).group(1)
    for status in AllocationStatus:
        assert status.name in diagram, status


@pytest.mark.slow
def test_docs_build_strictly(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    page = lambda name: (site / "reference" / name / "index.html").read_text()  # noqa: E731
    assert "spotgpu server start" in page("cli")
    settings = page("settings")
    assert "SPOTGPU_DB_URL" in settings and "SPOTGPU_ADMIN_KEY" in settings
    assert "/api/v1/bids" in page("rest-api")
    assert "spotgpu.bid.preempted" in page("events")
    assert "spotgpu_tick_duration_seconds" in page("metrics")
    assert "max_price" in page("job-variables")
    python_api = page("python-api")
    assert "spot_gpu" in python_api and "Checkpointer" in python_api
    assert "PREEMPTED" in page("allocation-states")
    site_page = lambda path: (site / path / "index.html").read_text()  # noqa: E731
    components = site_page("explanation/components")
    assert '<pre class="mermaid"><code>flowchart' in components  # Material renders it
    assert "Tick leader" in components and "Node agent" in components
    assert "load_state_dict" in site_page("users/restore-example")  # the example file, included
    assert "put_new" in site_page("users/fan-out-child")
    for path in ("users/using-a-market", "users/faq"):
        assert (site / path / "index.html").is_file(), path


CITATION = re.compile(
    r"DESIGN(?:\.md)?\s*§"  # a section of a design document
    r"|\bSTYLE\s+\d+"  # a numbered rule of a style document
    r"|(?i:\bthe\s+product\s+brief\b)"
    r"|(?i:\bissue\s+#?\d+)"
)
CITATION_ROOTS = (
    "src",
    "tests",
    "docs",
    "flows",
    "benchmarks",
    "blocks",
    "deployments",
    "README.md",
)


def test_nothing_cites_documents_a_reader_does_not_have():
    """The code and the docs say what they mean instead of pointing at a design document's
    section, a style rule's number, the brief or a tracker's issue number."""
    found = []
    for path, text in _text_files(*(ROOT / r for r in CITATION_ROOTS if (ROOT / r).exists())):
        for number, line in enumerate(text.splitlines(), 1):
            if CITATION.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
