"""End to end (docs/operators/architecture.md#design-8): a real Prefect server, the real market
service, two real agents, a ``prefect worker start --type spot-gpu`` process and a deployment whose
flow checkpoints.

One stack serves the module; every test leaves both nodes live and no job running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventRelatedFilter,
    EventResourceFilter,
)
from prefect.states import Cancelling

from conftest import wait_for
from helpers import market_ticked, nodes_back_to_live
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
from prefect_spotgpu.cli.stack import LocalStack
from prefect_spotgpu.worker.pacing import RELEASE_PRICE
from spot_flow import count

HERE = Path(__file__).parent
STEPS = 60
PACE = 5  # the worker asks a paced run's policy every 5 s (default 60)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(prefect_api_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    with LocalStack(home, prefect_api_url, heartbeat_timeout_seconds=3) as stack:
        stack.start_market()
        stack.nodes = {stack.start_agent(name): name for name in ("node-a", "node-b")}
        stack.on_demand_node = stack.start_agent("node-od", capacity="on_demand")
        pool = stack.create_pool("spot-e2e", defaults={"gpu_count": 2, "max_price": 1.5})
        stack.deployment = stack.deploy("spot_flow.py:spot_count", HERE, "e2e", pool)
        stack.worker = stack.start_worker(pool, env={"SPOTGPU_PACE_SECONDS": str(PACE)})
        yield stack


@pytest.fixture(autouse=True)
def nodes_live(stack):
    """Every test starts and ends with both nodes live and no job left running."""
    yield
    nodes_back_to_live(stack)
    wait_for(lambda: not _running_jobs(stack), 30, "no job left running")


def _running_jobs(stack) -> list[int]:
    alive = []
    for name in stack.nodes.values():
        for pid in stack.job_pids(name):
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().split()[2] != "Z":
                        alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
    return alive


def start_run(prefect, stack, tmp_path, steps=STEPS, **variables) -> tuple[UUID, Path]:
    progress = tmp_path / "progress.jsonl"
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment),
        parameters={"steps": steps, "step_seconds": 0.1, "progress": str(progress)},
        job_variables=variables or None,
    )
    return run.id, progress


def progress_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hurry(progress: Path) -> None:
    """The run's remaining steps without their pause (spot_flow): the test has seen what the
    run's length was a margin for."""
    (progress.parent / "hurry").touch()


def steps_done(path: Path) -> int:
    return sum("step" in e for e in progress_of(path))


def wait_state(prefect, run_id, predicate, timeout, what):
    return wait_for(
        lambda: predicate(s := prefect.read_flow_run(run_id).state) and s, timeout, what, 0.2
    )


def running_allocation(prefect, run_id) -> int:
    def running():
        run = prefect.read_flow_run(run_id)
        return run.state.is_running() and run.labels.get("spotgpu.allocation")

    return int(wait_for(running, 90, "the flow run Running on an allocation", 0.2))


def node_of(stack, allocation: int) -> int:
    return stack.market().get(f"/allocations/{allocation}").json()["node_id"]


def reclaim(stack, node_id: int) -> None:
    response = stack.market(stack.owner_key).patch(f"/nodes/{node_id}", json={"state": "reclaimed"})
    assert response.status_code == 200, response.text


def uninterrupted_result(tmp_path) -> dict:
    ckpt = Checkpointer(LocalStorage(tmp_path / "reference"), "ref", every=1e9)
    return count(ckpt, STEPS, 0.0, None)


def state_names(prefect, run_id) -> list[str]:
    return [s.name for s in prefect.read_flow_run_states(run_id)]


def bid_of(stack, prefect, run_id) -> dict:
    bid_id = prefect.read_flow_run(run_id).labels["spotgpu.bid"]
    return stack.market().get(f"/bids/{bid_id}").json()


# ---------------------------------------------------------------- the reclaim path


