"""Fan-out exactly once (``prefect_spotgpu.fanout``): the pure rules; a
render queue of 96 frames over 6 spot runs on 4 real agents, served by a ``prefect worker start
--type spot-gpu`` process, with reclaims at random moments and one agent killed with SIGKILL,
whose every frame is stored once and is byte for byte the frame of one uninterrupted render;
and a cleaning job of 40 shards over 8 runs followed from the parent's own process, whose
report and clean shards are an uninterrupted run's."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from helpers import quote
from prefect_spotgpu.cli.stack import LocalStack, wait_for
from prefect_spotgpu.fanout import Shard, ShardStatus, cost_report, market_width, plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "flows"))

POOL = "spot-fanout"


# ---------------------------------------------------------------- the rules


def test_the_width_never_passes_the_cap_and_a_running_shard_is_never_given_twice():
    shards = [Shard(i, {}) for i in range(10)]
    first = plan(shards, cap=4, market_room=9, max_attempts=2)
    assert first.submit == (0, 1, 2, 3)
    for i in first.submit:
        shards[i].status, shards[i].attempts = ShardStatus.RUNNING, 1
    assert plan(shards, cap=4, market_room=9, max_attempts=2).submit == ()
    shards[2].status = ShardStatus.WAITING  # its child ended without a result
    again = plan(shards, cap=4, market_room=9, max_attempts=2)
    assert again.submit == (2,)  # taken again, first in line; the cap still holds
    shards[2].attempts = 2
    assert plan(shards, cap=4, market_room=9, max_attempts=2).failed == (2,)


def test_the_market_sets_the_width_but_work_always_moves():
    quotes = [
        quote("a", gpus_free=3, clearing_price=1.0, reserve_price=0.9),
        quote("b", capacity="on_demand", gpus_free=8, clearing_price=None, reserve_price=None),
        quote("a", gpu_model="H100-80G", gpus_free=8, clearing_price=2.0, reserve_price=2.0),
    ]
    assert market_width(quotes, gpu_model="A100-80G", region="any", max_price=1.2,
                        gpus_per_child=1) == 3  # fmt: skip
    assert market_width(quotes, gpu_model="A100-80G", region="any", max_price=0.95,
                        gpus_per_child=1) == 0  # fmt: skip
    shards = [Shard(i, {}) for i in range(3)]
    assert plan(shards, cap=8, market_room=0, max_attempts=1).submit == (0,)  # one waits
    assert cost_report([])["saving"] is None


def test_a_deadline_needs_the_shards_work_and_its_variables_are_checked():
    from datetime import UTC, datetime, timedelta

    from prefect_spotgpu import spot_gpu
    from prefect_spotgpu.fanout import fan_out

    @spot_gpu(work_pool="p")
    @flow(name="unit")
    def unit() -> None: ...

    soon = datetime.now(UTC) + timedelta(hours=1)
    with pytest.raises(ValueError, match="needs shard_gpu_hours"):
        fan_out(unit, [{}], deadline=soon)
    with pytest.raises(ValueError, match=r"gpu_hours .* cannot fit"):
        unit.with_options(job_variables={"gpu_hours": 5, "deadline_hours": 1})
    with pytest.raises(TypeError, match="decorated with @spot_gpu"):
        fan_out(flow(lambda: None), [{}])


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def stack(prefect_api_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("fanout")
    with LocalStack(home, prefect_api_url, heartbeat_timeout_seconds=3) as stack:
        stack.start_market()
        stack.nodes = {stack.start_agent(f"node-{c}"): f"node-{c}" for c in "abcd"}
        stack.create_pool(POOL, defaults={"gpu_count": 1, "max_price": 1.5})
        yield stack


class Trouble(threading.Thread):
    """Reclaims three nodes running children, at random moments as outputs appear (``at``:
    the stretches of stored outputs each one falls in), and kills one agent (and its jobs)
    with SIGKILL; every node comes back a moment later."""

    def __init__(self, stack, outputs: Path, pattern: str, at: list[int], seed: int) -> None:
        super().__init__(daemon=True)
        self.stack, self.outputs, self.pattern = stack, outputs, pattern
        self.at, self.rng = at, random.Random(seed)
        self.done = threading.Event()
        self.log: list[tuple[float, str, int]] = []

    def busy_nodes(self) -> list[int]:
        allocations = self.stack.market().get("/allocations?status=running").json()
        return sorted({a["node_id"] for a in allocations if a["status"] == "running"})

    def stored(self) -> int:
        return len(list(self.outputs.glob(self.pattern))) if self.outputs.exists() else 0

    def run(self) -> None:
        owner = self.stack.market(self.stack.owner_key)
        t0 = time.monotonic()
        plan = ["reclaim", "reclaim", "kill", "reclaim"]
        for what, (low, high) in zip(plan, self.at, strict=True):
            target = self.rng.randint(low, high)  # a random moment in this stretch of work
            while self.stored() < target and not self.done.is_set():
                time.sleep(0.05)
            nodes = self.busy_nodes()
            waited = time.monotonic() + 15  # children between attempts: wait for one to run
            while not nodes and not self.done.is_set() and time.monotonic() < waited:
                time.sleep(0.1)
                nodes = self.busy_nodes()
            if self.done.is_set() or not nodes:
                break
            node = self.rng.choice(nodes)
            name = self.stack.nodes[node]
            if what == "reclaim":
                owner.patch(f"/nodes/{node}", json={"state": "reclaimed"})
                self.log.append((round(time.monotonic() - t0, 2), what, node))
                time.sleep(1.5)
                owner.patch(f"/nodes/{node}", json={"state": "live"})
            else:
                jobs = self.stack.job_pids(name)
                self.stack.kill(f"agent-{name}")
                for pid in jobs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                self.log.append((round(time.monotonic() - t0, 2), what, node))
                time.sleep(4)  # past the heartbeat timeout: the node is lost
                self.stack.start_agent(name)


@pytest.mark.slow
def test_a_render_queue_fans_out_and_stores_every_frame_once_through_reclaims(stack, tmp_path):
    from render import animation, frame_name, png, render_frame
    from render_queue import render_queue

    from prefect_spotgpu.checkpoint.objects import LocalObjects

    frames, size = 96, (32, 24)
    out = "queue-e2e"
    buyer = stack.market(stack.buyer_key).get("/me").json()["id"]
    storage = stack.home / "node-checkpoints" / f"tenant-{buyer}"  # the pool's storage
    trouble = Trouble(
        stack, storage / "outputs" / out, "frame-*.png",
        at=[(10, 20), (26, 34), (40, 50), (56, 66)], seed=30,
    )  # fmt: skip

    @flow(name="parent")
    def parent() -> dict:
        return render_queue(
            out=out, frames=frames, per_child=16, width=size[0], height=size[1],
            work_pool=POOL, gpu_model="A100-80G", max_price=1.5, cap=6, pace_seconds=0.25,
        )  # fmt: skip

    stack.start_worker(POOL, name="pool-worker")  # the children go to the pool's worker
    trouble.start()
    started = time.monotonic()
    try:
        manifest = parent()
    finally:
        trouble.done.set()
        trouble.join(timeout=30)
        stack.kill("pool-worker", signal.SIGTERM)
    elapsed = time.monotonic() - started
    kinds = [what for _, what, _ in trouble.log]
    assert kinds.count("reclaim") >= 3 and kinds.count("kill") == 1, trouble.log

    store = LocalObjects(storage)
    names = [frame_name(f"outputs/{out}", i) for i in range(frames)]
    assert manifest["frames"] == names and manifest["shards"] == 6
    for index, name in enumerate(names):  # each frame once, the uninterrupted render's bytes
        assert store.get(name) == png(render_frame(index, frames, *size)), name
    assert store.names(f"outputs/{out}") == sorted([*names, f"outputs/{out}/animation.gif"])
    assert store.get(f"outputs/{out}/animation.gif") == animation(store, names)
    assert manifest["cost"]["preemptions"] >= 3
    assert manifest["cost"]["spot_cost"] < manifest["cost"]["on_demand_cost"]

    with get_client(sync_client=True) as client:
        children = [client.read_flow_run(run) for run in manifest["children"]]
        parent_run = children[0].parent_task_run_id and client.read_task_run(
            children[0].parent_task_run_id
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[parent_run.flow_run_id])
            )
        )
    assert all(c.state.is_completed() for c in children)
    assert {c.parent_task_run_id is not None for c in children} == {True}  # its subflows
    assert any(a.type == "progress" and a.data == 100.0 for a in artifacts)
    table = max((a for a in artifacts if a.type == "markdown"), key=lambda a: a.created)
    assert "| 6 | 6 | 0 | 0 | 0 |" in table.data
    print({"fan_out_seconds": round(elapsed, 1), "trouble": trouble.log, "cost": manifest["cost"]})


@pytest.mark.slow
def test_a_cleaning_job_fans_out_and_its_report_is_the_uninterrupted_runs(stack, tmp_path):
    from clean import clean, make_dataset
    from clean_fanout import clean_fanout

    from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped
    from prefect_spotgpu.checkpoint.objects import LocalObjects

    buyer = stack.market(stack.buyer_key).get("/me").json()["id"]
    storage = stack.home / "node-checkpoints" / f"tenant-{buyer}"
    store = LocalObjects(storage)
    planted = make_dataset(store, pairs=400, shards=40, seed=11, prefix="outputs/pairs")
    reference = tmp_path / "reference"  # one uninterrupted run, on this host
    whole = clean(
        Checkpointer(LocalStorage(tmp_path / "ckpt"), "ref", every=1e9),
        store, LocalObjects(reference), wait_to_be_stopped, source_prefix="outputs/pairs",
    )  # fmt: skip
    trouble = Trouble(
        stack, storage / "outputs" / "pairs-clean" / "signatures", "*.json",
        at=[(4, 8), (11, 15), (18, 23), (26, 31)], seed=31,
    )  # fmt: skip

    @flow(name="clean-parent")
    def parent() -> dict:
        return clean_fanout(
            source="pairs", out="pairs-clean", per_child=5, work_pool=POOL,
            gpu_model="A100-80G", max_price=1.5, cap=6, pace_seconds=0.6,
            pool_worker=False,  # each child followed from this process
        )  # fmt: skip

    trouble.start()
    try:
        manifest = parent()
    finally:
        trouble.done.set()
        trouble.join(timeout=30)
    kinds = [what for _, what, _ in trouble.log]
    assert kinds.count("reclaim") >= 3 and kinds.count("kill") == 1, trouble.log
    assert manifest["shards"] == 8 and manifest["report"] == whole
    assert whole["seen"] == 400 and whole["near_duplicate"] + whole["exact_duplicate"] > 0
    assert planted["near"] + planted["exact"] > 0
    for name in [f"shard-{i:05d}.jsonl" for i in range(40)] + ["report.json"]:
        assert store.get(f"outputs/pairs-clean/{name}") == (reference / name).read_bytes(), name
    assert len(store.names("outputs/pairs-clean/signatures")) == 40
    print({"clean_fan_out": trouble.log, "cost": manifest["cost"]})


def test_children_no_worker_takes_stop_the_fan_out_with_what_to_start(prefect_api_url, monkeypatch):
    """A child handed to the pool's worker that stays Scheduled with no worker of the pool
    alive ends the fan-out with the command to run (``NO_WORKER_SECONDS``, here 0), never a
    wait for ever."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Scheduled

    from prefect_spotgpu import decorators
    from prefect_spotgpu.fanout import _Unserved

    @flow(name="orphan-child")
    def orphan() -> None: ...

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="fanout-unserved", type="spot-gpu"))
        run = client.create_flow_run(orphan, state=Scheduled())
    monkeypatch.setattr(decorators, "NO_WORKER_SECONDS", 60.0)
    _Unserved("fanout-unserved").check(run.id, run.state, False)  # within the grace: wait
    monkeypatch.setattr(decorators, "NO_WORKER_SECONDS", 0.0)
    _Unserved("fanout-unserved").check(run.id, run.state, True)  # followed from here: fine
    with pytest.raises(RuntimeError, match="prefect worker start --pool fanout-unserved"):
        _Unserved("fanout-unserved").check(run.id, run.state, False)


