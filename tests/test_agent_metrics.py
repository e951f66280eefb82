"""The node agent's own metrics (agent/metrics.py, ``spotgpu agent start --metrics-port``):
the counters and what is read at a scrape on plain data, then a real agent process against the
real market, scraped over HTTP while it starts a job, fails one, hands its job over to the next
agent, and sees it through a notice; and an image pull, timed, by an agent whose runner must
prepare its job first."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import one_database
from conftest import wait_for as wait
from helpers import assignment, stop_agent
from prefect_spotgpu import __version__
from prefect_spotgpu.agent.guard import Guard
from prefect_spotgpu.agent.metrics import AgentMetrics, Beat, NoticeEnd, StartFailure
from prefect_spotgpu.agent.reports import notice_report
from prefect_spotgpu.agent.runners import JobFault, ProcessRunner
from prefect_spotgpu.cli.stack import free_port
from test_agent import AS_ME, make_agent, read_log, start_agent

HERE = Path(__file__).parent


def samples(text: str) -> dict[tuple, float]:
    """A scrape as ``{(name, (label, value), ...): value}``, parsed as Prometheus would."""
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> dict[tuple, float]:
    return samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)


# ---------------------------------------------------------------- on data


def test_a_silent_connection_is_dropped_and_scrapes_go_on(monkeypatch):
    """A client that opens connections to the metrics port and sends nothing (a hostile job on
    another host, where the port is on a network address) is dropped after
    ``SCRAPE_SOCKET_SECONDS``, holding none of the agent's threads for longer; scrapes answer
    meanwhile."""
    import socket

    from prefect_spotgpu.agent import metrics as agent_metrics

    monkeypatch.setattr(agent_metrics._ScrapeHandler, "timeout", 1.0)
    host, port = AgentMetrics().serve("127.0.0.1", 0)
    silent = [socket.create_connection((host, port)) for _ in range(20)]
    try:
        scrape = httpx.get(f"http://{host}:{port}/metrics", timeout=10)
        assert scrape.status_code == 200 and "spotgpu_agent_info" in scrape.text
        began = time.monotonic()
        for conn in silent:
            conn.settimeout(10)
            assert conn.recv(1) == b""  # closed by the agent
        assert time.monotonic() - began < 5
    finally:
        for conn in silent:
            conn.close()


def test_every_series_exists_from_the_start_at_zero():
    seen = samples(AgentMetrics().exposition().decode())
    for reason in StartFailure:
        assert seen["spotgpu_agent_job_start_failures_total", ("reason", reason.value)] == 0
    for end in NoticeEnd:
        assert seen["spotgpu_agent_notice_ends_total", ("outcome", end.value)] == 0
    for beat in Beat:
        assert seen["spotgpu_agent_heartbeats_total", ("result", beat.value)] == 0
    assert seen["spotgpu_agent_job_starts_total",] == 0
    assert seen["spotgpu_agent_heartbeat_age_seconds",] == math.inf  # none accepted yet
    assert seen["spotgpu_agent_guard_alive",] == 0  # (no agent, no guard)
    info = ("spotgpu_agent_info", ("node_id", ""), ("runner", ""), ("version", __version__))
    assert seen[info] == 1


@pytest.mark.parametrize(
    ("ack", "exit_code", "end"),
    [
        ({"step": 4, "saved_at": 10.0}, None, NoticeEnd.ACKNOWLEDGED),
        (None, None, NoticeEnd.TIMED_OUT),
        ({"failed": True, "cause": "storage"}, 1, NoticeEnd.STORAGE_FAILED),
        (None, -9, NoticeEnd.JOB_FAILED),
        (None, 0, NoticeEnd.FINISHED),
    ],
)
def test_a_notices_end_is_what_its_report_says(ack, exit_code, end):
    report = notice_report(epoch=1, ack=ack, exit_code=exit_code, now=11.0)
    metrics = AgentMetrics()
    metrics.notice_ended(report)
    seen = samples(metrics.exposition().decode())
    ended = {e for e in NoticeEnd if seen["spotgpu_agent_notice_ends_total", ("outcome", e.value)]}
    assert ended == {end}


def test_the_heartbeat_age_and_a_pull_read_the_clock_given():
    now = [100.0]
    metrics = AgentMetrics(clock=lambda: now[0])
    metrics.heartbeat(Beat.REFUSED)
    assert metrics.heartbeat_age() == math.inf  # a refusal is no sign of life
    metrics.heartbeat(Beat.ACCEPTED)
    now[0] = 107.5
    assert metrics.heartbeat_age() == 7.5
    with pytest.raises(RuntimeError), metrics.image_pull():
        now[0] = 130.0
        raise RuntimeError("registry unreachable")
    seen = samples(metrics.exposition().decode())
    assert seen["spotgpu_agent_image_pulls_total", ("outcome", "error")] == 1
    assert seen["spotgpu_agent_image_pull_seconds_sum",] == 22.5
    assert StartFailure.of(JobFault("no such file")) is StartFailure.JOB
    assert StartFailure.of(PermissionError("the interpreter")) is StartFailure.NODE


def test_the_guard_is_alive_until_it_exits_and_its_pid_is_not_waited_on_after():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a guard: it waits for its agent's end of the pipe to close
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    metrics = AgentMetrics(SimpleNamespace(guard=Guard(pid, write_end)))
    assert metrics.guard_alive() is True
    os.close(write_end)
    wait(lambda: not metrics.guard_alive(), 10, "the guard's exit")
    assert metrics.guard_alive() is False  # (remembered: never waitpid'd again)


# ---------------------------------------------------------------- a real agent process


def bid(buyer, command: list[str], **job) -> dict:
    placed = buyer.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.5, "region": "eu-west",
              "job": {"command": command, **job}},
    )  # fmt: skip
    assert placed.status_code == 201, placed.text
    return placed.json()


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_real_agents_metrics_move_with_its_jobs_heartbeats_hand_over_and_notice(
    service, tmp_path
):
    owner, buyer = service.tenant(), service.tenant(credit=100.0)
    service.grant_provider(owner)
    market = SimpleNamespace(url=service.base_url)
    port = free_port()
    key = owner.headers["Authorization"].removeprefix("Bearer ")
    options = ("--metrics-port", str(port), "--handover-seconds", "10")
    agents = {"first": start_agent(market, key, "m", tmp_path, *options)}
    try:
        seen = wait(
            lambda: (
                with_suppressed(scrape, port)
                and (s := scrape(port))["spotgpu_agent_heartbeats_total", ("result", "accepted")]
                >= 2
                and s
            ),
            30,
            "two accepted heartbeats",
        )
        (node,) = owner.get("/nodes").json()
        info = ("spotgpu_agent_info", ("node_id", str(node["id"])), ("runner", "process"),
                ("version", __version__))  # fmt: skip
        assert seen[info] == 1
        assert seen["spotgpu_agent_guard_alive",] == 1
        assert seen["spotgpu_agent_heartbeat_age_seconds",] < 5  # every second here
        assert seen["spotgpu_agent_jobs_running",] == 0

        broken = bid(buyer, ["/nonexistent/program"])  # the job's own fault
        failed = ("spotgpu_agent_job_start_failures_total", ("reason", "job"))
        wait(lambda: scrape(port)[failed] >= 1, 30, "the failed start counted")
        buyer.post(f"/bids/{broken['id']}/cancel")
        assert scrape(port)["spotgpu_agent_job_start_failures_total", ("reason", "node")] == 0

        log = tmp_path / "job.jsonl"
        running = bid(buyer, [sys.executable, str(HERE / "agent_job.py"), "100000"],
                      env={"JOB_LOG": str(log)}, checkpoint_url=str(tmp_path / "ckpt"))  # fmt: skip
        wait(lambda: [e for e in read_log(log) if "start" in e], 30, "the job's start")
        seen = scrape(port)
        assert seen["spotgpu_agent_job_starts_total",] == 1
        assert seen["spotgpu_agent_jobs_running",] == 1

        # an upgrade: the agent hands its job over, the next one adopts it
        agents["first"].send_signal(signal.SIGUSR2)
        assert agents["first"].wait(timeout=15) == 0
        agents["next"] = start_agent(market, key, "m", tmp_path, *options)
        adopted = ("spotgpu_agent_handed_over_jobs_total", ("outcome", "adopted"))
        seen = wait(
            lambda: with_suppressed(scrape, port) and (s := scrape(port))[adopted] == 1 and s,
            30,
            "the next agent adopting the job",
        )
        assert seen["spotgpu_agent_jobs_running",] == 1
        assert seen["spotgpu_agent_job_starts_total",] == 0  # adopted, not started
        assert seen["spotgpu_agent_guard_alive",] == 1

        owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
        acknowledged = ("spotgpu_agent_notice_ends_total", ("outcome", "acknowledged"))
        seen = wait(lambda: (s := scrape(port))[acknowledged] == 1 and s, 30, "the final save")
        assert seen["spotgpu_agent_notices_total",] == 1
        assert seen["spotgpu_agent_notice_ends_total", ("outcome", "timed_out")] == 0
        wait(lambda: scrape(port)["spotgpu_agent_jobs_running",] == 0, 10, "the job stopped")
        buyer.post(f"/bids/{running['id']}/cancel")
    finally:
        for proc in agents.values():
            stop_agent(proc, timeout=10)
        for pid_file in tmp_path.glob("state-*/alloc-*/pid"):  # no job outlives the test
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def with_suppressed(call, *args) -> bool:
    """Whether ``call(*args)`` answers (the agent's endpoint may not listen yet)."""
    try:
        call(*args)
    except httpx.HTTPError:
        return False
    return True


# ---------------------------------------------------------------- an image pull, timed


class PreparingRunner(ProcessRunner):
    """A process runner that must prepare each job first (as the Docker runner pulls an image
    the node lacks): ``seconds`` of it, or a failure for a job whose command is ``pull-fails``.
    The narrow seam: a pull with no registry (the real ones: test_image_pull.py)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(users=AS_ME)
        self.seconds = seconds

    def ready(self, request) -> bool:
        return False

    def prepare(self, request, progress) -> None:
        progress("pulling: 1 of 1 layers")
        time.sleep(self.seconds)
        if request.command == ["pull-fails"]:
            raise RuntimeError("the registry is out of reach")


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_an_image_pull_is_counted_and_timed_and_a_failed_one_is_the_nodes(service, tmp_path):
    owner = service.tenant()
    _, agent = make_agent(service, owner, tmp_path, gpus=2, runner=PreparingRunner(0.3))
    agent.register()
    agent.start(901, assignment(901, job={"command": ["sleep", "30"]}))
    try:
        wait(lambda: 901 in agent.jobs, 10, "the job started after its pull")
        agent.start(902, assignment(902, job={"command": ["pull-fails"]}))
        failed = ("spotgpu_agent_job_start_failures_total", ("reason", "node"))
        seen = wait(lambda: (s := samples(agent.metrics.exposition().decode()))[failed] and s,
                    10, "the failed pull")  # fmt: skip
    finally:
        agent.stop(901, reason="the test ends", grace=0)
    assert seen["spotgpu_agent_image_pulls_total", ("outcome", "ok")] == 1
    assert seen["spotgpu_agent_image_pulls_total", ("outcome", "error")] == 1
    assert seen["spotgpu_agent_image_pull_seconds_count",] == 2
    assert seen["spotgpu_agent_image_pull_seconds_sum",] >= 0.6
    assert seen["spotgpu_agent_job_starts_total",] == 1
