"""A node whose jobs cannot start drains itself instead of failing (and billing) every bid the
market places on it: the count (pure), whose fault a failure is (real runners),
and a real agent against the real service on SQLite and PostgreSQL."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from conftest import wait_for as wait
from prefect_spotgpu.agent.discovery import parse_declared
from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.runners import JobFault, JobRequest, ProcessRunner
from prefect_spotgpu.agent.runners.docker import DockerRunner, command_refused
from prefect_spotgpu.agent.runners.process import blames_the_job
from prefect_spotgpu.agent.start_failures import DRAIN_AFTER, StartFailures
from test_agent_isolation import PYTHON

AS_ME = JobUsers(str(os.getuid()))
DENIED = PermissionError(errno.EACCES, "Permission denied", "/root/venv/bin/python")

# ---------------------------------------------------------------- the count


def test_only_the_nodes_failures_in_a_row_count_and_a_start_resets_them():
    count = StartFailures(limit=3)
    assert count.failed(DENIED) is None
    assert count.failed(JobFault("no such program: trian.py")) is None  # the job's: no count
    assert count.in_a_row == 1
    count.started()
    assert count.in_a_row == 0
    assert [count.failed(DENIED) for _ in range(2)] == [None, None]
    reason = count.failed(DENIED)
    assert reason.startswith("3 jobs in a row could not start: [Errno 13] Permission denied")
    assert count.failed(DENIED).startswith("4 jobs in a row")  # not drained yet: again
    count.drained()
    assert count.failed(DENIED) is None
    long = count.failed(OSError("x" * 1000)), count.failed(OSError("y\x1b[0m" * 1000))
    assert long[0] is None and len(long[1]) <= 300 and "\x1b" not in long[1]


# ---------------------------------------------------------------- whose fault (real runners)


def request(tmp_path: Path, command: list[str], **kw) -> JobRequest:
    return JobRequest(
        allocation_id=7,
        epoch=1,
        bid_id=3,
        command=command,
        env={},
        gpu_indices=[0],
        workdir=tmp_path / "alloc-7",
        checkpoint_key="bid-3",
        **kw,
    )


def test_a_process_job_that_cannot_start_says_whose_fault_it_is(tmp_path):
    runner = ProcessRunner(users=AS_ME, interpreter=tmp_path / "gone" / "python")
    with pytest.raises(JobFault, match="No such file or directory: '/no/such/program'"):
        runner.start(request(tmp_path, ["/no/such/program"]))  # the tenant named it
    with pytest.raises(JobFault, match="Argument list too long"):
        runner.start(request(tmp_path, ["sh", "-c", "x" * 300_000]))  # its own arguments
    with pytest.raises(OSError) as raised:
        runner.start(request(tmp_path, ["python", "-c", "pass"]))  # the node's interpreter
    assert not isinstance(raised.value, JobFault)
    assert raised.value.filename == str(tmp_path / "gone" / "python")
    rooted = ProcessRunner(users=AS_ME, checkpoint_root=tmp_path / "ckpt")
    with pytest.raises(JobFault, match="refused"):
        rooted.start(request(tmp_path, ["true"], checkpoint_url="ftp://x/y"))


def test_blame_is_by_what_exec_failed_on():
    venv = "/venv/bin/python"
    assert blames_the_job(OSError(errno.E2BIG, "too long", venv), program=venv, interpreter=venv)
    assert not blames_the_job(DENIED, program=DENIED.filename, interpreter=DENIED.filename)
    assert blames_the_job(DENIED, program=DENIED.filename, interpreter=venv)
    # a failure before exec (the job's directory, its user) names no program: the node's
    assert not blames_the_job(OSError(errno.EPERM, "setuid"), program="/x", interpreter=venv)


def test_a_container_whose_command_is_not_in_its_image_is_the_jobs_fault(tmp_path):
    for message in (
        "OCI runtime create failed: runc create failed: unable to start container process: "
        'exec: "trian.py": executable file not found in $PATH: unknown',
        "failed to create task for container: unable to start container process: "
        'exec: "/app/run": stat /app/run: no such file or directory: unknown',
        'error during container init: exec: "/etc/hosts": permission denied: unknown',
    ):
        assert command_refused(message), message
    for message in (
        'could not select device driver "nvidia" with capabilities: [[gpu]]',
        "Get https://registry/v2/: dial tcp: lookup registry: no such host",
        "mkdir /var/lib/docker/overlay2/x: no space left on device",
    ):
        assert not command_refused(message), message
    runner = DockerRunner(client=object(), users=JobUsers("auto", euid=0))
    with pytest.raises(JobFault, match="needs a job image"):  # a process bid on a docker node
        runner.container_spec(request(tmp_path, ["x"]))


# ---------------------------------------------------------------- a real agent, a real market


def _broken_interpreter(base: Path):
    """A job interpreter the job users cannot run (as root: under a 0700 directory, as in
    otherwise: not there), and the fix."""
    closed = base / "closed-home"
    (closed / "bin").mkdir(parents=True)
    python = closed / "bin" / "python"
    if os.geteuid() == 0:
        python.symlink_to(PYTHON)
        closed.chmod(0o700)
        return python, lambda: closed.chmod(0o711)
    return python, lambda: python.symlink_to(PYTHON)


@pytest.mark.skipif(PYTHON is None, reason="no interpreter other users can run")
def test_a_node_whose_jobs_cannot_start_drains_itself_and_bills_next_to_nothing(
    service, sandbox, caplog
):
    from prefect_spotgpu.agent.agent import Agent

    caplog.set_level(logging.ERROR, logger="prefect_spotgpu.agent")
    owner, buyer = service.tenant(), service.tenant()
    node, _ = service.node(owner, gpus=1, reserve=0.5)
    interpreter, fix = _broken_interpreter(sandbox)
    users = JobUsers("auto") if os.geteuid() == 0 else AS_ME
    agent = Agent(
        market=service.base_url,
        token=node["token"],
        runner=ProcessRunner(users=users, interpreter=interpreter),
        gpus=parse_declared("A100-80G:1"),
        declared=True,
        state_dir=sandbox / "agent",
        name=node["name"],
        heartbeat_seconds=1,
        grace_seconds=1,
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()

    def bid(command: list[str]) -> dict:
        body = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0}
        placed = buyer.post("/bids", json={**body, "job": {"command": command}})
        assert placed.status_code == 201, placed.text
        return placed.json()

    def allocations(b: dict) -> list[dict]:
        return buyer.get(f"/bids/{b['id']}/allocations").json()

    def state() -> str:
        return owner.get(f"/nodes/{node['id']}").json()["state"]

    try:
        # a tenant's broken job fails again and again: the node is not to blame
        broken = bid(["/no/such/program"])
        wait(lambda: len(allocations(broken)) > DRAIN_AFTER + 1, 30, "the broken job retried")
        assert state() == "live"
        buyer.post(f"/bids/{broken['id']}/cancel")
        # the node's own fault: drained after DRAIN_AFTER, its bid not placed here again
        python_job = bid(["python", "-c", "print('ran')"])
        wait(lambda: state() == "draining", 30, "the node drained")
        wait(lambda: all(a["ended_at"] for a in allocations(python_job)), 10, "reports applied")
        wait(lambda: buyer.get(f"/bids/{python_job['id']}").json()["status"] == "open", 10)
        attempts = allocations(python_job)
        assert len(attempts) == DRAIN_AFTER, attempts
        assert all(a["status"] == "preempted" for a in attempts)
        seconds = sum(a["charged_seconds"] for a in attempts)
        micros = sum(a["charged_micros"] for a in attempts)
        assert seconds <= DRAIN_AFTER * 2.0, attempts  # each attempt: until its report
        assert micros <= 1.0 * seconds / 3600 * 1e6 + DRAIN_AFTER, attempts  # at its price
        assert any("drained" in r.getMessage() and "spotgpu node live" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
        assert len(allocations(python_job)) == DRAIN_AFTER  # still: nothing placed here
        # the owner fixes the node and offers it again: the job starts and finishes
        fix()
        assert owner.patch(f"/nodes/{node['id']}", json={"state": "live"}).status_code == 200
        wait(
            lambda: buyer.get(f"/bids/{python_job['id']}").json()["status"] == "finished",
            30,
            "the job ran once the node was fixed",
        )
        assert agent.start_failures.in_a_row == 0 and state() == "live"
    finally:
        agent.shutdown()
        thread.join(timeout=10)
        for handle in list(agent.jobs.values()):
            agent.runner.stop(handle, grace=0)