@pytest.mark.slow
def test_the_first_hour_stack_reads_back_what_its_children_wrote(stack):
    """The first-hour page's set-up: the storage block names the agents' checkpoint root
    itself, where the nodes keep each tenant's files in ``tenant-<id>/``; the shipped render
    queue assembles its animation from the frames its children wrote there."""
    from render import animation, frame_name, png, render_frame
    from render_queue import render_queue

    from prefect_spotgpu.checkpoint.objects import NODE_ROOT_MARKER, LocalObjects

    root = stack.home / "node-checkpoints"
    assert (root / NODE_ROOT_MARKER).is_file()  # the agents marked their root
    stack.create_pool("spot-first-hour", checkpoint_dir=root,
                      defaults={"gpu_count": 1, "max_price": 1.5})  # fmt: skip

    @flow(name="first-hour-parent")
    def parent() -> dict:
        return render_queue(
            out="rq1", frames=4, per_child=2, width=16, height=12, work_pool="spot-first-hour",
            gpu_model="A100-80G", max_price=1.5, cap=2, pool_worker=False,
        )  # fmt: skip

    manifest = parent()
    buyer = stack.market(stack.buyer_key).get("/me").json()["id"]
    mine = LocalObjects(root / f"tenant-{buyer}")
    names = [frame_name("outputs/rq1", i) for i in range(4)]
    assert manifest["frames"] == names
    assert [mine.get(n) for n in names] == [png(render_frame(i, 4, 16, 12)) for i in range(4)]
    assert mine.get("outputs/rq1/animation.gif") == animation(mine, names)
    assert not (root / "outputs").exists()  # nothing of the tenant's lands in the root


