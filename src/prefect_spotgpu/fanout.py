"""Fan-out: a parent flow spreads work over many spot runs, each shard exactly once.

    from prefect_spotgpu.fanout import fan_out

    @flow
    def render_queue(out: str, frames: int = 96):
        shards = [{"out": out, "first": i, "stop": min(i + 16, frames), "frames": frames}
                  for i in range(0, frames, 16)]
        return fan_out(render_frames, shards, cap=8)   # render_frames: a @spot_gpu flow

How it holds (docs/operators/architecture.md, "How users reach it"):

- **One owner per shard.** The parent keeps the assignment: a shard is given to one child run
  at a time, and given again only when that run is over without its result (Failed, or
  Crashed and not resumed). Children write each output with ``put_new`` into the run's
  storage (``checkpoint.objects``), so even two attempts racing on one output store it once.
- **Preemptions are the children's own.** A reclaimed child resumes on another node (its
  worker follows it) and continues from what its storage already holds; the parent waits.
- **Width follows the market.** At most ``cap`` children run at once, and no more than the
  market can place: the GPUs free at or below the children's maximum price in every region
  (``GET /prices``), plus those the running children hold. Waiting shards are not failures.
- **Prefect shows it.** The children are the parent's subflows; the parent's run page has a
  progress artifact and a table (shards done / running / waiting, preemptions, cost so far),
  and its result is the manifest: every shard's outputs, the cost against on-demand.

The rules are pure (:func:`plan`, :func:`market_width`); :func:`fan_out` is the thin shell that
submits, follows and reports.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from prefect_spotgpu.child_runs import Children
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.messages import AllocationResponse, BidResponse, QuoteResponse
from prefect_spotgpu.protocol import Capacity

logger = logging.getLogger("prefect_spotgpu.fanout")


class ShardStatus(StrEnum):
    WAITING = "waiting"
    """Not given to any child (yet, or again after a child ended without its result)."""
    RUNNING = "running"
    """Given to one child run, which is not over (it may be preempted and resuming)."""
    DONE = "done"
    """Its child run completed: its outputs are in storage."""
    FAILED = "failed"
    """Its children ended without a result ``max_attempts`` times: the fan-out fails."""


@dataclass
class Shard:
    index: int
    params: dict
    status: ShardStatus = ShardStatus.WAITING
    attempts: int = 0
    run_id: Any = None
    result: Any = None
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    submit: tuple[int, ...]
    """Shards to give to new child runs now, in order."""
    failed: tuple[int, ...] = ()


def market_width(
    quotes: list[QuoteResponse],
    *,
    gpu_model: str,
    region: str,
    max_price: float,
    gpus_per_child: int,
) -> int:
    """How many more children the market can place now: the GPUs free in the model's spot
    pools (every region, or ``region``) whose price is at or below ``max_price``, in whole
    children.

    >>> pool = dict(gpu_model="A100-80G", capacity="spot", reserve_price=0.9,
    ...             on_demand_price=2.1, gpus_total=8, gpus_running=0, waiting_bids=0)
    >>> q = [QuoteResponse(**pool, region="eu", gpus_free=5, clearing_price=0.9),
    ...      QuoteResponse(**pool, region="us", gpus_free=4, clearing_price=2.0)]
    >>> market_width(q, gpu_model="A100-80G", region="any", max_price=1.2, gpus_per_child=2)
    2
    """
    free = 0
    for q in quotes:
        if q.gpu_model != gpu_model or q.capacity != Capacity.SPOT:
            continue
        if region not in ("any", q.region):
            continue
        price = q.clearing_price or q.reserve_price or 0.0
        if price <= max_price:
            free += q.gpus_free
    return free // max(1, gpus_per_child)


def check_terms(
    quotes: list[QuoteResponse], *, gpu_model: str, region: str, max_price: float
) -> str | None:
    """Why no node of the market would take a bid of these terms (None: some would): the
    model has no spot pool (in the region), or every pool asks more than ``max_price`` (the
    message says the lowest price offered).

    >>> pool = dict(gpu_model="A100-80G", capacity="spot", on_demand_price=2.1, gpus_total=8,
    ...             gpus_running=0, waiting_bids=0, gpus_free=8, clearing_price=None)
    >>> q = [QuoteResponse(**pool, region="eu", reserve_price=0.9)]
    >>> check_terms(q, gpu_model="A100-80G", region="any", max_price=0.5)
    'max_price 0.5 is below every A100-80G node: the lowest price offered is 0.9 per GPU-hour'
    >>> check_terms(q, gpu_model="A100-80G", region="us", max_price=2.0)
    "no A100-80G spot node in region 'us' (regions with one: eu)"
    """
    pools = [q for q in quotes if q.gpu_model == gpu_model and q.capacity == Capacity.SPOT]
    if not pools:
        return f"no spot node of {gpu_model} on this market"
    chosen = [q for q in pools if region in ("any", q.region)]
    if not chosen:
        regions = ", ".join(sorted({q.region for q in pools}))
        return f"no {gpu_model} spot node in region {region!r} (regions with one: {regions})"
    lowest = min(q.reserve_price or 0.0 for q in chosen)
    if lowest > max_price:
        return (
            f"max_price {max_price:g} is below every {gpu_model} node: the lowest price "
            f"offered is {lowest:g} per GPU-hour"
        )
    return None


def deadline_width(*, remaining: int, shard_seconds: float, seconds_left: float) -> int:
    """How many children must run at once for ``remaining`` shards of ``shard_seconds`` each
    to finish in ``seconds_left`` (all of them at once when no time is left).

    >>> deadline_width(remaining=10, shard_seconds=600, seconds_left=1800)
    4
    >>> deadline_width(remaining=3, shard_seconds=600, seconds_left=0)
    3
    """
    if seconds_left <= 0:
        return remaining
    return min(remaining, math.ceil(remaining * shard_seconds / seconds_left))


def plan(shards: Sequence[Shard], *, cap: int, market_room: int, max_attempts: int) -> Plan:
    """Which waiting shards to submit: while fewer than ``cap`` run and the market has room
    (at least one child, so the work always moves: a child waits for capacity, it never
    fails for want of it); and which shards have failed for good.

    >>> s = [Shard(0, {}), Shard(1, {}, ShardStatus.RUNNING), Shard(2, {}), Shard(3, {})]
    >>> plan(s, cap=3, market_room=5, max_attempts=3)
    Plan(submit=(0, 2), failed=())
    >>> plan(s, cap=8, market_room=0, max_attempts=3)
    Plan(submit=(), failed=())
    >>> plan([Shard(0, {}, attempts=3)], cap=1, market_room=1, max_attempts=3)
    Plan(submit=(), failed=(0,))
    """
    failed = tuple(
        s.index for s in shards if s.status is ShardStatus.WAITING and s.attempts >= max_attempts
    )
    running = sum(s.status is ShardStatus.RUNNING for s in shards)
    room = min(cap - running, market_room if running else max(market_room, 1))
    waiting = [
        s.index for s in shards if s.status is ShardStatus.WAITING and s.attempts < max_attempts
    ]
    return Plan(submit=tuple(waiting[: max(0, room)]), failed=failed)


def summary(shards: Sequence[Shard]) -> dict[str, int]:
    counts = {status.value: 0 for status in ShardStatus}
    for s in shards:
        counts[s.status.value] += 1
    return counts


def cost_report(bids: list[tuple[BidResponse, list[AllocationResponse]]]) -> dict:
    """Spot cost of the children's bids against the same GPU-hours on demand (money in the
    market's units), and their preemptions."""
    from prefect_spotgpu.worker.report import bid_costs

    costs = [bid_costs(bid, allocations) for bid, allocations in bids]
    spot = sum(c.spot_cost for c in costs)
    on_demand = sum(c.on_demand_cost for c in costs)
    return {
        "gpu_hours": round(sum(c.gpu_hours for c in costs), 6),
        "spot_cost": round(spot, 6),
        "on_demand_cost": round(on_demand, 6),
        "saving": round(1 - spot / on_demand, 4) if on_demand > 0 else None,
        "preemptions": sum(c.preemptions for c in costs),
    }