def test_a_reclaim_mid_run_resumes_on_the_other_node_with_the_same_result(stack, prefect, tmp_path):
    run_id, progress = start_run(prefect, stack, tmp_path)
    first = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 10, 60, "progress before the reclaim")
    first_node = node_of(stack, first)
    reclaim(stack, first_node)

    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    assert final.is_completed()
    run = prefect.read_flow_run(run_id)
    assert run.run_count == 2
    names = state_names(prefect, run_id)
    running = [i for i, n in enumerate(names) if n == "Running"]
    preempted = names.index("Preempted")
    assert len(running) == 2 and running[0] < preempted < running[1], names
    assert names[-1] == "Completed"
    assert "Crashed" not in names, names  # a preemption never reads as a crash
    print("state history:", " -> ".join(names))  # (shown with -s: the docs quote it)

    second = int(run.labels["spotgpu.allocation"])
    assert second != first and node_of(stack, second) != first_node
    entries = progress_of(progress)
    starts = [e for e in entries if "start" in e]
    assert [int(s["alloc"]) for s in starts] == [first, second]
    assert starts[0]["start"] == 0 and starts[1]["start"] >= 10  # resumed, not restarted
    saved = [e["saved"] for e in entries if "saved" in e]
    assert starts[1]["start"] == saved[0] + 1  # exactly after the final save
    done = [e["done"] for e in entries if "done" in e]
    assert done == [uninterrupted_result(tmp_path)]

    bid = wait_for(
        lambda: (b := bid_of(stack, prefect, run_id))["status"] == "finished" and b,
        30,
        "the bid finished",
    )
    allocations = stack.market().get(f"/bids/{bid['id']}/allocations").json()
    assert [(a["id"], a["status"]) for a in allocations] == [
        (first, "preempted"),
        (second, "finished"),
    ]

    events = wait_for(
        lambda: (e := _spot_events(prefect, run_id)) and "spotgpu.bid.resumed" in e and e,
        30,
        "the worker's events",
    )
    for name in ("created", "allocated", "noticed", "preempted", "resumed"):
        assert f"spotgpu.bid.{name}" in events, events
    # what a "notify me when a run crashes" automation triggers on never happened
    assert "prefect.flow-run.Crashed" not in _run_events(prefect, run_id, "prefect.flow-run.")
    assert "prefect.flow-run.Preempted" in _run_events(prefect, run_id, "prefect.flow-run.")
    artifacts = {
        a.key: a
        for a in prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
    }
    table = json.loads(artifacts[f"spotgpu-{run_id}-allocations"].data)
    assert [row["allocation"] for row in table] == [first, second]
    summary = artifacts[f"spotgpu-{run_id}-cost"].data
    assert "| Preemptions | 1 |" in summary and "On-demand cost" in summary


def test_a_warm_replacement_is_set_up_while_the_old_job_saves_and_restores_after(
    stack, prefect, tmp_path
):
    """The reserved node starts the job at the notice: its set-up (2 s) is done while the old
    job's final save is written; it restores only after that save is durable.

    The old job's final save lasts until the new job's set-up is noted, at most 60 s (a fixed
    hold of 10 s was outrun on a machine running three test workers: the new job's start,
    loading Prefect and the flow, took longer). Without a warm start the set-up comes only
    after the old job's stop, 60 s later, and the test fails."""
    warm_log = tmp_path / "warm.jsonl"
    env = {
        "SPOTGPU_TEST_WARM_LOG": str(warm_log),
        "SPOTGPU_TEST_SETUP_SECONDS": "2",
        "SPOTGPU_TEST_FINAL_SAVE_SECONDS": "60",
        "SPOTGPU_TEST_FINAL_SAVE_AWAITS_WARM": "1",
    }
    run_id, progress = start_run(prefect, stack, tmp_path, env=env)
    first = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 5, 60, "progress before the reclaim")
    reclaim(stack, node_of(stack, first))
    restored = wait_for(
        lambda: next(
            (e for e in progress_of(progress) if "start" in e and e["alloc"] != str(first)), None
        ),
        120,
        "the resume on the other node",
    )
    hurry(progress)
    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    assert final.is_completed()
    second = int(restored["alloc"])
    assert second == int(prefect.read_flow_run(run_id).labels["spotgpu.allocation"])
    old = stack.market().get(f"/allocations/{first}").json()
    assert old["status"] == "preempted" and old["final_save"] == "ok"
    warm = {e["warm"]: e["t"] for e in progress_of(warm_log)}
    assert warm[str(second)] < old["ended_at"]  # set up before the old job's ack
    entries = progress_of(progress)
    assert restored["t"] > old["ended_at"]  # restored only after the final save was durable
    assert restored["start"] == next(e["saved"] for e in entries if "saved" in e) + 1
    states = prefect.read_flow_run_states(run_id)
    running_again = [s for s in states if s.is_running()][-1].timestamp.timestamp()
    # the set-up is not paid again after the stop (a gross bound: 2 s of it, plus loading
    # the flow, would come on top of the worker's own second or two)
    assert running_again - old["ended_at"] < 10