@pytest.mark.slow
def test_a_child_has_one_follower_when_the_caller_and_the_pools_worker_are_both_alive(stack):
    """Children followed from the caller while the pool's worker runs, with a reclaim among
    them (their rescheduled runs are there for either worker to take): the fan-out returns,
    every child completed, and each child had exactly one bid — none placed again for a run
    another worker had taken or completed. Two fan-outs in a row (without the follower's
    label and heartbeat, the first hung: the pool's worker adopted its children)."""
    from fanout_children import square
    from prefect_spotgpu import spot_gpu
    from prefect_spotgpu.fanout import fan_out
    from prefect_spotgpu.protocol import LABELS

    child = spot_gpu(work_pool=POOL, gpu_model="A100-80G", max_price=1.5)(square)

    # the pool's worker looks for runs to adopt at each heartbeat: every 2 s here
    worker = stack.start_worker(POOL, name="rival-worker",
                                env={"PREFECT_WORKER_HEARTBEAT_SECONDS": "2"})  # fmt: skip
    owner, buyer = stack.market(stack.owner_key), stack.market(stack.buyer_key)

    def reclaim_one(reclaimed: threading.Event, over: threading.Event) -> None:
        """Reclaim the first node a child runs on, whenever in the round that is (a loaded
        machine may take a minute to start the first child)."""
        while not over.is_set() and not reclaimed.is_set():
            running = buyer.get("/allocations?status=running").json()
            running = [a for a in running if a["status"] == "running"]
            if running:
                node = running[0]["node_id"]
                owner.patch(f"/nodes/{node}", json={"state": "reclaimed"})
                time.sleep(1.0)
                owner.patch(f"/nodes/{node}", json={"state": "live"})
                reclaimed.set()
            time.sleep(0.1)

    @flow(name="one-follower-parent")
    def parent() -> dict:
        return fan_out(child, [{"index": i} for i in range(6)], cap=4,
                       pool_worker=False, poll_seconds=0.2)  # fmt: skip

    try:
        for round_ in range(2):
            reclaimed, over = threading.Event(), threading.Event()
            trouble = threading.Thread(target=reclaim_one, args=(reclaimed, over), daemon=True)
            trouble.start()
            started = time.monotonic()
            try:
                manifest = parent()
            finally:
                over.set()
            trouble.join(timeout=5)
            assert manifest["results"] == [i * i for i in range(6)], round_
            assert manifest["attempts"] == 6  # no shard given to a second child
            assert time.monotonic() - started < 240
            bids = buyer.get("/bids", params={"limit": 1000}).json()
            for run_id in manifest["children"]:
                mine = [b for b in bids if (b.get("labels") or {}).get(LABELS.FLOW_RUN) == run_id]
                assert len(mine) == 1, (round_, run_id, mine)
            assert reclaimed.is_set(), round_
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)