# ---------------------------------------------------------------- the shell


def fan_out(
    child,
    params: Sequence[dict],
    *,
    cap: int = 8,
    max_attempts: int = 3,
    poll_seconds: float = 1.0,
    on_progress: Callable[[dict], None] | None = None,
    deadline: datetime | None = None,
    shard_gpu_hours: float | None = None,
    pool_worker: bool | None = None,
) -> dict:
    """Run ``child`` (a ``@spot_gpu`` flow) once per item of ``params`` (its keyword
    arguments), at most ``cap`` at a time and no wider than the market (module doc); the
    manifest: each shard's result in order, the counts, and the cost against on-demand.
    Raises RuntimeError naming the shards whose children failed ``max_attempts`` times.

    With a ``deadline`` (and ``shard_gpu_hours``, a shard's GPU work), the width is at least
    what finishes the rest in time (:func:`deadline_width`, still within ``cap``): children
    beyond what the market offers at their price wait for GPUs, and each child carries the
    deadline and its work to its worker's ``deadline-aware`` policy, which bids up when it
    falls behind and moves to on-demand capacity only when spot can no longer make it.

    The children share one bundle and are created concurrently (``child_runs``).
    ``pool_worker``: hand them to the pool's running worker (created Scheduled: it takes them
    and places their bids together), or follow them from one spot-gpu worker in this process
    (created Pending: the pool's worker never takes them, and adopts one only if this process
    dies); by default the pool's worker when one is alive."""
    from prefect_spotgpu.decorators import SpotGPUFlow

    if not isinstance(child, SpotGPUFlow):
        raise TypeError("fan_out's child must be a flow decorated with @spot_gpu")
    if deadline is not None:
        if shard_gpu_hours is None:
            raise ValueError("a fan-out with a deadline needs shard_gpu_hours (a shard's work)")
        child = child.with_options(
            job_variables={
                **child.job_variables,
                "deadline": deadline.isoformat(),
                "gpu_hours": shard_gpu_hours,
                "bidding_policy": "deadline-aware",
            }
        )
    shards = [Shard(i, dict(p)) for i, p in enumerate(params)]
    market = _Market(child)
    if deadline is None:  # a deadline's policy may raise the price, or go on-demand
        market.check()
    if pool_worker is None:
        pool_worker = bool(_live_workers(child.work_pool))
    report = _Progress(len(shards))
    unserved = _Unserved(child.work_pool)
    crashed_since: dict[Any, float] = {}
    costs, costs_at = cost_report([]), 0.0
    started = time.monotonic()
    try:
        with Children(child, to_pool=pool_worker) as children:
            while any(s.status in (ShardStatus.WAITING, ShardStatus.RUNNING) for s in shards):
                room = market.room()
                if deadline is not None:
                    room = max(room, _needed(shards, deadline, shard_gpu_hours))
                decided = plan(shards, cap=cap, market_room=room, max_attempts=max_attempts)
                if decided.failed:
                    raise RuntimeError(
                        "fan-out failed: shard(s) "
                        + ", ".join(f"{i} ({shards[i].errors[-1]})" for i in decided.failed)
                        + f" ended without a result {max_attempts} times"
                    )
                created = children.create([shards[i].params for i in decided.submit])
                for index, run_id in zip(decided.submit, created, strict=True):
                    shard = shards[index]
                    shard.attempts += 1
                    if isinstance(run_id, Exception):  # not made: the shard waits for another
                        shard.errors.append(f"not created: {type(run_id).__name__}: {run_id}")
                    else:
                        shard.status, shard.run_id = ShardStatus.RUNNING, run_id
                _settle(shards, children, unserved, crashed_since, child)
                counts = summary(shards)
                if time.monotonic() - costs_at >= COST_SECONDS:  # a few calls per child
                    costs, costs_at = market.costs(shards), time.monotonic()
                report.show(counts, costs)
                if on_progress is not None:
                    on_progress(counts)
                if any(s.status is ShardStatus.RUNNING for s in shards):
                    time.sleep(poll_seconds)
            bundle = children.bundle
    except BaseException as exc:  # Ctrl-C, or a shard failed for good: stop paying
        # (once this process follows none of them: ``Children`` has closed)
        _stop_children(child, shards, f"its fan-out stopped: {type(exc).__name__}: {exc}")
        raise
    costs = market.costs(shards)
    report.show(summary(shards), costs, final=True)
    return {
        "shards": len(shards),
        "results": [s.result for s in shards],
        "children": [str(s.run_id) for s in shards],
        "attempts": sum(s.attempts for s in shards),
        "seconds": round(time.monotonic() - started, 2),
        "bundle": bundle.key,
        "cost": costs,
    }


