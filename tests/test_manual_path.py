"""The manual path ("The first hour, by hand", ``docs/get-started/first-hour.md``), command
for command, in a fresh home: the market, a vetted provider and a buyer, three agents, a Prefect
server, the blocks, the pool, a worker, a ``from_source(...).deploy(...)`` flow, a run, a
reclaim of its node, Completed — and no bid left open. Each line of the page's block runs as
written, by bash, from the repository's root; lines ending in ``&`` run in the background (a
terminal of their own), and the test waits for each to be ready as a user would before typing
the next. Only the ports differ (free ones, through the variables the commands read). It prints
each command's time."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from prefect_spotgpu.api_client import tls
from prefect_spotgpu.cli.stack import free_port, wait_for

REPOSITORY = Path(__file__).resolve().parents[1]
PAGE = REPOSITORY / "docs" / "get-started" / "first-hour.md"
MARKER = "<!-- manual-path:"


def manual_path() -> list[str]:
    """The commands of the first hour's manual-path block (continuations joined, comments
    out)."""
    text = PAGE.read_text()
    block = text.split(MARKER, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(re.sub(r"\s+", " ", line.strip()))
    return commands


def test_the_first_hour_block_is_the_whole_path():
    commands = manual_path()
    assert commands[0] == "spotgpu server start &"
    assert sum(c.startswith("spotgpu agent start") for c in commands) == 3
    for needed in ("spotgpu pool setup spot", "python deployments/deploy.py"):
        assert needed in commands
    assert "prefect worker start --pool spot --type spot-gpu &" in commands
    assert any(c.startswith("spotgpu node reclaim dev-1") for c in commands)
    assert not any("--token " in c or "--api-key " in c for c in commands)  # no key in argv


class Terminals:
    """The background commands, each in a session of its own with its log."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home, self.env = home, env
        self.processes: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, command: str) -> tuple[subprocess.Popen, Path]:
        log = self.home / f"terminal-{len(self.processes)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", command],
                cwd=REPOSITORY,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append((command, process, log))
        return process, log

    def logs(self) -> str:
        return "\n".join(
            f"--- {command} (exit {process.poll()}):\n{log.read_text(errors='replace')[-3000:]}"
            for command, process, log in self.processes
        )

    def stop(self) -> None:
        """Ctrl-C in each terminal, then SIGKILL; then whatever still runs under the home
        (the agents' jobs, in sessions of their own)."""
        for _, process, _ in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        deadline = time.monotonic() + 15
        for _, process, _ in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for pid in processes_under(self.home):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def processes_under(home: Path) -> list[int]:
    """Processes whose environment names ``home`` (HOME, or a job's files under it)."""
    found, needle = [], str(home).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, verify=tls()).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_the_first_hour_runs_as_written_in_a_fresh_home():
    home = Path(tempfile.mkdtemp(prefix="spotgpu-by-hand-"))
    home.chmod(0o755)  # a job of another uid (an agent run as root) reaches its own files
    market_port, prefect_port = free_port(), free_port()
    market = f"http://127.0.0.1:{market_port}"
    prefect = f"http://127.0.0.1:{prefect_port}/api"
    env = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "SPOTGPU_HOME": str(home / ".spotgpu"),  # an agent run as root would use /var/lib
        "SPOTGPU_PORT": str(market_port),
        "SPOTGPU_MARKET_URL": market,
        "PREFECT_SERVER_API_PORT": str(prefect_port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # this machine reaches no internet
    }
    terminals = Terminals(home, env)
    timings: list[tuple[str, float]] = []

    def key(name: str) -> str:
        return (home / ".spotgpu" / f"{name}.key").read_text().strip()

    def market_as(name: str) -> httpx.Client:
        return httpx.Client(
            base_url=market + "/api/v1",
            headers={"Authorization": f"Bearer {key(name)}"},
            verify=tls(),
        )

    def ready(command: str, process: subprocess.Popen, log: Path) -> None:
        def up(check):
            def probe():
                if process.poll() is not None:
                    raise AssertionError(f"{command!r} exited:\n{terminals.logs()}")
                return check()

            return probe

        if command.startswith("spotgpu server start"):
            wait_for(up(lambda: healthy(market + "/api/v1/health")), 60, "the market")
        elif command.startswith("spotgpu agent start"):
            name = shlex.split(command)[shlex.split(command).index("--name") + 1]
            with market_as("owner") as owner:
                wait_for(
                    up(lambda: any(n["name"] == name for n in owner.get("/nodes").json())),
                    60,
                    f"agent {name} registered",
                )
        elif command.startswith("prefect server start"):
            wait_for(up(lambda: healthy(prefect + "/health")), 180, "Prefect's server")
        elif command.startswith("prefect worker start"):
            wait_for(up(lambda: "started!" in log.read_text(errors="replace")), 120, "worker")

    def flow_run() -> dict:
        runs = httpx.post(f"{prefect}/flow_runs/filter", json={}).json()
        assert len(runs) == 1, runs
        return runs[0]

    def before(command: str) -> None:
        """What a user waits for before typing the next line."""
        if command.startswith("spotgpu nodes"):
            with market_as("alice") as alice, market_as("owner") as owner:
                names = {n["id"]: n["name"] for n in owner.get("/nodes").json()}

                def running_on_dev_1() -> bool:
                    bids = alice.get("/bids").json()
                    if flow_run()["state_type"] != "RUNNING" or not bids:
                        return False
                    allocations = alice.get(f"/bids/{bids[0]['id']}/allocations").json()
                    return any(
                        a["status"] == "running" and names[a["node_id"]] == "dev-1"
                        for a in allocations
                    )

                wait_for(running_on_dev_1, 120, "the run Running on dev-1")
        elif command.startswith("spotgpu node reclaim"):

            def stepped() -> bool:  # a few steps in: a step's line in the run's logs
                where = {"logs": {"flow_run_id": {"any_": [flow_run()["id"]]}}}
                logs = httpx.post(f"{prefect}/logs/filter", json=where).json()
                return any(log["message"].startswith("step ") for log in logs)

            wait_for(stepped, 120, "a step's line in the run's logs")
        elif command.startswith("prefect flow-run ls"):
            # (Preempted at the reclaim is not the end: the run resumes on dev-2)
            wait_for(lambda: flow_run()["state_type"] in ("COMPLETED", "FAILED", "CANCELLED"), 420)

    started = time.monotonic()
    try:
        for line in manual_path():
            command = line.replace("127.0.0.1:4200", f"127.0.0.1:{prefect_port}")
            before(command)
            t0 = time.monotonic()
            if command.endswith("&"):
                process, log = terminals.start(command[:-1].strip())
                ready(command, process, log)
            else:
                done = subprocess.run(
                    ["bash", "-c", command],
                    cwd=REPOSITORY,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                assert done.returncode == 0, (
                    f"{command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                    f"{terminals.logs()}"
                )
                if command.startswith("spotgpu nodes"):  # dev-1 runs it: 1 of its 2 GPUs
                    assert re.search(r"dev-1 .* 1/2 ", done.stdout), done.stdout
            timings.append((line, time.monotonic() - t0))

        run = flow_run()
        assert run["state_type"] == "COMPLETED", f"{run['state']}\n{terminals.logs()}"
        states = httpx.get(f"{prefect}/flow_run_states/", params={"flow_run_id": run["id"]})
        names = [state["name"] for state in states.json()]
        assert "Preempted" in names, names
        with market_as("alice") as alice, market_as("owner") as owner:
            nodes = {n["id"]: n["name"] for n in owner.get("/nodes").json()}
            (bid,) = alice.get("/bids").json()
            # a run that is over leaves no open bid: nothing bills any more
            wait_for(lambda: alice.get(f"/bids/{bid['id']}").json()["status"] == "finished", 30)
            allocations = alice.get(f"/bids/{bid['id']}/allocations").json()
            assert all(a["status"] not in ("running", "noticed") for a in allocations)
            in_order = sorted(allocations, key=lambda a: a["id"])
            where = [(nodes[a["node_id"]], a["status"]) for a in in_order]
            assert where[0] == ("dev-1", "preempted") and where[-1][0] == "dev-2", where
    finally:
        terminals.stop()
        print(f"\nthe first hour's manual path in {time.monotonic() - started:.1f} s:")
        for command, seconds in timings:
            print(f"  {seconds:6.2f} s  {command}")
    assert not processes_under(home), "a process of the manual path outlived Ctrl-C"
