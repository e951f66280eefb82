"""A gang end to end (docs/users/gangs.md): a real Prefect server, the real market service,
**three** real agents on loopback (two declared GPUs each), a ``prefect worker start --type
spot-gpu`` process and ``flows/pretrain.py`` deployed on a pool with ``node_count: 2``.

The owner takes back the node of one member mid-run: the whole gang is noticed, every rank saves
its shard of one gang checkpoint, the gang stops, the flow run is ``Preempted``, and the gang
resumes on the surviving node plus the third; the run is ``Completed`` with exactly the losses of
an uninterrupted two-node run (its table artifact against the command line's, bit for bit). A
second run finds no replacement: the gang waits whole, holding no GPUs, and resumes when the
owner gives a node back. A third, ``flows/fsdp_pretrain.py`` with ``min_node_count: 1``, finds
none either and goes on with its survivor alone: DCP reshards the two ranks' checkpoint onto one.

Each test prints its timeline (``pytest -s``); a gang's closing note quotes one.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)

from conftest import wait_for
from helpers import nodes_back_to_live
from prefect_spotgpu.agent.isolation import ACK_NAME
from prefect_spotgpu.cli.stack import LocalStack
from prefect_spotgpu.protocol import LABELS
from test_flows import PRETRAIN, start_ranks

FLOWS = Path(__file__).parent.parent / "flows"
STEPS = 400  # 15 ms (idle) to 150 ms (this stack busy) a step: long enough for a reclaim
HOLDING = ("running", "noticed", "reserved")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(prefect_api_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("gang-stack")
    with LocalStack(home, prefect_api_url, heartbeat_timeout_seconds=3) as stack:
        stack.start_market()
        stack.nodes = {stack.start_agent(name): name for name in ("node-a", "node-b", "node-c")}
        pool = stack.create_pool(
            "gang-e2e", defaults={"gpu_count": 2, "node_count": 2, "max_price": 1.5}
        )
        stack.deployment = stack.deploy("pretrain.py:pretrain", FLOWS, "gang", pool)
        stack.fsdp = stack.deploy("fsdp_pretrain.py:fsdp_pretrain", FLOWS, "gang-fsdp", pool)
        stack.start_worker(pool)
        yield stack


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The losses of a two-rank run never stopped: the command line (``flows/pretrain.py``,
    its defaults as the flow's), started now, read when a test needs them."""
    home = tmp_path_factory.mktemp("uninterrupted")
    command = [
        *(sys.executable, str(PRETRAIN), "--steps", str(STEPS)),
        *("--checkpoints", str(home / "store"), "--result", str(home / "result.json")),
    ]
    procs = start_ranks([command] * 2, [{}, {}], home / "logs")

    def losses() -> list[float]:
        for rank, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (home / "logs" / f"rank{rank}.out").read_text()
        return json.loads((home / "result.json").read_text())["losses"]

    yield losses
    for proc in procs:
        proc.kill()


@pytest.fixture(autouse=True)
def nodes_live(stack):
    """Every test starts and ends with the three nodes live and holding nothing."""
    yield
    nodes_back_to_live(stack)


def start_run(prefect, stack) -> UUID:
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment),
        parameters={"steps": STEPS, "checkpoint_minutes": 0.05},
        job_variables={
            "cheap_window_only": False,
            "env": {"PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3", "OMP_NUM_THREADS": "1"},
        },
    )
    return run.id


def logged_step(prefect, run_id) -> int:
    """The last step rank 0 logged ("step k/N loss ..."), 0 before the first."""
    logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    steps = [
        int(log.message.split()[1].split("/")[0]) for log in logs if log.message.startswith("step ")
    ]
    return max(steps, default=0)


def gang_allocations(stack, prefect, run_id) -> list[dict]:
    bid = prefect.read_flow_run(run_id).labels[LABELS.BID]
    return stack.market().get(f"/bids/{bid}/allocations").json()


def running_gang(stack, prefect, run_id, seen: int = 0) -> list[dict]:
    """The gang's running allocations (rank order) once it runs beyond the ``seen`` ones."""

    def running():
        if not prefect.read_flow_run(run_id).state.is_running():
            return None
        allocs = [a for a in gang_allocations(stack, prefect, run_id) if a["id"] > seen]
        up = sorted((a for a in allocs if a["status"] == "running"), key=lambda a: a["rank"])
        return up if len(up) == 2 else None

    return wait_for(running, 120, "the gang Running on two allocations", 0.2)


def the_end(prefect, run_id):
    """The run's final state (not Crashed: a preempted engine reports Crashed itself before
    the worker reschedules the run, docs/operators/architecture.md#design-4), else None."""
    state = prefect.read_flow_run(run_id).state
    return state if state.is_final() and not state.is_crashed() else None


def reclaim(stack, node_id: int) -> None:
    answer = stack.market(stack.owner_key).patch(f"/nodes/{node_id}", json={"state": "reclaimed"})
    assert answer.status_code == 200, answer.text