def _stop_children(child, shards: Sequence[Shard], message: str) -> None:
    """Cancel the bids and flow runs of the children still running (their stored outputs
    stay), a few at a time; one that cannot be cancelled is logged, not raised."""
    from concurrent.futures import ThreadPoolExecutor

    from prefect_spotgpu.decorators import cancel_run

    running = [s.run_id for s in shards if s.status is ShardStatus.RUNNING]

    def stop(run_id) -> None:
        try:
            cancel_run(child, run_id, message)
        except Exception as exc:
            logger.warning("could not cancel child flow run %s: %s", run_id, exc)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(stop, running))


def _settle(shards: Sequence[Shard], children, unserved, crashed_since: dict, child) -> None:
    """Read the running children's states (in bulk) and close the shards whose child is over:
    done with its result, or waiting again when it ended without one. A Crashed child is
    over only once it stayed Crashed ``CRASH_SETTLE_SECONDS`` (a worker turns a preempted
    run's Crashed into Preempted within a second or two)."""
    from prefect_spotgpu.child_runs import result_of
    from prefect_spotgpu.decorators import CRASH_SETTLE_SECONDS, cancel_run

    running = [s for s in shards if s.status is ShardStatus.RUNNING]
    states = children.states([s.run_id for s in running])
    now = time.monotonic()
    for shard in running:
        state, run_id = states.get(shard.run_id), shard.run_id
        failed = children.errors.pop(run_id, None)
        if failed is not None:  # its follower here failed: stop it, the shard goes again
            cancel_run(child, run_id, f"its follower failed: {type(failed).__name__}: {failed}")
            shard.status = ShardStatus.WAITING
            shard.errors.append(f"follower failed: {type(failed).__name__}: {failed}")
            continue
        following = children.following(run_id)
        if state is None or following or not state.is_final():
            crashed_since.pop(run_id, None)
            unserved.check(run_id, state, following)
            continue
        if state.is_crashed() and now - crashed_since.setdefault(run_id, now) < (
            CRASH_SETTLE_SECONDS
        ):
            continue
        crashed_since.pop(run_id, None)
        if state.is_completed():
            shard.status, shard.result = ShardStatus.DONE, result_of(run_id)
        else:  # over without its result: the shard is given to a new child
            shard.status = ShardStatus.WAITING
            shard.errors.append(f"{state.name}: {state.message}")