def test_a_run_that_finishes_during_its_notice_leaves_no_open_bid(stack, prefect, tmp_path):
    """End to end: the owner takes the node back and the job, instead of saving,
    finishes its work and exits 0 within the notice. The run is Completed and not rescheduled;
    its bid ends, the GPUs reserved for it on the other node are let go, and nothing bills."""
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment),
        parameters={
            **{"steps": 40, "step_seconds": 0.1, "finish_on_notice": True},
            "progress": str(tmp_path / "progress.jsonl"),
        },
    )
    first = running_allocation(prefect, run.id)
    wait_for(lambda: steps_done(tmp_path / "progress.jsonl") >= 5, 60, "progress")
    reclaim(stack, node_of(stack, first))

    wait_state(prefect, run.id, lambda s: s.is_completed(), 120, "Completed")
    assert "Preempted" not in state_names(prefect, run.id)
    bid = wait_for(
        lambda: (b := bid_of(stack, prefect, run.id))["status"] in ("finished", "cancelled") and b,
        30,
        "the bid over",
    )
    market = stack.market()
    wait_for(
        lambda: all(
            a["status"] not in ("running", "noticed", "reserved")
            for a in market.get(f"/bids/{bid['id']}/allocations").json()
        ),
        30,
        "no allocation of the bid left",
    )
    allocations = market.get(f"/bids/{bid['id']}/allocations").json()
    assert allocations[0]["id"] == first, allocations

    def charged() -> list[int]:
        return [a["charged_micros"] for a in market.get(f"/bids/{bid['id']}/allocations").json()]

    before = charged()
    market_ticked(stack)  # flushes later (every 0.5 s in the stack): nothing more is charged
    assert charged() == before
    assert prefect.read_flow_run(run.id).run_count == 1


def _spot_events(prefect, run_id) -> list[str]:
    return _run_events(prefect, run_id, "spotgpu.bid.")


def _run_events(prefect, run_id, prefix: str) -> list[str]:
    """The names of the events about the run whose names start with ``prefix``."""
    resource = f"prefect.flow-run.{run_id}"
    page = prefect.read_events(
        EventFilter(
            event=EventNameFilter(prefix=[prefix]),
            resource=EventResourceFilter(id=[resource]) if prefix.startswith("prefect.") else None,
            related=None if prefix.startswith("prefect.") else EventRelatedFilter(id=[resource]),
        ),
        limit=50,  # (Prefect's most)
    )
    return [e.event for e in page.events]


# ---------------------------------------------------------------- other paths


def test_cancelling_the_flow_run_cancels_the_bid_and_stops_the_job(stack, prefect, tmp_path):
    run_id, progress = start_run(prefect, stack, tmp_path, steps=100000)
    allocation = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 3, 60, "progress")
    prefect.set_flow_run_state(run_id, Cancelling(), force=True)
    wait_state(prefect, run_id, lambda s: s.is_cancelled(), 60, "Cancelled")
    assert bid_of(stack, prefect, run_id)["status"] == "cancelled"
    ended = stack.market().get(f"/allocations/{allocation}").json()
    assert ended["status"] == "finished" and ended["ended_at"] is not None
    wait_for(lambda: not _running_jobs(stack), 30, "the job stopped")  # no process of it left


