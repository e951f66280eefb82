"""The README's first command's main job, ``spotgpu demo``, run as a user would: the whole
stack, a pretraining run through a reclaim, the timeline; then Ctrl-C stops every process
(the run itself is checked with the Prefect UI's test, ``test_prefect_ui.py``: one demo run);
SIGTERM and SIGHUP stop it as Ctrl-C does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline or text in environ:
            found.append(int(proc.name))
    return found


def start_demo(tmp_path: Path, home: Path, *options: str) -> subprocess.Popen:
    """``spotgpu demo`` as a user runs it, from a directory outside the clone."""
    env = {**os.environ, "COLUMNS": "160"}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "prefect_spotgpu.cli", "demo", *options, "--home", home],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,  # the clone is found from the installed package
    )


def demo_until_it_idles(demo, seconds: float = 400) -> str:
    """The demo's output up to its "Ctrl-C stops everything" line (the stack is still up)."""
    lines = []
    deadline = time.monotonic() + seconds
    for line in demo.stdout:
        lines.append(line)
        if "Ctrl-C" in line and "stops everything" in line:
            break
        assert time.monotonic() < deadline, "".join(lines)
    out = "".join(lines)
    assert demo.poll() is None, out
    return out


def stop_demo(demo: subprocess.Popen) -> None:
    """After a failure too: Ctrl-C, which stops the stack it started (a SIGKILL would leave
    its Prefect server, market and agents running for the tests after it)."""
    if demo.poll() is None:
        demo.send_signal(signal.SIGINT)
        try:
            demo.communicate(timeout=60)  # (drains its output: a full pipe would block it)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.communicate()


def assert_all_stopped(home: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while processes_mentioning(str(home)):
        assert time.monotonic() < deadline, processes_mentioning(str(home))
        time.sleep(0.2)


def check_the_demo_output(out: str, home: Path) -> None:
    """What the demo prints, up to its "Ctrl-C stops everything" line, with its stack up.

    The demo's whole run (this output, the Prefect UI it points at, Ctrl-C stopping every
    process) is one test, in ``test_prefect_ui.py``: a demo run costs a minute of CI."""
    for moment in (
        "bid placed",
        "GPUs allocated",
        "owner reclaims the node",
        "migration target reserved",
        "notice (SIGUSR1",
        "final save durable",
        "Preempted",
        "resumes on the reserved node",
        "Completed",
    ):
        assert moment in out, moment + "\n" + out
    assert out.count("Running") >= 2
    assert "saved); 1 preemption(s), 1 with a final save" in out
    assert "/runs/flow-run/" in out
    assert processes_mentioning(str(home))  # the stack is up
    # the printed UI asks its own server, not the default port 4200
    ui = re.search(r"Prefect server and UI at (http://\S+)", out)[1]
    assert httpx.get(f"{ui}/ui-settings", timeout=10).json()["api_url"] == f"{ui}/api"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_stops_the_demos_whole_stack_like_ctrl_c(tmp_path, stop):
    home = tmp_path / "demo"
    demo = start_demo(tmp_path, home)
    lines = []
    try:
        for line in demo.stdout:  # the Prefect server is up, the market is starting
            lines.append(line)
            if "Market service at" in line:
                break
        assert processes_mentioning(str(home)), "".join(lines)
        demo.send_signal(stop)
        rest = demo.communicate(timeout=60)[0]
        assert "stopping every process" in rest, "".join(lines) + rest
    finally:
        stop_demo(demo)
    assert_all_stopped(home)