def _needed(shards: Sequence[Shard], deadline: datetime, shard_gpu_hours: float) -> int:
    """Children beyond those running that the deadline needs now."""
    waiting = sum(s.status is ShardStatus.WAITING for s in shards)
    running = sum(s.status is ShardStatus.RUNNING for s in shards)
    left = (deadline - datetime.now(UTC)).total_seconds()
    width = deadline_width(
        remaining=waiting + running, shard_seconds=shard_gpu_hours * 3600, seconds_left=left
    )
    return max(0, width - running)


def _live_workers(pool: str) -> list[str]:
    from prefect.utilities.asyncutils import run_coro_as_sync

    from prefect_spotgpu.decorators import live_workers

    return run_coro_as_sync(live_workers(pool))


class _Unserved:
    """Children handed to the pool's worker that no worker takes: after ``NO_WORKER_SECONDS``
    still Scheduled with no worker of the pool alive, the fan-out stops with what to start
    (it never waits for ever)."""

    def __init__(self, pool: str) -> None:
        self.pool, self.since = pool, {}

    def check(self, run_id, state, following: bool) -> None:
        from prefect_spotgpu.decorators import NO_WORKER_SECONDS

        if following or state is None or not state.is_scheduled():
            self.since.pop(run_id, None)
            return
        since = self.since.setdefault(run_id, time.monotonic())
        if time.monotonic() - since < NO_WORKER_SECONDS or _live_workers(self.pool):
            return
        raise RuntimeError(
            f"child flow run {run_id} waits for a worker, and no worker of pool "
            f"{self.pool!r} is running: start one with `prefect worker start --pool "
            f"{self.pool} --type spot-gpu`, or fan out with pool_worker=False"
        )


def storage_of(child):
    """The run storage of ``child``'s pool as its children see it, as named objects: where
    their outputs are, for the parent to read or assemble, and where to put their inputs.
    A local directory that node agents use as their checkpoint root (the first-hour stack:
    the block and ``--checkpoint-root`` name one directory) holds each tenant's files in
    ``tenant-<id>/``, and that is what this returns (``checkpoint.objects.tenant_objects``);
    a shared directory the nodes use as it is, or S3, is returned as it is."""
    from prefect_spotgpu.checkpoint.objects import tenant_objects

    market = _Market(child)
    storage = market.configuration.checkpoint_storage
    if storage is None:
        raise ValueError(f"work pool {child.work_pool!r} has no checkpoint storage")
    if storage.path is None:
        return storage.objects()
    with market.market.get_client() as http:
        me = http.get("/me")
    return tenant_objects(storage.path, me.json()["id"] if me.status_code == 200 else None)