def test_beyond_max_preemptions_the_run_fails_with_a_clear_message(stack, prefect, tmp_path):
    run_id, progress = start_run(prefect, stack, tmp_path, max_preemptions=0)
    allocation = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 3, 60, "progress")
    reclaim(stack, node_of(stack, allocation))
    failed = wait_state(prefect, run_id, lambda s: s.is_failed(), 60, "Failed")
    assert "more than max_preemptions=0" in failed.message
    assert bid_of(stack, prefect, run_id)["status"] == "cancelled"


def test_a_lost_agent_is_a_preemption_without_notice(stack, prefect, tmp_path):
    run_id, progress = start_run(prefect, stack, tmp_path)
    first = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 10, 60, "progress")
    lost_node = node_of(stack, first)
    name = stack.nodes[lost_node]
    stack.kill(f"agent-{name}")  # the host dies: agent and job
    for pid in stack.job_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    assert final.is_completed()
    names = state_names(prefect, run_id)
    # no notice: a real crash reads as one, and still resumes
    crashed = names.index("Crashed")
    assert names[crashed - 1 : crashed + 2] == ["Running", "Crashed", "Preempted"], names
    assert "Running" in names[crashed:] and names[-1] == "Completed", names
    assert names.count("Crashed") == 1, names
    ended = stack.market().get(f"/allocations/{first}").json()
    assert ended["status"] == "preempted" and ended["final_save"] is None
    starts = [e for e in progress_of(progress) if "start" in e]
    assert starts[1]["start"] > 0  # from the last periodic checkpoint
    done = [e["done"] for e in progress_of(progress) if "done" in e]
    assert done == [uninterrupted_result(tmp_path)]
    stack.start_agent(name)  # the host comes back


def test_a_worker_restarted_mid_run_adopts_it(stack, prefect, tmp_path):
    steps = 600  # long enough to be reclaimed after the adoption, on a slow machine too
    run_id, progress = start_run(prefect, stack, tmp_path, steps=steps)
    first = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 5, 60, "progress")
    stack.kill("worker")
    stack.worker = stack.start_worker(
        "spot-e2e", name="worker", env={"SPOTGPU_PACE_SECONDS": str(PACE)}
    )
    wait_for(lambda: "Adopting flow run" in stack.log("worker", 100_000), 60, "adoption")
    wait_for(lambda: f"Following bid {bid_of(stack, prefect, run_id)['id']}" in stack.log(
        "worker", 100_000), 60, "the new worker following the run")  # fmt: skip
    assert steps_done(progress) < steps, "the run finished before the reclaim"
    reclaim(stack, node_of(stack, first))
    wait_for(lambda: len([e for e in progress_of(progress) if "start" in e]) == 2, 120, "resumed")
    hurry(progress)  # (not before: the job would finish within its notice instead of saving)
    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    assert final.is_completed()
    assert "Preempted" in state_names(prefect, run_id)
    flow_run_bids = [
        b
        for b in stack.market().get("/bids", params={"limit": 1000}).json()
        if (b["labels"] or {}).get("prefect.flow-run-id") == str(run_id)
    ]
    assert len(flow_run_bids) == 1  # no duplicate bid
    assert [e["done"] for e in progress_of(progress) if "done" in e]


