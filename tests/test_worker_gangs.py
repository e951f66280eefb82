"""The spot-gpu worker's side of gang bids (docs/users/gangs.md): the ``node_count`` variable and
the bid it reaches, the rules that follow a gang through rank 0's allocation, the allocation
table of every member, and the launcher of a rank > 0 member, which runs the flow's function
without the engine (real Prefect server, real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from conftest import wait_for
from helpers import allocation, bid, bid_event
from prefect_spotgpu.worker import SpotGPUWorker
from prefect_spotgpu.worker.attempt import gang_lead
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration
from prefect_spotgpu.worker.placement import Placement
from prefect_spotgpu.worker.reactions import (
    CancelBid,
    Facts,
    Go,
    Nothing,
    Phase,
    Reschedule,
    RunView,
    Settings,
    Track,
    react,
)
from prefect_spotgpu.worker.report import allocation_report, describe, lead_allocations

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize("bad", [0, 65, True])
def test_node_count_is_1_to_64_and_named_when_refused(bad):
    with pytest.raises(ValidationError, match="node_count"):
        SpotGPUJobConfiguration(node_count=bad)
    assert SpotGPUJobConfiguration(node_count=2).node_count == 2
    assert SpotGPUJobConfiguration().node_count == 1


def test_the_pool_form_has_node_count_and_the_job_configuration_templates_it():
    template = SpotGPUWorker.get_default_base_job_template()
    field = template["variables"]["properties"]["node_count"]
    assert field["default"] == 1 and field["minimum"] == 1 and field["maximum"] == 64
    assert template["job_configuration"]["node_count"] == "{{ node_count }}"


def test_the_bid_carries_node_count():
    from prefect.client.schemas.objects import FlowRun

    flow_run = FlowRun(id=uuid.uuid4(), name="gang-otter", flow_id=uuid.uuid4())
    for nodes in (1, 2):
        config = SpotGPUJobConfiguration(node_count=nodes, gpu_count=4)
        config.prepare_for_flow_run(flow_run)
        run = SimpleNamespace(flow_run=flow_run, logger=None)
        placement = Placement(market=None, run=run, configuration=config, pool_name="p")
        body = placement.bid_body().body()  # (as sent)
        assert body["node_count"] == nodes and body["gpu_count"] == 4
        assert "min_node_count" not in body  # whole, always: the default (and an older
        # market, whose bids forbid unknown fields, still takes the bid)
    config = SpotGPUJobConfiguration(node_count=3, min_node_count=2)
    config.prepare_for_flow_run(flow_run)
    run = SimpleNamespace(flow_run=flow_run, logger=None)
    body = Placement(market=None, run=run, configuration=config, pool_name="p").bid_body()
    assert (body.node_count, body.min_node_count) == (3, 2)


@pytest.mark.parametrize("bad", [0, 3, True, "1"])
def test_min_node_count_is_within_the_gang_and_named_when_refused(bad):
    with pytest.raises(ValidationError, match="min_node_count"):
        SpotGPUJobConfiguration(node_count=2, min_node_count=bad)
    template = SpotGPUWorker.get_default_base_job_template()
    assert template["job_configuration"]["min_node_count"] == "{{ min_node_count }}"
    assert template["variables"]["properties"]["min_node_count"]["title"] == "Fewest nodes"


def test_a_gang_that_may_shrink_says_so_in_words():
    shrinks = GANG.model_copy(update={"node_count": 4, "min_node_count": 2})
    assert "4 nodes of 1 x A100-80G (going on with 2 or more)" in describe(shrinks)


def ev(kind, alloc, bid, node=1, **payload):
    return bid_event(kind, alloc, bid=bid, node=node, **payload)


GANG = bid(id=10, node_count=2, members=[10, 11], gpu_count=1, gpu_model="A100-80G",
           region="eu-west", max_price=1.5)  # fmt: skip


def test_a_gang_is_followed_through_rank_0s_bid():
    assert gang_lead(GANG) == 10 and gang_lead(bid(id=7, node_count=1)) is None
    assert gang_lead(bid(id=7)) is None  # a market without gangs: no node_count, one node
    settings, track = Settings(max_preemptions=3), Track(gang_lead(GANG))
    events = [ev("allocated", 100, 10), ev("allocated", 101, 11, node=2)]
    reactions = [react(e, track.apply(e), track, settings, NOW) for e in events]
    assert isinstance(reactions[0], Go) and reactions[0].allocation_id == 100
    assert isinstance(reactions[1], Nothing) and "node 2 started" in reactions[1].log[1]
    assert track.live == 100 and track.members == {101}
    # one notice to the gang, both preempted: one preemption, one reschedule
    member_end = ev("preempted", 101, 11, node=2, reason="final save acknowledged")
    assert isinstance(react(member_end, track.apply(member_end), track, settings, NOW), Nothing)
    lead_end = ev("preempted", 100, 10, reason="final save acknowledged")
    assert isinstance(react(lead_end, track.apply(lead_end), track, settings, NOW), Reschedule)
    assert track.preemptions == 1 and track.live is None
    replay = Track.from_events([*events, member_end, lead_end], lead=10)
    assert replay.preemptions == 1


def test_a_members_failed_job_ends_the_gang_as_a_failed_job():
    settings = Settings(max_preemptions=3)
    track = Track.from_events([ev("allocated", 100, 10), ev("allocated", 101, 11, node=2)], 10)
    failed = ev("preempted", 101, 11, node=2, reason="job failed on the node", detail="exit 1")
    reaction = react(failed, track.apply(failed), track, settings, NOW)
    assert isinstance(reaction, Nothing) and "failed: exit 1" in reaction.log[1]
    cascade = ev("preempted", 100, 10, reason="gang member ended")
    ended = track.apply(cascade)
    assert react(cascade, ended, track, settings, NOW).what == "run"
    crashed = Facts(run=RunView(Phase.CRASHED, "Crashed"))
    assert isinstance(react(cascade, ended, track, settings, NOW, crashed), CancelBid)
    assert track.preemptions == 0  # a failed job is not a preemption
    # without a member's failure, the same end is a preemption: resume from the checkpoint
    track = Track.from_events([ev("allocated", 100, 10), ev("allocated", 101, 11, node=2)], 10)
    lost = ev("preempted", 101, 11, node=2, reason="node lost")
    track.apply(lost)
    assert isinstance(react(cascade, track.apply(cascade), track, settings, NOW), Reschedule)


def test_the_allocation_table_lists_every_member():
    base = {"gpu_count": 1, "price": 1.1, "started_at": 0.0, "ended_at": 3600.0,
            "charged_seconds": 3600.0, "charged_amount": 1.1, "final_save": "ok",
            "last_checkpoint_at": None, "status": "finished"}  # fmt: skip
    allocations = [
        allocation(**{**base, "id": 101, "bid_id": 11, "rank": 1, "node_id": 2, "price": 1.2}),
        allocation(**{**base, "id": 100, "bid_id": 10, "rank": 0, "node_id": 1}),
    ]
    rows, summary = allocation_report(GANG, allocations)
    assert [(r["rank"], r["node"], r["status"], r["price"]) for r in rows] == [
        (0, 1, "finished", 1.1),
        (1, 2, "finished", 1.2),
    ]
    assert "| GPU-hours | 2.0000 |" in summary  # both nodes' GPUs
    assert "2 nodes of 1 x A100-80G" in describe(GANG)
    assert [a.id for a in lead_allocations(allocations)] == [100]  # progress: rank 0's
    one_node = [allocation(**{**base, "id": 5, "bid_id": 3, "node_id": 1})]
    rows, _ = allocation_report(GANG.model_copy(update={"id": 3, "node_count": 1}), one_node)
    assert "rank" not in rows[0]


FLOW = """
import asyncio, json, os
from prefect import flow


