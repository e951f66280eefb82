"""market/ is pure: no database, web, Prefect or NVML imports, no I/O, no clock (STYLE 1)."""

import ast
import pathlib
import subprocess
import sys

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