def test_a_preemption_while_no_worker_follows_is_caught_up_by_the_next_worker(
    stack, prefect, tmp_path
):
    """The worker is killed, then the node is reclaimed: the job saves and is stopped (the run
    stays Running: the agent's SIGKILL leaves its engine no last word), and nobody reschedules
    the run. The next worker adopts it, sees the
    preemption it missed, reschedules it as Preempted, and the run resumes and completes."""
    steps = 300
    run_id, progress = start_run(prefect, stack, tmp_path, steps=steps)
    first = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 5, 60, "progress")
    stack.kill("worker")
    reclaim(stack, node_of(stack, first))
    market = stack.market()
    wait_for(
        lambda: market.get(f"/allocations/{first}").json()["status"] == "preempted",
        60,
        "the preemption, with no worker",
    )
    assert steps_done(progress) < steps
    hurry(progress)
    stack.worker = stack.start_worker(
        "spot-e2e", name="worker", env={"SPOTGPU_PACE_SECONDS": str(PACE)}
    )
    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 180, "Completed")
    assert final.is_completed() and prefect.read_flow_run(run_id).run_count == 2
    assert "Preempted" in state_names(prefect, run_id)
    starts = [e for e in progress_of(progress) if "start" in e]
    saved = [e["saved"] for e in progress_of(progress) if "saved" in e]
    assert len(starts) == 2 and starts[1]["start"] == saved[0] + 1  # from the final save
    reference = Checkpointer(LocalStorage(tmp_path / "reference"), "ref", every=1e9)
    done = [e["done"] for e in progress_of(progress) if "done" in e]
    assert done == [count(reference, steps, 0.0, None)]


def test_a_run_no_node_can_serve_says_why_while_it_waits(stack, prefect, tmp_path):
    """Its image needs a Docker node and the stack's nodes run processes: the market holds the
    bid, never placing it on a process node, and the worker says why (the run's log and a
    ``spotgpu.bid.held`` event) while the run waits AwaitingGPU."""
    flows = {"reference": "registry.example.com/spotgpu/pytorch:1", "framework": "PyTorch"}
    admin = stack.market(stack.admin_key)
    assert admin.put("/images/pytorch-flows", json={**flows, "runs_flows": True}).is_success
    run_id, progress = start_run(prefect, stack, tmp_path, steps=1, image="pytorch-flows")
    wait_for(lambda: "spotgpu.bid.held" in _spot_events(prefect, run_id), 60, "spotgpu.bid.held")
    bid = bid_of(stack, prefect, run_id)
    assert bid["status"] == "held" and bid["hold_reason"].startswith("no node can run it: ")
    assert "--runner docker" in bid["hold_reason"]
    assert f"Bid {bid['id']} is held: no node can run it" in stack.log("worker", 100_000)
    assert prefect.read_flow_run(run_id).state.name == "AwaitingGPU"
    prefect.set_flow_run_state(run_id, Cancelling(), force=True)
    wait_state(prefect, run_id, lambda s: s.is_cancelled(), 60, "Cancelled")
    assert not progress.exists()  # it never ran


def test_a_scheduled_run_is_bid_for_promptly(stack, prefect, tmp_path):
    run_id, _ = start_run(prefect, stack, tmp_path, steps=1)
    created = prefect.read_flow_run(run_id).created
    bid = wait_for(
        lambda: (b := prefect.read_flow_run(run_id).labels.get("spotgpu.bid")) and b, 20, "a bid"
    )
    placed = stack.market().get(f"/bids/{bid}").json()["created_at"]
    from datetime import datetime

    pickup = datetime.fromisoformat(placed) - created
    wait_state(prefect, run_id, lambda s: s.is_completed(), 90, "Completed")
    # target 2 s, measured by benchmarks/recovery.py; here only a gross regression fails, since a
    # loaded 2-core CI machine has taken 8 s
    assert pickup.total_seconds() < 20.0, pickup