def acknowledgement(stack, allocation: dict) -> dict:
    """The member's acknowledgement of its final save, as its job wrote it."""
    name = stack.nodes[allocation["node_id"]]
    path = stack.home / f"agent-{name}" / f"alloc-{allocation['id']}" / ACK_NAME
    return json.loads(wait_for(lambda: path.exists() and path.read_text(), 60, f"{path}"))


def all_ended(stack, prefect, run_id) -> list[dict]:
    """The gang's allocations, once none of them holds GPUs any more."""
    wait_for(
        lambda: all(a["status"] not in HOLDING for a in gang_allocations(stack, prefect, run_id)),
        30,
        "every member's allocation ended",
    )
    return gang_allocations(stack, prefect, run_id)


def loss_table(prefect, run_id) -> list[float]:
    artifacts = prefect.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
    )
    (table,) = [a for a in artifacts if a.type == "table" and not a.key]  # (not the worker's)
    rows = json.loads(table.data)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def timeline(stack, prefect, run_id, started: float) -> list[str]:
    """The gang's market events and the run's states, in order, seconds from ``started``."""
    bid = prefect.read_flow_run(run_id).labels[LABELS.BID]
    events = stack.market().get(f"/bids/{bid}/events", params={"after": 0, "timeout": 0}).json()
    rank = {a["id"]: a["rank"] for a in gang_allocations(stack, prefect, run_id)}
    rows = [
        (e["created_at"], f"{e['kind']:<10} rank {rank.get(e['allocation_id'], '?')}, allocation "
         f"{e['allocation_id']} on {stack.nodes.get(e['node_id'], e['node_id'])}")
        for e in events["events"]
    ]  # fmt: skip
    from datetime import datetime

    moments = [(datetime.fromisoformat(at).timestamp(), what) for at, what in rows]
    moments += [
        (s.timestamp.timestamp(), f"state {s.name}") for s in prefect.read_flow_run_states(run_id)
    ]
    return [f"{at - started:7.2f} s  {what}" for at, what in sorted(moments)]


def test_a_reclaimed_member_stops_the_gang_which_resumes_on_the_survivor_and_the_third(
    stack, prefect, uninterrupted
):
    started = time.time()
    run_id = start_run(prefect, stack)
    first = running_gang(stack, prefect, run_id)
    assert [a["rank"] for a in first] == [0, 1]
    assert len({a["node_id"] for a in first}) == 2
    wait_for(lambda: logged_step(prefect, run_id) >= 50, 120, "training before the reclaim", 0.2)
    reclaim(stack, first[1]["node_id"])  # rank 1's node: the engine's rank is noticed too

    acks = [acknowledgement(stack, a) for a in first]
    assert acks[0]["step"] == acks[1]["step"] and all(a["durable"] for a in acks), acks
    saved_at = acks[0]["step"]
    assert 50 <= saved_at < STEPS - 1  # mid-run
    final = wait_for(lambda: the_end(prefect, run_id), 240, "the run's end")
    assert final.is_completed(), final
    run = prefect.read_flow_run(run_id)
    assert run.run_count == 2
    names = [s.name for s in prefect.read_flow_run_states(run_id)]
    assert names.index("Preempted") > names.index("Running"), names
    assert names.count("Running") == 2 and names[-1] == "Completed", names

    allocations = gang_allocations(stack, prefect, run_id)
    second = sorted((a for a in allocations if a["id"] > max(x["id"] for x in first)),
                    key=lambda a: a["rank"])  # fmt: skip
    survivor, lost = first[0]["node_id"], first[1]["node_id"]
    third = (set(stack.nodes) - {survivor, lost}).pop()
    assert [(a["rank"], a["node_id"]) for a in second] == [(0, survivor), (1, third)]
    wait_for(
        lambda: all(a["status"] not in HOLDING for a in gang_allocations(stack, prefect, run_id)),
        30,
        "every member's allocation ended",
    )
    statuses = {a["id"]: a["status"] for a in gang_allocations(stack, prefect, run_id)}
    assert [statuses[a["id"]] for a in first] == ["preempted", "preempted"]
    assert [statuses[a["id"]] for a in second] == ["finished", "finished"]

    losses = loss_table(prefect, run_id)
    reference = uninterrupted()
    assert [x.hex() for x in losses] == [x.hex() for x in reference]  # bit for bit
    print("\n".join(["", f"saved at step {saved_at}", *timeline(stack, prefect, run_id, started)]))