@flow(name="gang-probe")
def gang_probe(out: str, steps: int = 1):
    if steps < 0:
        raise ValueError("no steps")
    with open(out, "w") as f:
        json.dump({"rank": os.environ["RANK"], "steps": steps}, f)
    return steps


@flow(name="gang-probe-async")
async def gang_probe_async(out: str, steps: int = 1):
    await asyncio.sleep(0)
    with open(out, "w") as f:
        json.dump({"rank": os.environ["RANK"], "steps": steps, "async": True}, f)
    return steps
"""


def test_rank_1_runs_the_flow_function_and_leaves_the_run_to_rank_0(prefect_api_url, tmp_path):
    """Its go is rank 0's allocation of this attempt (not a Running state left by an attempt
    before); it runs the function, sync or async, then waits for rank 0's engine to end the
    run (or a notice) before it exits; a raising function exits 1 at once."""
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending, Running

    from prefect_spotgpu.protocol import JOB_ENV, LABELS

    code = tmp_path / "code"
    code.mkdir()
    (code / "gang_flow.py").write_text(textwrap.dedent(FLOW))
    out = tmp_path / "rank1.json"
    notice = tmp_path / "notice.json"
    with get_client(sync_client=True) as client:

        def deploy(name: str) -> uuid.UUID:
            return client.create_deployment(
                flow_id=client.create_flow_from_name(name.replace("_", "-")),
                name=f"gang-{uuid.uuid4().hex[:6]}",
                entrypoint=f"gang_flow.py:{name}",
                path=str(code),
                pull_steps=[
                    {"prefect.deployments.steps.set_working_directory": {"directory": str(code)}}
                ],
            )

        def launch(run, **env) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "prefect_spotgpu.launch"],
                env={**os.environ, "PREFECT_API_URL": prefect_api_url,
                     "PREFECT__FLOW_RUN_ID": str(run.id), "SPOTGPU_ALLOCATION_ID": "101",
                     JOB_ENV.NOTICE_FILE: str(notice), "RANK": "1", "WORLD_SIZE": "2",
                     JOB_ENV.GANG_LEAD_ALLOCATION: "100", **env},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            )  # fmt: skip

        def ended(process: subprocess.Popen) -> tuple[int, str]:
            stdout, stderr = process.communicate(timeout=120)
            return process.returncode, stdout + stderr

        def handed(run, allocation: str, state) -> None:
            client.update_flow_run_labels(run.id, {LABELS.ALLOCATION: allocation})
            client.set_flow_run_state(run.id, state, force=True)

        deployment = deploy("gang_probe")
        run = client.create_flow_run_from_deployment(
            deployment, parameters={"out": str(out), "steps": 3}
        )
        assert ended(launch(run, SPOTGPU_LAUNCH_TIMEOUT="2"))[0] == 3  # Scheduled: no go
        handed(run, "99", Running())  # the attempt before's rank 0, still Running
        code_, output = ended(launch(run, SPOTGPU_LAUNCH_TIMEOUT="2"))
        assert code_ == 3 and not out.exists(), output

        handed(run, "100", Pending(name="Starting"))  # this attempt's rank 0
        member = launch(run)
        wait_for(out.exists, 60, "rank 1's function ran")
        assert json.loads(out.read_text()) == {"rank": "1", "steps": 3}
        with pytest.raises(subprocess.TimeoutExpired):  # it waits for the run's end
            member.wait(timeout=1.0)
        after = client.read_flow_run(run.id)
        assert after.state.is_pending() and after.state.name == "Starting"  # rank 0's to move
        assert after.run_count == 1  # (the attempt before's Running): rank 1 ran no engine
        client.set_flow_run_state(run.id, Completed(), force=True)  # rank 0's engine
        code_, output = ended(member)
        assert code_ == 0 and "waiting for the flow run's end" in output, output

        run = client.create_flow_run_from_deployment(
            deploy("gang_probe_async"), parameters={"out": str(out), "steps": 4}
        )
        handed(run, "100", Running())
        member = launch(run)
        wait_for(lambda: json.loads(out.read_text()).get("async"), 60, "the async function")
        assert json.loads(out.read_text()) == {"rank": "1", "steps": 4, "async": True}
        notice.write_text("{}")  # a notice while it waits: acknowledged at once
        code_, output = ended(member)
        assert code_ == 0 and (tmp_path / "notice.json.ack").exists(), output
        notice.unlink()

        failing = client.create_flow_run_from_deployment(
            deployment, parameters={"out": str(tmp_path / "never.json"), "steps": -1}
        )
        handed(failing, "100", Pending(name="Starting"))
        code_, output = ended(launch(failing))
        assert code_ == 1 and "no steps" in output, output
        assert client.read_flow_run(failing.id).state.name == "Starting"