def test_a_cheap_window_only_run_bids_for_its_window(stack, prefect, tmp_path):
    """Somewhere on Earth it is a weekday afternoon (except at weekends): there the run waits,
    Pending, for tonight's window; where the window is open it runs at once."""
    from datetime import UTC, datetime, timedelta

    from prefect_spotgpu.economics.schedules import cheap_window

    now = datetime.now(UTC)
    zones = [f"Etc/GMT{offset:+d}" if offset else "UTC" for offset in range(-14, 13)]
    # closed for at least the next minute, so the run cannot start while the test watches
    closed = [z for z in zones if cheap_window(now, z)[0] > now + timedelta(minutes=1)]
    zone = closed[0] if closed else zones[0]
    run_id, _ = start_run(prefect, stack, tmp_path, cheap_window_only=True, timezone=zone)
    bid = wait_for(
        lambda: (b := prefect.read_flow_run(run_id).labels.get("spotgpu.bid")) and b, 30, "bid"
    )
    bid = stack.market().get(f"/bids/{bid}").json()
    start, end = cheap_window(datetime.fromisoformat(bid["created_at"]), zone)
    assert datetime.fromisoformat(bid["window_start"]) == start
    assert datetime.fromisoformat(bid["window_end"]) == end
    if closed:
        state = wait_state(prefect, run_id, lambda s: s.name == "AwaitingGPU", 30, "AwaitingGPU")
        assert "cheap window" in state.message
        market_ticked(stack)
        assert stack.market().get(f"/bids/{bid['id']}/allocations").json() == []
        prefect.set_flow_run_state(run_id, Cancelling(), force=True)
        wait_state(prefect, run_id, lambda s: s.is_cancelled(), 60, "Cancelled")
        assert bid_of(stack, prefect, run_id)["status"] == "cancelled"
    else:  # a weekend: the window is open everywhere
        wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")


def test_a_market_crash_mid_run_loses_nothing(stack, prefect, tmp_path):
    """The market is SIGKILLed while a run is Running and comes back 3 s later: the worker
    and the agents ride it out (retries), no node is declared lost on the restart, and a
    reclaim afterwards still resumes the run on the other node.

    The run has two minutes of steps, hurried once it has resumed: its first attempt is still
    running at the reclaim however long the market's restart takes (12 s of steps were done
    first on a machine running three test workers)."""
    run_id, progress = start_run(prefect, stack, tmp_path, steps=1200)
    first = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 5, 60, "progress")
    node = node_of(stack, first)
    stack.restart_market(down_seconds=3)
    owner = stack.market(stack.owner_key)
    assert all(n["state"] == "live" for n in owner.get("/nodes").json())
    assert stack.market().get(f"/allocations/{first}").json()["status"] == "running"
    reclaim(stack, node)
    wait_for(
        lambda: any("start" in e and e["alloc"] != str(first) for e in progress_of(progress)),
        120,
        "the resume on the other node",
    )
    hurry(progress)
    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    assert final.is_completed() and "Preempted" in state_names(prefect, run_id)
    assert all(n["state"] == "live" for n in owner.get("/nodes").json() if n["id"] != node)
    done = [e["done"] for e in progress_of(progress) if "done" in e]
    assert len(done) == 1
    bids = [
        b
        for b in stack.market().get("/bids", params={"limit": 1000}).json()
        if (b["labels"] or {}).get("prefect.flow-run-id") == str(run_id)
    ]
    assert len(bids) == 1


# ---------------------------------------------------------------- deadlines


def test_a_run_that_spot_can_no_longer_finish_in_time_runs_on_demand(stack, prefect, tmp_path):
    """1 GPU-hour due in 1.05 h with 6 minutes lost per start: the slack cannot absorb a
    restart, so the policy sends the run to on-demand capacity at once, at the on-demand
    price, and it completes there (never on the spot nodes)."""
    run_id, _ = start_run(
        prefect, stack, tmp_path, steps=5, gpu_hours=1.0, deadline_hours=1.05, restart_minutes=6
    )
    wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    bid = bid_of(stack, prefect, run_id)
    assert bid["capacity"] == "on_demand" and bid["max_price"] == 2.1
    assert bid["deadline"] is not None
    allocations = stack.market().get(f"/bids/{bid['id']}/allocations").json()
    assert {a["node_id"] for a in allocations} == {stack.on_demand_node}
    assert {a["price"] for a in allocations} == {2.1}
    spot_bids = [
        b
        for b in stack.market().get("/bids").json()
        if b["labels"].get("prefect.flow-run-id") == str(run_id) and b["id"] != bid["id"]
    ]
    assert spot_bids == []  # the plan came before the first bid: no spot bid was placed


