"""The spot-gpu worker's parts: the event fold, the cost report, the job it bids with, and the
work pool Prefect creates for it (``prefect work-pool create --type spot-gpu``, real server)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
from prefect.exceptions import InfrastructureNotFound

from conftest import one_database
from helpers import allocation, bid, bid_event
from prefect_spotgpu.blocks import CheckpointStorage
from prefect_spotgpu.worker import SpotGPUWorker
from prefect_spotgpu.worker.config import LAUNCH_COMMAND, SpotGPUJobConfiguration
from prefect_spotgpu.worker.reactions import Track
from prefect_spotgpu.worker.report import allocation_report


def ev(kind, alloc, node=1, **payload):
    return bid_event(kind, alloc, node=node, **payload)


def test_the_track_follows_a_reclaim_and_a_migration():
    track = Track()
    assert not track.apply(ev("allocated", 1))
    assert track.live == 1
    assert not track.apply(ev("reserved", 2, node=2))
    assert not track.apply(ev("noticed", 1, reason="reclaimed"))
    assert track.apply(ev("preempted", 1, reason="final save acknowledged"))
    assert track.live is None and track.preemptions == 1
    assert not track.apply(ev("allocated", 2, node=2, placement="promoted"))
    assert track.live == 2 and track.nodes == {1: 1, 2: 2}


def test_a_placement_reported_before_the_lost_allocations_end_waits_its_turn():
    # node lost: the same tick places the bid anew (event first) and ends the old allocation
    track = Track.from_events([ev("allocated", 1)])
    assert not track.apply(ev("allocated", 2, node=2))
    assert track.live == 1  # still the current one
    assert track.apply(ev("preempted", 1, reason="node lost"))
    assert track.live == 2


def test_a_failed_job_is_not_counted_as_a_preemption():
    track = Track.from_events(
        [ev("allocated", 1), ev("preempted", 1, reason="job failed on the node")]
    )
    assert track.preemptions == 0 and track.live is None


def test_the_cost_report_compares_spot_with_on_demand():
    five = bid(id=5, gpu_model="A100-80G", gpu_count=2, max_price=1.5, region="x")
    base = {"gpu_count": 2, "price": 1.0, "node_id": 1, "bid_id": 5}
    allocations = [
        # one hour on 2 GPUs at 1.0, preempted without a final save 600 s after its start
        allocation(1, **base, status="preempted", started_at=0.0, ended_at=3600.0,
                   charged_seconds=3600.0, charged_amount=2.0, last_checkpoint_at=3000.0),
        allocation(2, **base, status="finished", started_at=3700.0, ended_at=5500.0,
                   charged_seconds=1800.0, charged_amount=1.0),
        allocation(3, **base, status="released", started_at=0.0, ended_at=1.0),
    ]  # fmt: skip
    rows, summary = allocation_report(five, allocations)
    assert [r["allocation"] for r in rows] == [1, 2]
    assert rows[0]["cost"] == 2.0 and rows[0]["end"] == "1970-01-01T01:00:00+00:00"
    assert "| GPU-hours | 3.0000 |" in summary
    assert "| Cost paid | 3.000000 |" in summary
    assert "| On-demand cost | 6.300000 (at 2.10/GPU-h) |" in summary
    assert "| Saving | 52% |" in summary
    assert "| Preemptions | 1 |" in summary
    assert "| Work lost | 600.0 s" in summary
    assert summary.startswith("### GPU cost of bid 5\n")
    earlier = [a.model_copy(update={"bid_id": 4}) for a in allocations[:1]]  # replaced bid
    rows, summary = allocation_report(five, earlier + allocations[1:])
    assert [(r["bid"], r["allocation"]) for r in rows] == [(4, 1), (5, 2)]
    assert summary.startswith("### GPU cost of bids 4, 5\n")


def test_the_job_the_worker_bids_with(tmp_path):
    from prefect.client.schemas.objects import FlowRun

    flow_run = FlowRun(id=uuid.uuid4(), name="quiet-otter", flow_id=uuid.uuid4())
    config = SpotGPUJobConfiguration(
        checkpoint_storage=CheckpointStorage(path=str(tmp_path)), env={"EXTRA": "1"}
    )
    config.prepare_for_flow_run(flow_run)
    assert config.command == LAUNCH_COMMAND
    spec = config.job_spec().model_dump(exclude_none=True)  # as the bid carries it
    assert spec["command"] == ["python", "-m", "prefect_spotgpu.launch"]
    assert spec["env"]["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    assert spec["env"]["SPOTGPU_CHECKPOINT_URL"] == str(tmp_path)
    assert spec["env"]["EXTRA"] == "1"
    assert spec["checkpoint_url"] == str(tmp_path) and "image" not in spec
    # an explicit command and a catalog image are kept
    config = SpotGPUJobConfiguration(command="python train.py", image="pytorch")
    config.prepare_for_flow_run(flow_run)
    assert config.job_spec().command == ["python", "train.py"]
    assert config.job_spec("pytorch/pytorch:2.5.1").image == "pytorch/pytorch:2.5.1"


def test_kill_infrastructure_needs_a_bid_id():
    worker = SpotGPUWorker(work_pool_name="p")
    with pytest.raises(InfrastructureNotFound, match="not a spot-gpu bid"):
        asyncio.run(worker.kill_infrastructure("1234", SpotGPUJobConfiguration(), grace_seconds=1))


def test_the_run_needs_a_market_block():
    worker = SpotGPUWorker(work_pool_name="p")
    with pytest.raises(ValueError, match="no market: set the work pool's or deployment's"):
        asyncio.run(worker.run(None, SpotGPUJobConfiguration()))


def test_prefect_creates_a_complete_spot_gpu_pool(prefect_api_url):
    """``prefect work-pool create --type spot-gpu`` after ``pip install``: the entry point is
    found and the pool gets our base job template, every variable of the UI form included."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    name = f"cli-{uuid.uuid4().hex[:6]}"
    result = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", name, "--type", "spot-gpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(name)
    assert pool.type == "spot-gpu"
    expected = SpotGPUWorker.get_default_base_job_template()
    assert pool.base_job_template == expected
    form = pool.base_job_template["variables"]["properties"]
    for variable in (
        "gpu_model",
        "gpu_count",
        "max_price",
        "region",
        "image",
        "command",
        "env",
        "cheap_window_only",
        "deadline",
        "deadline_hours",
        "gpu_hours",
        "bidding_policy",
        "restart_minutes",
        "on_demand_fallback",
        "checkpoint_storage",
        "max_preemptions",
        "notice_webhook",
        "market",
    ):
        assert variable in form, variable


