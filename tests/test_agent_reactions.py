"""The node agent's decisions on plain data (``agent/reactions.py``), as the worker's are: what
each event asks, whether and how a job starts, what a job's exit reports. The agent that
executes them is tested with real processes and signals (``test_agent*.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import helpers
from prefect_spotgpu.agent.reactions import (
    Already,
    Decline,
    Ended,
    Fail,
    Go,
    Ignore,
    LocalView,
    NoJob,
    NoticeJob,
    NotYet,
    Refused,
    StartJob,
    StopJob,
    cpu_threads,
    exit_report,
    job_request,
    react,
    start_decision,
)
from prefect_spotgpu.agent.reports import notice_before_start_report, notice_report
from prefect_spotgpu.agent.runners.process import process_environment
from prefect_spotgpu.messages import EventResponse

CALM = LocalView(frozenset(), frozenset(), leaving=False)
GANG = {"rank": 1, "world_size": 2, "master_addr": "10.0.0.7", "master_port": 20010,
        "gpus_per_node": 1, "lead_allocation": 41}  # fmt: skip


def event(kind: str, alloc: int = 7, **payload) -> EventResponse:
    return EventResponse.model_validate(
        {"id": 3, "kind": kind, "bid_id": 2, "node_id": 1, "allocation_id": alloc,
         "created_at": "2026-12-07T00:00:00Z", "payload": {"at": 1.0, **payload}}
    )  # fmt: skip


def assignment(status: str = "running", job: bool = True, gang=None, epoch: int = 3):
    spec = {"command": ["python", "-m", "x"], "env": {"A": "1"}} if job else None
    return helpers.assignment(7, bid_id=2, status=status, epoch=epoch, tenant_id=5,
                              checkpoint_key="flow-run-x", gang=gang, job=spec)  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "payload", "action"),
    [
        ("allocated", {}, StartJob(7)),
        ("reserved", {"placement": "migration"}, StartJob(7)),  # a warm migration target
        ("reserved", {"placement": "takeover"}, Ignore(7)),  # starts when promoted
        ("noticed", {"deadline": 300.0, "epoch": 4}, NoticeJob(7, 300.0, 4)),
        ("preempted", {"reason": "node lost"}, StopJob(7, "preempted", 0)),  # SIGKILL only
        ("finished", {}, StopJob(7, "finished", None)),
        ("released", {}, StopJob(7, "released", None)),
        ("pulling", {"detail": "3 of 9 layers"}, Ignore(7)),
    ],
)
def test_each_event_asks_one_thing(kind, payload, action):
    assert react(event(kind, **payload)) == action


def test_a_notice_without_a_deadline_is_refused_saying_which():
    assert react(event("noticed", epoch=4)) == Refused(
        7, "notice 3 of allocation 7 has no deadline"
    )


def test_a_job_starts_once_and_only_while_startable():
    assert start_decision(7, assignment(), LocalView(frozenset({7}), frozenset(), False)) == (
        Already()
    )
    assert start_decision(7, assignment(), LocalView(frozenset(), frozenset({7}), False)) == (
        Already()
    )
    assert start_decision(7, None, CALM) == Ended()  # not assigned here any more
    noticed = start_decision(7, assignment("noticed"), CALM)  # never started: answered now
    assert noticed == Decline(3, answer=notice_before_start_report(epoch=3))
    assert start_decision(7, assignment("preempted"), CALM) == Ended()
    assert start_decision(7, assignment(), LocalView(frozenset(), frozenset(), True)) == (
        Decline(3)  # leaving: never started; the epoch answers its notice
    )
    assert start_decision(7, assignment("reserved", job=False), CALM) == NotYet()
    assert start_decision(7, assignment(job=False), CALM) == NoJob()


def test_a_gang_member_starts_with_its_place_and_a_malformed_one_fails_saying_why():
    go = start_decision(7, assignment(gang=GANG), CALM)
    assert isinstance(go, Go) and (go.gang.rank, go.gang.world_size) == (1, 2)
    failed = start_decision(7, assignment(gang={**GANG, "rank": 5}), CALM)
    assert failed == Fail(
        3, "the market's gang is malformed: gang.rank must be an integer in [0, 1]"
    )
    alone = start_decision(7, assignment(), CALM)
    assert isinstance(alone, Go) and alone.gang is None


def test_the_request_is_the_assignments_on_the_gpus_taken():
    go = start_decision(7, assignment(gang=GANG), CALM)
    request = job_request(go, (2, 3), Path("/state"), node=(8, 96))
    assert (request.allocation_id, request.epoch, request.bid_id) == (7, 3, 2)
    assert request.gpu_indices == [2, 3] and request.workdir == Path("/state/alloc-7")
    assert (request.tenant_id, request.checkpoint_key, request.gang) == (5, "flow-run-x", go.gang)
    assert request.thread_default() == {"OMP_NUM_THREADS": "24"}  # 2 of 8 GPUs: 24 of 96 cores


def test_a_jobs_threads_are_its_share_of_the_cores_by_its_share_of_the_gpus():
    assert cpu_threads(1, 8, 96) == 12 and cpu_threads(8, 8, 96) == 96
    assert cpu_threads(1, 2, 2) == 1 and cpu_threads(1, 8, 4) == 1  # never none
    assert cpu_threads(3, 8, 100) == 37  # (rounded down: the jobs together fit the cores)
    go = start_decision(7, assignment(), CALM)
    request = job_request(go, (0,), Path("/state"), node=(2, 2))
    assert process_environment(request, None)["OMP_NUM_THREADS"] == "1"
    request.env["OMP_NUM_THREADS"] = "3"  # the bid's own choice is kept
    assert process_environment(request, None)["OMP_NUM_THREADS"] == "3"


def test_an_exit_reports_finished_or_failed_with_its_code_and_last_line():
    assert exit_report(4, 0, None).body() == {"epoch": 4, "outcome": "finished"}
    failed = exit_report(4, 3, "Traceback: boom")
    assert failed.outcome == "failed" and failed.epoch == 4
    assert "exit code 3" in failed.detail and "boom" in failed.detail
    killed = exit_report(4, -9, None)
    assert killed.outcome == "failed" and "9" in killed.detail


def test_the_agents_reports_are_the_services_request_model():
    """One declaration both ways: the service takes ``messages.AllocationReport`` (its own
    class adds only the checks of characters and unknown fields), so what an agent builds is
    what the OpenAPI schema names."""
    from prefect_spotgpu.messages import AllocationReport
    from prefect_spotgpu.service.schemas import AllocationReport as Taken

    assert issubclass(Taken, AllocationReport)
    assert set(Taken.model_fields) == set(AllocationReport.model_fields)
    for report in (
        notice_report(epoch=2, ack={"step": 7, "saved_at": 5.0}, exit_code=None, now=9.0),
        notice_report(epoch=2, ack=None, exit_code=None, now=9.0),
        notice_before_start_report(epoch=2),
        exit_report(2, 1, "boom"),
    ):
        assert Taken.model_validate(report.body()).model_dump() == report.model_dump()
    assert notice_report(epoch=2, ack={"step": 7, "saved_at": 5.0}, exit_code=None,
                         now=9.0).body() == {"epoch": 2, "outcome": "saved",
                                             "checkpoint_at": 5.0, "step": 7}  # fmt: skip


def test_a_noticed_jobs_wait_is_woken_by_its_acknowledgement_not_by_polling(tmp_path):
    """``agent/ack_wait.py``: the agent sleeps on a FIFO beside the acknowledgement; the
    checkpoint library's ``write_ack`` pokes it, so the wait ends at once, long before its
    timeout; with no poke it sleeps the whole timeout (one select, no 20 ms loop)."""
    import threading
    import time

    from prefect_spotgpu.agent.ack_wait import AckWait
    from prefect_spotgpu.checkpoint.handshake import write_ack

    ack = tmp_path / "notice.json.ack"
    with AckWait(ack, None) as waiting:
        assert waiting.fifo is not None and (tmp_path / "notice.json.ack.wake").exists()
        poke = threading.Timer(0.2, lambda: write_ack(ack, step=3, durable=True))
        poke.start()
        began = time.monotonic()
        waiting.until(time.time() + 30, ack.exists)
        assert ack.exists() and time.monotonic() - began < 5  # woken, not the 30 s
        waiting.wait(0.05)  # (the poke's writer closing may wake it once more: a fresh FIFO)
        began = time.monotonic()
        waiting.wait(0.2)  # nothing pokes it now: it sleeps
        assert 0.15 < time.monotonic() - began < 5
    assert not (tmp_path / "notice.json.ack.wake").exists()  # removed when done
    write_ack(tmp_path / "other.ack", step=1)  # no FIFO, nobody waiting: nothing else happens


def test_the_wait_ends_when_the_jobs_process_does(tmp_path):
    import subprocess
    import sys
    import time

    from prefect_spotgpu.agent.ack_wait import AckWait

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    with AckWait(tmp_path / "notice.json.ack", child.pid) as waiting:
        began = time.monotonic()
        waiting.until(time.time() + 30, lambda: child.poll() is not None)
        assert time.monotonic() - began < 10
    assert child.returncode == 0