def test_a_paced_run_with_slack_stays_on_spot(stack, prefect, tmp_path):
    run_id, _ = start_run(prefect, stack, tmp_path, steps=5, gpu_hours=1.0, deadline_hours=10)
    wait_state(prefect, run_id, lambda s: s.is_completed(), 120, "Completed")
    bid = bid_of(stack, prefect, run_id)
    assert bid["capacity"] == "spot" and bid["max_price"] == 1.5  # on pace: the cap
    allocations = stack.market().get(f"/bids/{bid['id']}/allocations").json()
    assert {a["node_id"] for a in allocations} <= set(stack.nodes)


def bids_of_run(stack, run_id, finished=False) -> list[dict] | None:
    """The run's bids, oldest first (None: none yet, or, with ``finished``, its last bid's
    job has not ended)."""
    listed = stack.market().get("/bids", params={"limit": 1000}).json()
    mine = [b for b in listed if b["labels"].get("prefect.flow-run-id") == str(run_id)]
    mine.sort(key=lambda b: b["id"])  # (listed newest first)
    return mine if mine and (not finished or mine[-1]["status"] == "finished") else None


def complete_after_a_second_start(stack, prefect, run_id, progress, what: str) -> None:
    """Wait for the run's second start (``what``), let it finish at full speed, and check it
    completed in two attempts."""
    try:
        wait_for(lambda: len([e for e in progress_of(progress) if "start" in e]) == 2, 240, what)
    except TimeoutError:
        print([e for e in progress_of(progress) if "step" not in e], stack.log("worker", 5000))
        raise
    hurry(progress)
    final = wait_state(prefect, run_id, lambda s: s.is_completed(), 300, "Completed")
    assert final.is_completed() and prefect.read_flow_run(run_id).run_count == 2


def check_resumed_from_the_final_save(prefect, run_id, progress, tmp_path, steps, allocations,
                                      event):  # fmt: skip
    """The run started on ``allocations`` in turn, the second from the first's final save,
    counted what an uninterrupted run counts, and the worker emitted ``event``."""
    entries = progress_of(progress)
    starts = [e for e in entries if "start" in e]
    assert [int(s["alloc"]) for s in starts] == allocations
    saved = [e["saved"] for e in entries if "saved" in e]
    assert starts[1]["start"] == saved[0] + 1 > 1  # resumed from the final save
    reference = Checkpointer(LocalStorage(tmp_path / "reference"), "ref", every=1e9)
    assert [e["done"] for e in entries if "done" in e] == [count(reference, steps, 0.0, None)]
    events = wait_for(
        lambda: (e := _spot_events(prefect, run_id)) and f"spotgpu.bid.{event}" in e and e,
        30,
        "the worker's events",
    )
    assert "spotgpu.bid.preempted" in events


