"""An agent that hands its jobs over (SIGUSR2: an upgrade, docs/operators/systemd.md) exits at
once and leaves them running; the next agent on its state directory adopts them: it watches,
notices and reports them as if it had started them, and the run never stops or runs twice. If
no agent comes within ``--handover-seconds``, the old agent's guard kills the jobs before the
market's heartbeat timeout, and the run resumes elsewhere. Real agents, a real market, a real
checkpointing job; the keeper that makes an adopted process job's exit status readable is
tested on its own first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import wait_for as wait
from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.runners import JobRequest, ProcessRunner
from test_agent import read_log, stop_agents
from test_agent_stop import GRACE, a_run_on_one_of_two_agents, attempts_in_turn, running

AS_ME = JobUsers(str(os.getuid()))
HEARTBEAT_TIMEOUT = 12  # the market's, here
HANDOVER = 4  # the agents' --handover-seconds, here
# where the next agent must take the jobs over: its start (1.3 s of CPU alone) took more than
# 4 s on a loaded machine, and the guard killed the job before it was adopted
ADOPT_HEARTBEAT_TIMEOUT, ADOPT_HANDOVER = 25, 20


def request(tmp_path, command: list[str], alloc: int = 1) -> JobRequest:
    return JobRequest(
        allocation_id=alloc,
        epoch=1,
        bid_id=alloc,
        command=command,
        env={},
        gpu_indices=[0],
        workdir=tmp_path / f"alloc-{alloc}",
    )


def adopted(tmp_path, handle):
    """``handle``'s job as an agent that did not start it sees it."""
    fresh = ProcessRunner(users=AS_ME)
    return fresh, fresh.adopt(handle.request, handle.ref, str(handle.job_pid))


@pytest.mark.parametrize(("script", "code"), [("exit 3", 3), ("kill -KILL $$", -9)])
def test_an_adopted_process_jobs_exit_status_is_its_keepers_record(tmp_path, script, code):
    runner = ProcessRunner(users=AS_ME)
    go = "while [ ! -e go ]; do sleep 0.05; done"
    handle = runner.start(request(tmp_path, ["sh", "-c", f"{go}; {script}"]))
    fresh, adoptee = adopted(tmp_path, handle)
    assert adoptee is not None and adoptee.process is None  # not its child
    assert fresh.poll(adoptee) is None  # runs (held until ``go``: no record of an end yet)
    (tmp_path / "alloc-1" / "go").touch()
    assert wait(lambda: fresh.poll(adoptee) is not None, 10, "the job's end") is True
    assert fresh.poll(adoptee) == code
    assert handle.process.wait(timeout=5) == code  # its starter reads the same, as before


def test_a_job_whose_keeper_left_no_record_is_not_adopted_and_a_stranger_never_is(tmp_path):
    runner = ProcessRunner(users=AS_ME)
    handle = runner.start(request(tmp_path, ["sleep", "600"]))
    try:
        other = request(tmp_path, [], alloc=2)  # another job's directory: not this process
        assert ProcessRunner(users=AS_ME).adopt(other, handle.ref, str(handle.job_pid)) is None
    finally:
        runner.stop(handle, grace=0)
    assert handle.process.returncode == -signal.SIGKILL
    assert not (handle.request.workdir / "exit").exists()  # killed with its job: no record
    assert adopted(tmp_path, handle)[1] is None  # gone, nothing to report: restarted instead


def test_the_notice_goes_to_the_job_not_its_keeper(tmp_path):
    runner = ProcessRunner(users=AS_ME)
    job = "import signal, time, pathlib; signal.signal(signal.SIGUSR1, lambda *_: " \
          "pathlib.Path('got').write_text('1')); pathlib.Path('ready').touch(); " \
          "time.sleep(600)"  # fmt: skip
    handle = runner.start(request(tmp_path, [sys.executable, "-c", job]))
    try:
        wait(lambda: (tmp_path / "alloc-1" / "ready").exists(), 10, "its handler set")
        fresh, adoptee = adopted(tmp_path, handle)
        fresh.notice(adoptee, deadline=time.time() + 60)
        wait(lambda: (tmp_path / "alloc-1" / "got").exists(), 10, "the job's SIGUSR1")
        assert handle.process.poll() is None and adoptee.job_pid != adoptee.pid
    finally:
        runner.stop(handle, grace=0)