def test_a_gang_with_no_replacement_waits_whole_then_resumes(stack, prefect, uninterrupted):
    started = time.time()
    run_id = start_run(prefect, stack)
    first = running_gang(stack, prefect, run_id)
    spare = (set(stack.nodes) - {a["node_id"] for a in first}).pop()
    reclaim(stack, spare)  # no third node for the gang to move to
    wait_for(lambda: logged_step(prefect, run_id) >= 50, 120, "training before the reclaim", 0.2)
    reclaim(stack, first[0]["node_id"])  # rank 0's node: the engine's

    acks = [acknowledgement(stack, a) for a in first]
    assert acks[0]["step"] == acks[1]["step"], acks
    ids = {a["id"] for a in first}
    wait_for(
        lambda: all(
            a["status"] == "preempted"
            for a in gang_allocations(stack, prefect, run_id)
            if a["id"] in ids
        ),
        120,
        "the gang stopped",
    )
    wait_for(  # the worker hears of the preemption by its event feed: a moment after the market
        lambda: not prefect.read_flow_run(run_id).state.is_running(), 60, "the run Preempted", 0.2
    )
    for _ in range(6):  # the gang waits whole: no member holds GPUs, none runs alone
        held = [a for a in gang_allocations(stack, prefect, run_id) if a["status"] in HOLDING]
        assert held == [], held
        assert not prefect.read_flow_run(run_id).state.is_running()
        time.sleep(0.5)

    stack.market(stack.owner_key).patch(f"/nodes/{spare}", json={"state": "live"})
    second = running_gang(stack, prefect, run_id, seen=max(a["id"] for a in first))
    assert {a["node_id"] for a in second} == {first[1]["node_id"], spare}
    final = wait_for(lambda: the_end(prefect, run_id), 240, "the run's end")
    assert final.is_completed(), final
    assert [x.hex() for x in loss_table(prefect, run_id)] == [x.hex() for x in uninterrupted()]
    print("\n".join(["", *timeline(stack, prefect, run_id, started)]))


FSDP_STEPS = 600


@pytest.fixture(scope="module")
def fsdp_uninterrupted(tmp_path_factory):
    """The losses of ``flows/fsdp_pretrain.py`` on two ranks never stopped (the command line,
    the flow's defaults)."""
    home = tmp_path_factory.mktemp("fsdp-uninterrupted")
    command = [
        *(sys.executable, str(FLOWS / "fsdp_pretrain.py"), "--steps", str(FSDP_STEPS)),
        *("--checkpoints", str(home / "store"), "--result", str(home / "result.json")),
    ]
    procs = start_ranks([command] * 2, [{}, {}], home / "logs")
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=300) == 0, (home / "logs" / f"rank{rank}.out").read_text()
    return json.loads((home / "result.json").read_text())["losses"]


def logged_losses(prefect, run_id) -> dict[int, float]:
    """step -> loss, as rank 0 logged them ("step k/N loss x")."""
    logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return {
        int(log.message.split()[1].split("/")[0]): float(log.message.split()[3])
        for log in logs
        if log.message.startswith("step ")
    }


def test_a_gang_that_may_shrink_goes_on_with_its_survivor_and_dcp_reshards(
    stack, prefect, fsdp_uninterrupted
):
    started = time.time()
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.fsdp),
        parameters={"steps": FSDP_STEPS, "checkpoint_minutes": 0.05},
        job_variables={
            "cheap_window_only": False,
            "min_node_count": 1,
            "env": {"PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3", "OMP_NUM_THREADS": "1"},
        },
    )
    run_id = run.id
    first = running_gang(stack, prefect, run_id)
    spare = (set(stack.nodes) - {a["node_id"] for a in first}).pop()
    reclaim(stack, spare)  # no third node: a gang that runs whole would wait here
    wait_for(lambda: max(logged_losses(prefect, run_id), default=0) >= 100, 120, "training", 0.2)
    reclaim(stack, first[1]["node_id"])

    acks = [acknowledgement(stack, a) for a in first]
    assert acks[0]["step"] == acks[1]["step"] and all(a["durable"] for a in acks), acks
    saved_at = acks[0]["step"]
    final = wait_for(lambda: the_end(prefect, run_id), 240, "the run's end")
    assert final.is_completed(), final
    allocations = all_ended(stack, prefect, run_id)
    second = [a for a in allocations if a["id"] > max(x["id"] for x in first)]
    # one node: rank 0 on the survivor, rank 1 parked (a gang gone smaller holds its first ranks)
    assert [(a["rank"], a["node_id"], a["status"]) for a in second] == [
        (0, first[0]["node_id"], "finished")
    ]
    names = [s.name for s in prefect.read_flow_run_states(run_id)]
    assert "Preempted" in names and names[-1] == "Completed", names
    logged = logged_losses(prefect, run_id)
    assert max(logged) == FSDP_STEPS
    for step, loss in logged.items():  # "step k" is the k-th step: losses[k - 1]
        reference = fsdp_uninterrupted[step - 1]
        if step - 1 <= saved_at:  # the two-rank part: the same curve
            assert loss == pytest.approx(reference, abs=1e-4), (step, loss, reference)
        else:  # one rank on the resharded state: the same batches, summed in another order
            assert loss == pytest.approx(reference, abs=2e-3), (step, loss, reference)
    curve = [
        (step, loss, round(fsdp_uninterrupted[step - 1], 4))
        for step, loss in sorted(logged.items())
    ]
    print("\n".join(["", f"saved at step {saved_at}; (step, resumed, uninterrupted): {curve}",
                     *timeline(stack, prefect, run_id, started)]))  # fmt: skip