@pytest.mark.slow
def test_a_fan_out_that_fails_stops_paying_for_its_other_children(stack):
    """A shard whose child fails ``max_attempts`` times fails the fan-out, naming it; the
    children still running are cancelled, bids and flow runs, instead of running on unpaid
    for by anyone's interest."""
    from fanout_children import slow_or_failing
    from prefect_spotgpu import spot_gpu
    from prefect_spotgpu.fanout import fan_out
    from prefect_spotgpu.protocol import LABELS

    child = spot_gpu(work_pool=POOL, gpu_model="A100-80G", max_price=1.5)(slow_or_failing)
    seen: dict = {}

    @flow(name="failing-parent")
    def parent() -> dict:
        return fan_out(child, [{"index": i, "fail": i == 0} for i in range(3)], cap=3,
                       max_attempts=1, pool_worker=False, poll_seconds=0.2,
                       on_progress=seen.update)  # fmt: skip

    with pytest.raises(RuntimeError, match=r"shard\(s\) 0 \(Failed: .*ended without a result 1"):
        parent()
    assert seen["running"] == 2  # the two slow children were running when it failed
    buyer = stack.market(stack.buyer_key)
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs() if r.name and r.flow_id]
        slow = [r for r in runs if r.parameters.get("fail") is False
                and r.parameters.get("index") in (1, 2)]  # fmt: skip
    # Cancelled, or Crashed by the stop's SIGTERM when the engine reported it after the
    # cancel (a race left for planning): either way over, and no bid of theirs open (below)
    over = [r.state.is_cancelled() or r.state.is_crashed() for r in slow]
    assert len(slow) == 2 and all(over), [r.state for r in slow]
    for run in slow:  # a child cancelled before its worker bid has no bid to cancel
        if LABELS.BID in run.labels:
            bid = buyer.get(f"/bids/{run.labels[LABELS.BID]}").json()
            assert bid["status"] == "cancelled", bid

    def open_bids() -> list[dict]:
        return [b for b in buyer.get("/bids", params={"limit": 1000}).json()
                if b["status"] in ("open", "held")
                and b["labels"].get(LABELS.FLOW_RUN) in {str(r.id) for r in slow}]  # fmt: skip

    # A worker that placed a child's bid as the child was cancelled (the cancel found no bid
    # label yet) cancels that bid itself, at its next look at the run: within seconds.
    try:
        wait_for(lambda: not open_bids(), 30, "no open bid of a cancelled child")
    except TimeoutError:
        raise AssertionError(open_bids()) from None


def test_a_price_no_node_accepts_fails_the_fan_out_before_any_child(stack):
    """Children whose bids would wait for ever are refused up front, naming the lowest price
    the market's nodes ask and what to change; no child run is made."""
    from fanout_children import square
    from prefect_spotgpu import spot_gpu
    from prefect_spotgpu.fanout import fan_out

    cheap = spot_gpu(work_pool=POOL, gpu_model="A100-80G", max_price=0.2)(square)
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
    with pytest.raises(ValueError, match=r"lowest price offered is 0\.9 .*max_price="):
        fan_out(cheap, [{"index": 1}])
    with get_client(sync_client=True) as client:
        assert len(client.read_flow_runs()) == before
