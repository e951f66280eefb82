"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    blocks = [b for b in blocks if "from prefect_spotgpu.market import" in b]  # runnable alone
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
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


def test_readme_state_diagram_names_every_allocation_status():
    from prefect_spotgpu.market import AllocationStatus

    text = README.read_text()
    diagram = text[text.index("### Allocation states") : text.index("### GPU models")]
    for status in AllocationStatus:
        assert status.name in diagram, status