def test_a_deadline_aware_run_bridges_on_demand_and_goes_back_to_spot(stack, prefect, tmp_path):
    """Spot is open nowhere (both spot nodes reclaimed) and the run has 1.5 h of slack, under
    the 2 h bridge: deadline-aware starts it on on-demand capacity instead of waiting its
    slack away. The spot nodes come back: the slack pays two more starts, so the worker
    releases the on-demand job (its bid lowered: the usual notice, the final save, billed at
    the on-demand price) and the run resumes on spot from that save, finishing with the
    uninterrupted result."""
    owner = stack.market(stack.owner_key)
    for node_id in stack.nodes:
        assert owner.patch(f"/nodes/{node_id}", json={"state": "reclaimed"}).status_code == 200
    steps = 800
    run_id, progress = start_run(
        prefect, stack, tmp_path, steps=steps, gpu_hours=1.0, deadline_hours=2.5,
        restart_minutes=0.1, bidding_policy="deadline-aware",
    )  # fmt: skip
    market = stack.market()
    wait_for(lambda: any("start" in e for e in progress_of(progress)), 120, "the first start")
    (first,) = bids_of_run(stack, run_id)
    assert first["capacity"] == "on_demand"  # the bridge: no spot anywhere, slack 1.5 h
    for node_id in stack.nodes:
        assert owner.patch(f"/nodes/{node_id}", json={"state": "live"}).status_code == 200
    complete_after_a_second_start(stack, prefect, run_id, progress, "the resume on spot")
    bids = wait_for(lambda: bids_of_run(stack, run_id, True), 30, "the spot bid finished")
    assert [(b["capacity"], b["status"]) for b in bids] == [
        ("on_demand", "cancelled"),
        ("spot", "finished"),
    ]
    on_demand_bid, spot_bid = bids
    assert on_demand_bid["max_price"] == RELEASE_PRICE  # released: it was placed at 2.1
    [od] = market.get(f"/bids/{on_demand_bid['id']}/allocations").json()
    assert od["node_id"] == stack.on_demand_node and od["status"] == "preempted"
    assert od["notice_reason"] == "below_reserve" and od["final_save"] == "ok"
    assert od["price"] == 2.1  # its notice too: billed at the on-demand price
    [spot] = market.get(f"/bids/{spot_bid['id']}/allocations").json()
    assert spot["node_id"] in stack.nodes and spot["price"] <= 1.5
    assert spot_bid["labels"]["spotgpu.replaces"] == str(on_demand_bid["id"])
    check_resumed_from_the_final_save(
        prefect, run_id, progress, tmp_path, steps, [od["id"], spot["id"]], "spot"
    )


def test_a_spot_run_that_falls_behind_saves_and_finishes_on_demand(stack, prefect, tmp_path):
    """135 s of slack and 90 s lost per start: the policy starts on spot, but the start eats
    the slack, so about 40 s in it moves the running job to on-demand. Its spot bid
    is lowered below every reserve (a notice: the final save), and the run resumes on the
    on-demand node from that save, finishing with the uninterrupted result."""
    steps = 800
    run_id, progress = start_run(
        prefect,
        stack,
        tmp_path,
        steps=steps,
        gpu_hours=1.0,
        deadline_hours=1.0 + 135 / 3600,
        restart_minutes=1.5,
    )
    complete_after_a_second_start(stack, prefect, run_id, progress, "the resume on on-demand")

    market = stack.market()
    bids = wait_for(lambda: bids_of_run(stack, run_id, True), 30, "the on-demand bid finished")
    assert [(b["capacity"], b["status"]) for b in bids] == [
        ("spot", "cancelled"),
        ("on_demand", "finished"),
    ]
    spot_bid, on_demand_bid = bids
    assert spot_bid["max_price"] == RELEASE_PRICE  # released: it was placed at the cap
    [spot] = market.get(f"/bids/{spot_bid['id']}/allocations").json()
    assert spot["status"] == "preempted" and spot["notice_reason"] == "below_reserve"
    assert spot["final_save"] == "ok" and spot["node_id"] in stack.nodes
    [second] = market.get(f"/bids/{on_demand_bid['id']}/allocations").json()
    assert second["node_id"] == stack.on_demand_node and second["price"] == 2.1

    check_resumed_from_the_final_save(
        prefect, run_id, progress, tmp_path, steps, [spot["id"], second["id"]], "on-demand"
    )
    assert on_demand_bid["labels"]["spotgpu.replaces"] == str(spot_bid["id"])
    table = wait_for(  # each attempt publishes the table again: the last has both bids
        lambda: [
            table
            for a in prefect.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            )
            if a.key == f"spotgpu-{run_id}-allocations" and len(table := json.loads(a.data)) > 1
        ],
        30,
        "the run's allocations table, after its last attempt",
    )[0]
    assert [(row["bid"], row["allocation"]) for row in table] == [
        (spot_bid["id"], spot["id"]),
        (on_demand_bid["id"], second["id"]),
    ]  # the run's whole cost: spot and on-demand