@pytest.mark.slow
def test_a_handed_over_job_runs_on_under_the_next_agent_which_notices_it(tmp_path):
    run = a_run_on_one_of_two_agents(
        tmp_path, ADOPT_HEARTBEAT_TIMEOUT, ("--handover-seconds", str(ADOPT_HANDOVER))
    )
    first, alloc = run.first, run.alloc
    try:
        agent = psutil.Process(run.agents[run.name].pid)
        (guard,) = [c for c in agent.children() if c.cmdline() == agent.cmdline()]  # its fork
        run.agents[run.name].send_signal(signal.SIGUSR2)
        assert run.agents[run.name].wait(timeout=10) == 0
        assert running(first["pid"])  # left running
        log = (tmp_path / f"agent-{run.name}.log").read_text()
        assert "hands 1 job(s) over" in log, log[-2000:]
        steps = len(read_log(run.log))
        run.start_agent(run.name, f"{run.name}-next")
        wait(lambda: "adopted its job" in (tmp_path / f"agent-{run.name}.log").read_text(),
             30, "the next agent adopting the job")  # fmt: skip
        guard.wait(timeout=10)  # the old guard ends once the next agent holds the job
        assert running(first["pid"])  # and it did not kill it
        assert len(read_log(run.log)) > steps + 20  # it never stopped
        assert run.buyer.get(f"/allocations/{alloc['id']}").json()["status"] == "running"
        # the next agent serves it fully: stopped, it notices the job, which saves and resumes
        run.agents[f"{run.name}-next"].send_signal(signal.SIGTERM)
        assert run.agents[f"{run.name}-next"].wait(timeout=GRACE + 15) == 0
        assert not running(first["pid"])
        ended = run.buyer.get(f"/allocations/{alloc['id']}").json()
        assert ended["end_reason"] == "final save acknowledged", ended
        assert any(e.get("alloc") == first["alloc"] and "signal" in e for e in read_log(run.log))
        second = run.started_after(first["alloc"])
        run.progress(second["alloc"])
        assert attempts_in_turn(read_log(run.log)) == [first["alloc"], second["alloc"]]
        run.buyer.post(f"/bids/{run.bid['id']}/cancel")
    finally:
        stop_agents(run.agents, run.server, tmp_path)


@pytest.mark.slow
def test_a_hand_over_nobody_takes_kills_the_jobs_before_the_market_moves_the_run(tmp_path):
    run = a_run_on_one_of_two_agents(
        tmp_path, HEARTBEAT_TIMEOUT, ("--handover-seconds", str(HANDOVER))
    )
    first = run.first
    try:
        handed_at = time.time()
        run.agents[run.name].send_signal(signal.SIGUSR2)
        assert run.agents[run.name].wait(timeout=10) == 0
        wait(lambda: not running(first["pid"]), HANDOVER + 5, "the guard killing the job")
        assert HANDOVER - 1 < time.time() - handed_at < HEARTBEAT_TIMEOUT
        second = run.started_after(first["alloc"])  # once the market finds the node lost
        assert second["t"] - handed_at >= HEARTBEAT_TIMEOUT - 1
        run.progress(second["alloc"])
        assert attempts_in_turn(read_log(run.log)) == [first["alloc"], second["alloc"]]
        run.buyer.post(f"/bids/{run.bid['id']}/cancel")
    finally:
        stop_agents(run.agents, run.server, tmp_path)


def test_a_notice_never_reaches_a_process_that_is_not_the_keepers_child(tmp_path):
    """A hand-over record names the job's pid; should that pid be another process's by the
    time of the notice (the job gone, its pid reused), the notice's SIGUSR1 (deadly by
    default) must not kill it."""
    runner = ProcessRunner(users=AS_ME)
    handle = runner.start(request(tmp_path, ["sleep", "600"]))
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        fresh = ProcessRunner(users=AS_ME)
        adoptee = fresh.adopt(handle.request, handle.ref, str(stranger.pid))
        fresh.notice(adoptee, deadline=time.time() + 60)
        assert (tmp_path / "alloc-1" / "notice.json").exists()  # the notice file is written
        with pytest.raises(subprocess.TimeoutExpired):  # and the stranger lives on
            stranger.wait(timeout=0.5)
    finally:
        stranger.kill()
        runner.stop(handle, grace=0)