class _Market:
    """The market as the parent sees it: room for children, and their bids' costs."""

    def __init__(self, child) -> None:
        from prefect_spotgpu.decorators import flow_configuration
        from prefect_spotgpu.worker.config import market_of

        self.configuration = flow_configuration(child)
        self.market = market_of(self.configuration)
        self.bids: dict[Any, tuple[BidResponse, list[AllocationResponse]]] = {}
        self.finished: set = set()

    def quotes(self) -> list[QuoteResponse] | None:
        """The market's prices (``GET /prices``), None when it does not answer."""
        with self.market.get_client() as http:
            response = http.get("/prices")
        if response.status_code != 200:
            return None
        return [QuoteResponse.model_validate(q) for q in response.json()]

    def check(self) -> None:
        """Refuse, before any child is made, children no node of the market would take."""
        c, quotes = self.configuration, self.quotes()
        if quotes is None:
            return
        problem = check_terms(
            quotes, gpu_model=DEFAULT_CATALOG.normalize(c.gpu_model), region=c.region,
            max_price=c.max_price,
        )  # fmt: skip
        if problem is not None:
            raise ValueError(
                f"fan-out: the children's bids would wait for ever: {problem}; change the "
                "child's job variables (@spot_gpu(..., max_price=..., region=...))"
            )

    def room(self) -> int:
        c, quotes = self.configuration, self.quotes()
        if quotes is None:
            return 0
        return market_width(
            quotes,
            gpu_model=DEFAULT_CATALOG.normalize(c.gpu_model),
            region=c.region,
            max_price=c.max_price,
            gpus_per_child=c.gpu_count * c.node_count,
        )

    def costs(self, shards: Sequence[Shard]) -> dict:
        """The children's cost so far: each bid read from the market, a finished child's
        once (its bid no longer changes), so a wide fan-out's report stays cheap."""
        from prefect.client.orchestration import get_client

        from prefect_spotgpu.protocol import LABELS

        with get_client(sync_client=True) as client, self.market.get_client() as http:
            for shard in shards:
                if shard.run_id is None or (
                    shard.status is ShardStatus.DONE and shard.run_id in self.finished
                ):
                    continue
                bid_id = (client.read_flow_run(shard.run_id).labels or {}).get(LABELS.BID)
                if bid_id is None:
                    continue
                bid = http.get(f"/bids/{bid_id}")
                allocations = http.get(f"/bids/{bid_id}/allocations")
                if bid.status_code == 200 and allocations.status_code == 200:
                    listed = [AllocationResponse.model_validate(a) for a in allocations.json()]
                    self.bids[shard.run_id] = (BidResponse.model_validate(bid.json()), listed)
                    if shard.status is ShardStatus.DONE:
                        self.finished.add(shard.run_id)
        return cost_report(list(self.bids.values()))


COST_SECONDS = 10.0
"""How often the parent reads its running children's costs (three calls each; a finished
child's once). Reading them at every change made a wide fan-out's parent its own bottleneck."""
SHOW_SECONDS = 2.0
"""How often, at most, the parent's progress artifacts are updated (and at the end)."""


class _Progress:
    """The parent's artifacts: a progress bar and a table of the shards, kept current."""

    def __init__(self, total: int) -> None:
        from prefect.context import FlowRunContext

        self.total, self.last = total, None
        self.counts: dict | None = None
        self.shown_at = 0.0
        self.inside = FlowRunContext.get() is not None
        self.bar = None
        if self.inside:
            from prefect.artifacts import create_progress_artifact

            self.bar = create_progress_artifact(0.0, description="shards done (%)")

    def show(self, counts: dict, costs: dict, final: bool = False) -> None:
        if not final and time.monotonic() - self.shown_at < SHOW_SECONDS:
            return
        self.counts, self.shown_at = counts, time.monotonic()
        if not self.inside or (counts, costs) == self.last:
            return
        from prefect.artifacts import create_markdown_artifact, update_progress_artifact
        from prefect.runtime import flow_run

        self.last = (counts, costs)
        update_progress_artifact(self.bar, 100.0 * counts["done"] / max(1, self.total))
        saving = "n/a" if costs["saving"] is None else f"{costs['saving']:.0%}"
        create_markdown_artifact(
            key=f"fan-out-{flow_run.get_id()}",
            markdown=(
                "| shards | done | running | waiting | failed | preemptions | spot cost | "
                "on-demand | saved |\n|---|---|---|---|---|---|---|---|---|\n"
                f"| {self.total} | {counts['done']} | {counts['running']} | "
                f"{counts['waiting']} | {counts['failed']} | {costs['preemptions']} | "
                f"{costs['spot_cost']:.4f} | {costs['on_demand_cost']:.4f} | {saving} |"
            ),
            description="fan-out progress",
        )
