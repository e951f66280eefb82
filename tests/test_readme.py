"""The README opens with the two set-up commands; the documentation's runnable examples run
as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONCEPTS = ROOT / "docs" / "users" / "concepts.md"
ALLOCATION_STATES = ROOT / "docs" / "reference" / "allocation-states.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_python_blocks_run():
    """PyPI and GitHub show the README: any Python in it runs alone, as written."""
    for block in python_blocks(README):
        exec(compile(block, "README.md", "exec"), {})


def test_the_market_from_python_example_runs(capsys):
    blocks = [b for b in python_blocks(CONCEPTS) if "from prefect_spotgpu.market import" in b]
    assert blocks
    for block in blocks:
        exec(compile(block, str(CONCEPTS.relative_to(ROOT)), "exec"), {})
    out = capsys.readouterr().out
    assert "kind=<PlacementKind.MIGRATION" in out
    assert "clearing_price=0.9" in out


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert first_block == [
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[examples]' "
        "&& .venv/bin/spotgpu demo",
        "(command -v chromium || apt-get install -y -q chromium) >/dev/null "
        "&& (command -v dockerd && command -v debootstrap && command -v docker-registry "
        "|| apt-get install -y -q --no-install-recommends docker.io debootstrap docker-registry) "
        ">/dev/null "
        "&& python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/pytest",
    ]
    ci = (README.parent / ".ci" / "run").read_text()
    assert first_block[1] in ci
    quickstart = (ROOT / "docs" / "get-started" / "quickstart.md").read_text()
    shown = re.search(r"```bash\n(.*?)```", quickstart, flags=re.S).group(1)
    assert shown.strip().splitlines() == first_block, "the quickstart shows the two commands"


def test_readme_stays_short_and_shows_no_relative_image():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"!\[[^\]]*\]\((?!https?://)", text), "PyPI cannot show it"
    assert not re.search(r"<img [^>]*src=\"(?!https?://)", text), "PyPI cannot show it"


def test_the_state_diagram_names_every_allocation_status():
    from prefect_spotgpu.market import AllocationStatus

    text = ALLOCATION_STATES.read_text()
    diagram = text.split("## The state diagram", 1)[1].split("```", 2)[1]
    for status in AllocationStatus:
        assert status.name in diagram, status