def test_a_cheap_window_run_resumes_when_the_next_window_opens():
    from datetime import UTC, datetime

    from prefect_spotgpu.worker.reactions import Settings, resume_time

    config = Settings.of(SpotGPUJobConfiguration(cheap_window_only=True, timezone="Europe/Berlin"))
    closing = datetime(2026, 12, 3, 7, 58, tzinfo=UTC)  # Thursday 08:58 in Berlin
    assert resume_time(closing, config) == datetime(2026, 12, 3, 17, 0, tzinfo=UTC)
    reclaimed_at_night = datetime(2026, 12, 2, 22, 0, tzinfo=UTC)  # the window stays open
    assert resume_time(reclaimed_at_night, config) == reclaimed_at_night
    anytime = Settings.of(SpotGPUJobConfiguration())
    assert resume_time(closing, anytime) == closing
    with pytest.raises(ValueError, match="unknown timezone"):
        SpotGPUJobConfiguration(timezone="Berlin")


def test_the_block_script_saves_what_the_deployments_use(prefect_api_url, tmp_path):
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "SPOTGPU_API_KEY"}
    env["PREFECT_API_URL"] = prefect_api_url
    script = [sys.executable, str(root / "blocks" / "save_blocks.py")]
    missing = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "--api-key-file" in missing.stderr
    (tmp_path / "key").write_text("sgk_test\n")
    saved = subprocess.run(
        [*script, "--api-key-file", str(tmp_path / "key"), "--checkpoints", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert saved.returncode == 0, saved.stderr
    from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket

    assert SpotMarket.load("spot-market").api_key.get_secret_value() == "sgk_test"
    assert CheckpointStorage.load("spot-checkpoints").url() == str(tmp_path)


def test_which_failures_the_worker_retries():
    import httpx

    from prefect_spotgpu.worker.market_api import MarketError, is_transient

    assert is_transient(httpx.ConnectError("refused"))
    assert is_transient(MarketError("busy", 503)) and is_transient(MarketError("slow", 429))
    assert not is_transient(MarketError("no such bid", 404))
    assert not is_transient(MarketError("bad input", 422))
    response = httpx.Response(500, request=httpx.Request("GET", "http://prefect/api"))
    assert is_transient(httpx.HTTPStatusError("boom", request=response.request, response=response))
    assert not is_transient(ValueError("a bug, not an outage"))


def test_the_launcher_waits_through_crashed_and_acknowledges_an_early_notice(
    prefect_api_url, tmp_path
):
    import json

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Crashed, Pending

    @flow(name="launcher-probe")
    def probe():
        return 1

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(probe)

        def launch(**env):
            return subprocess.run(
                [sys.executable, "-m", "prefect_spotgpu.launch"],
                env={**os.environ, "PREFECT_API_URL": prefect_api_url,
                     "PREFECT__FLOW_RUN_ID": str(run.id), "SPOTGPU_ALLOCATION_ID": "7",
                     "SPOTGPU_NOTICE_FILE": str(tmp_path / "notice.json"), **env},
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip

        client.set_flow_run_state(run.id, Crashed(), force=True)
        waited = launch(SPOTGPU_LAUNCH_TIMEOUT="2")  # a preempted run: wait for the worker
        assert waited.returncode == 3 and "no go from the worker" in waited.stderr
        (tmp_path / "notice.json").write_text("{}")
        noticed = launch()
        assert noticed.returncode == 0 and "notice before the flow run started" in noticed.stdout
        ack = json.loads((tmp_path / "notice.json.ack").read_text())
        assert ack["started"] is False and ack["step"] is None and ack["saved_at"] > 0
        (tmp_path / "notice.json").unlink()
        client.set_flow_run_state(run.id, Completed(), force=True)
        over = launch()
        assert over.returncode == 0 and "already Completed" in over.stdout
        # the go, for a flow that cannot be loaded ahead (no deployment): the engine loads it
        # again itself (exec) and fails the way it always has, saying why
        client.set_flow_run_state(run.id, Pending(name="Starting"), force=True)
        client.update_flow_run_labels(run.id, {"spotgpu.allocation": "7"})
        went = launch()
        assert "could not be loaded ahead" in went.stderr
        assert went.returncode != 0 and "go at" in went.stdout


@one_database("refused in the worker before any bid reaches the market")
def test_a_run_without_checkpoint_storage_is_refused_before_any_bid(service):
    """It would bid, start a billed job and fail on the node; now it fails at
    once, naming the variable, and the market never hears of it."""
    from prefect.client.schemas.objects import FlowRun
    from pydantic import SecretStr

    from prefect_spotgpu.blocks import SpotMarket

    buyer = service.tenant()
    key = buyer.headers["Authorization"].removeprefix("Bearer ")
    config = SpotGPUJobConfiguration(
        market=SpotMarket(url=service.base_url, api_key=SecretStr(key))
    )
    flow_run = FlowRun(id=uuid.uuid4(), name="no-storage", flow_id=uuid.uuid4())
    config.prepare_for_flow_run(flow_run)
    worker = SpotGPUWorker(work_pool_name="spot")
    with pytest.raises(ValueError, match="'checkpoint_storage' variable") as refused:
        asyncio.run(worker.run(flow_run, config))
    assert "spotgpu pool setup" in str(refused.value) and "nothing was bid" in str(refused.value)
    assert buyer.get("/bids").json() == []


@one_database("refused in the worker before any bid reaches the market")
def test_a_run_whose_image_is_not_in_the_catalogue_is_refused_with_the_list(
    service, tmp_path, prefect_api_url
):
    """The operator's catalogue is the list of what runs; an unknown name (or a
    reference the catalogue does not hold) fails the run before any bid, naming the images
    that exist. The market refuses such a bid too (test_images.py): this is the clear error."""
    from prefect.client.schemas.objects import FlowRun
    from pydantic import SecretStr

    from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket

    buyer = service.tenant()
    key = buyer.headers["Authorization"].removeprefix("Bearer ")
    config = SpotGPUJobConfiguration(
        market=SpotMarket(url=service.base_url, api_key=SecretStr(key)),
        checkpoint_storage=CheckpointStorage(path=str(tmp_path)),
        image="ghcr.io/attacker/miner:1",
    )
    flow_run = FlowRun(id=uuid.uuid4(), name="unknown-image", flow_id=uuid.uuid4())
    config.prepare_for_flow_run(flow_run)

    async def run():
        async with SpotGPUWorker(work_pool_name=f"spot-{uuid.uuid4().hex[:6]}") as worker:
            await worker.run(flow_run, config)

    with pytest.raises(ValueError, match="not in the market's image catalogue") as refused:
        asyncio.run(run())
    assert "known images: process, huggingface, ngc-pytorch, pytorch," in str(refused.value)
    assert buyer.get("/bids").json() == []


@one_database("refused in the worker before any bid reaches the market")
def test_a_run_naming_a_seeded_base_is_refused_naming_the_flow_ready_images(
    service, tmp_path, prefect_api_url
):
    """The seeded catalogue's bases hold no prefect-spotgpu: a flow run that picks one is
    refused before any bid, with the images that run flows (one the operator built) and the
    command that makes the base flow-ready."""
    from prefect.client.schemas.objects import FlowRun
    from pydantic import SecretStr

    from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket

    ready = {"reference": "registry.example.com/spotgpu/pytorch:2", "framework": "PyTorch"}
    assert service.admin.put("/images/pt-flows", json={**ready, "runs_flows": True}).is_success
    buyer = service.tenant()
    key = buyer.headers["Authorization"].removeprefix("Bearer ")
    config = SpotGPUJobConfiguration(
        market=SpotMarket(url=service.base_url, api_key=SecretStr(key)),
        checkpoint_storage=CheckpointStorage(path=str(tmp_path)),
        image="pytorch",
    )
    flow_run = FlowRun(id=uuid.uuid4(), name="command-only-image", flow_id=uuid.uuid4())
    config.prepare_for_flow_run(flow_run)

    async def run():
        async with SpotGPUWorker(work_pool_name=f"spot-{uuid.uuid4().hex[:6]}") as worker:
            await worker.run(flow_run, config)

    with pytest.raises(ValueError, match="runs only a job's own command, not a flow") as refused:
        asyncio.run(run())
    assert "Images that run flows: process, pt-flows." in str(refused.value)
    assert "spotgpu admin image build pytorch --wheelhouse DIR" in str(refused.value)
    assert buyer.get("/bids").json() == []


def test_the_worker_asks_for_scheduled_runs_every_second(monkeypatch):
    """Prefect's default (10 s) would make every start and resume wait up to 10 s. The
    end-to-end pickup test's margin is wide enough for a loaded machine, so the setting the
    worker's loop runs under is checked here (Prefect's loop itself is the seam replaced)."""
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS
    from prefect.workers.base import BaseWorker

    from prefect_spotgpu.worker.worker import QUERY_SECONDS

    seen = []

    async def prefects_loop(self, *args, **kwargs):
        seen.append(PREFECT_WORKER_QUERY_SECONDS.value())

    monkeypatch.setattr(BaseWorker, "start", prefects_loop)
    monkeypatch.delenv("PREFECT_WORKER_QUERY_SECONDS", raising=False)
    asyncio.run(SpotGPUWorker(work_pool_name="p").start())
    assert seen == [QUERY_SECONDS] and QUERY_SECONDS <= 1.0
    assert PREFECT_WORKER_QUERY_SECONDS.value() != QUERY_SECONDS  # only for the loop
