"""Replay real spot availability traces through the real market, with deadline-bound jobs.

A trace (:mod:`prefect_spotgpu.economics.regions`) gives, every ``gap_seconds``, how many spot
instances were available. Replayed here, each available instance is a live node of one pool of
``market.Market``; an instance that disappears is an owner's reclaim (a notice). The zones of
one date and instance type are the regions of one market (:class:`Regions`: one pool per
zone); a single trace is a market of one region.

Competing demand (:class:`Demand`, per region, seeded, independent of the job and of each
other) follows a daily cycle (busy 09:00-21:00, quiet at night) with maximum prices between
the owners' reserve and 70 % of the on-demand price (bidders who would pay more buy
on-demand), so the clearing price moves between the reserve at night and about two thirds of
on-demand by day. It is exogenous: which bids arrive, at what price, and which leave is drawn
from its own random stream and never depends on the market or the job (``refresh`` checks it).

One job with ``work_h`` hours of work and a deadline is steered by a bidding policy
(``deadline.py``). Its spot hours are paid at the market's charges (per second, the pool's
clearing price at most its bid; and the notice fee of a takeover it leaves early, as any bid's:
``market/notice_fee.py``), its on-demand hours at the on-demand price. Its bid is
clamped to ``[MIN_BID, cap]`` and follows ``Action.region``: in a single-region replay the
pool's region; multi-region, ``None`` bids region ``any`` (the market places it where it
fits and, at a notice, reserves the migration target in any region) and a name pins the bid
to that pool. A running job keeps its bid while the action's region is ``None`` or where it
runs; any other change of region is a new bid (the old one is cancelled).

Every (re)start costs ``restart_h`` of lost time; a spot start in another region than the
one holding the job's latest checkpoint (where it last made progress on spot) costs
``migrate_h`` more (the checkpoint's transfer). A notice costs no work (the final save
finishes within the notice; the replay acknowledges it at once).

The lower bound on what any policy pays in this simulator is in :mod:`.bound`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from prefect_spotgpu.economics.deadline import Action, JobView, PaceMode, RegionQuote
from prefect_spotgpu.economics.policies import get_policy
from prefect_spotgpu.economics.regions import (
    ClearingHistory,
    Regions,
    Trace,
    load_trace,
    load_traces,
    region_quote,
    region_seed,
)
from prefect_spotgpu.market import (
    ANY_REGION,
    DEFAULT_CATALOG,
    AllocationStatus,
    Bid,
    Market,
    MarketConfig,
    Node,
    NodeState,
)
from prefect_spotgpu.market.money import MICROS

__all__ = ["Job", "MarketReplay", "Outcome", "Trace", "load_trace", "load_traces", "replay"]

MODEL = "A100-80G"
RESERVE = 0.90  # the lowest A100-80G spot price seen: the owners' floor (see
# docs/operators/architecture.md#design-1)
JOB_BID = 10**9  # the job's first bid id; competing bids count up from 1 (10**8 per region)
MIN_BID = 0.01  # the lowest bid the replay passes on (a market price must be positive)
MARKET_CONFIG = MarketConfig(notice_seconds=300)
HYSTERESIS = MARKET_CONFIG.hysteresis
ON_DEMAND = DEFAULT_CATALOG.get(MODEL).on_demand_price
COMPETING_TOP = 0.7 * ON_DEMAND  # above it, others buy on-demand


@dataclass(frozen=True)
class Job:
    work_h: float = 24.0
    deadline_h: float = 48.0
    cap: float = 1.40  # the user's maximum spot price per GPU-hour
    restart_h: float = 0.2
    migrate_h: float = 0.5  # on top of restart_h: a spot start away from the checkpoint


@dataclass
class Outcome:
    policy: str
    cost: float = 0.0
    on_demand_cost: float = 0.0  # the same work all on on-demand (the baseline)
    finished_h: float | None = None
    spot_h: float = 0.0
    on_demand_h: float = 0.0
    preemptions: int = 0
    migrations: int = 0  # spot starts away from the checkpoint's region
    work_lost_h: float = 0.0
    steps: list[str] = field(default_factory=list, repr=False)

    @property
    def met(self) -> bool:
        return self.finished_h is not None

    @property
    def saving(self) -> float:
        return 1 - self.cost / self.on_demand_cost

    def summary(self) -> dict:
        return {
            "cost": round(self.cost, 4),
            "saving": round(self.saving, 4),
            "deadline_met": self.met,
            "finished_h": None if self.finished_h is None else round(self.finished_h, 2),
            "spot_h": round(self.spot_h, 2),
            "on_demand_h": round(self.on_demand_h, 2),
            "preemptions": self.preemptions,
            "migrations": self.migrations,
            "work_lost_h": round(self.work_lost_h, 3),
        }


class Demand:
    """Competing bids of one region: a daily cycle of how many whole nodes others want, and at
    what price. ``step(now)`` draws which bids leave and which arrive from its own random
    stream only: the schedule is the same with or without the job (the bound relies on it).

    ``share`` scales how many bids the cycle wants (1: the benchmark's demand; 0: no competing
    demand at all), class-wide so that the replay and the bound see the same demand.
    ``benchmarks/replay_decomposition.py`` sets it."""

    share: float = 1.0

    def __init__(self, nodes: int, gpus: int, seed: int, first_id: int = 1) -> None:
        self.rng = random.Random(seed)
        self.nodes = nodes
        self.gpus = gpus
        self.next_id = first_id
        self.live: dict[int, float] = {}  # bid id -> maximum price, oldest first

    def step(self, now: float) -> tuple[list[int], list[tuple[int, float]]]:
        """The bids that leave at ``now`` and the ``(id, price)`` of those that arrive."""
        hour_of_day = (now / 3600) % 24
        busy = 0.5 + 1.0 * max(0.0, math.sin(math.pi * (hour_of_day - 9) / 12))
        wanted = sum(self.rng.random() < busy / 2 for _ in range(2 * self.nodes))
        wanted = round(wanted * self.share)
        keep = {b for b in self.live if self.rng.random() < 0.7}  # 30 % leave each tick
        gone = [b for b in self.live if b not in keep]
        self.live = {b: p for b, p in self.live.items() if b in keep}
        added = []
        while len(self.live) < wanted:
            price = round(self.rng.uniform(RESERVE, COMPETING_TOP), 2)
            self.live[self.next_id] = price
            added.append((self.next_id, price))
            self.next_id += 1
        return gone, added

    def refresh(self, market: Market, region: str, now: float) -> None:
        gone, added = self.step(now)
        for bid_id in gone:
            market.cancel_bid(bid_id, now)
        fresh = {bid_id for bid_id, _ in added}
        for bid_id in self.live:  # the market never closes a bid by itself
            if bid_id not in fresh and not market.has_bid(bid_id):
                raise RuntimeError(f"competing bid {bid_id} vanished: demand is not exogenous")
        for bid_id, price in added:
            market.add_bid(Bid(bid_id, MODEL, self.gpus, price, region, created_at=now))


class MarketReplay:
    """The regions' pools in the real market, with competing demand, stepped by their ticks.

    ``advance(step)`` makes the market's supply and demand those of tick ``start + step`` and
    returns its time (None past the traces' end); the caller adds its own bids and ticks."""

    def __init__(self, regions: Regions | Trace, start: int = 0, seed: int = 0) -> None:
        if isinstance(regions, Trace):
            regions = Regions.single(regions)
        self.regions, self.start = regions, start
        self.market = Market(MARKET_CONFIG)
        self.nodes = [max(1, int(t.available.max())) for t in regions.traces]
        self.demand = [
            Demand(n, regions.gpus_per_node, region_seed(seed, i), 1 + i * 10**8)
            for i, n in enumerate(self.nodes)
        ]
        self.node_region = {
            node_id(i, n): i for i, count in enumerate(self.nodes) for n in range(count)
        }
        self.t0 = 1_800_000_000.0 + start * regions.gap_seconds
        for i, count in enumerate(self.nodes):
            self._set_supply(i, count)

    def advance(self, step: int) -> float | None:
        index = self.start + step
        if index >= self.regions.length:
            return None
        now = self.t0 + step * self.regions.gap_seconds
        for i, (trace, demand) in enumerate(zip(self.regions.traces, self.demand, strict=True)):
            self._set_supply(i, int(trace.available[index]))
            demand.refresh(self.market, trace.zone, now)
        return now

    def _set_supply(self, region: int, count: int) -> None:
        trace = self.regions.traces[region]
        for n in range(self.nodes[region]):
            state = NodeState.LIVE if n < count else NodeState.RECLAIMED
            self.market.upsert_node(
                Node(node_id(region, n), MODEL, trace.zone, trace.gpus_per_node, RESERVE, state)
            )


def node_id(region: int, index: int) -> int:
    return region * 1000 + index + 1


def prospect(decision, cap: float, mine: bool = False) -> tuple[bool, float]:
    """From a one-pool market's quote: would a bid at ``cap`` hold GPUs now, and the price."""
    (quote,) = decision.quotes
    seen = region_quote(quote, cap=cap, reserve=RESERVE, hysteresis=HYSTERESIS,
                        gpus_per_node=1, mine=mine, forecast=None)  # fmt: skip
    return seen.open, seen.floor


Policy = Callable[[JobView], Action]


def replay(
    where: Trace | Regions, policy: str | Policy, job: Job, start: int = 0, seed: int = 0
) -> Outcome:
    """Run ``job`` from tick ``start`` under ``policy`` (a registered name or a function).

    A :class:`Trace` is the single-region replay (the bid stays in its pool); a
    :class:`Regions` is a multi-region market (``Action.region`` None bids ``any``)."""
    pinned = isinstance(where, Trace)
    regions = Regions.single(where) if pinned else where
    return _Run(regions, policy, job, start, seed, pinned).outcome()


class _Run:
    """One job's replay (``replay``'s state between steps)."""

    def __init__(self, regions, policy, job, start, seed, pinned) -> None:
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        name = policy if isinstance(policy, str) else getattr(policy, "__name__", "policy")
        self.regions, self.job, self.pinned = regions, job, pinned
        self.g = regions.gap_seconds / 3600
        self.gpus = regions.gpus_per_node
        baseline = (job.work_h + job.restart_h) * ON_DEMAND * self.gpus  # one start, no stops
        self.out = Outcome(name, on_demand_cost=baseline)
        self.world = MarketReplay(regions, start, seed)
        self.market = self.world.market
        self.names = regions.names
        self.history = ClearingHistory(len(self.names))
        self.bid_id: int | None = None  # the job's open bid
        self.bid_region: str | None = None
        self.next_bid = JOB_BID
        self.where: dict[int, int] = {}  # the job's allocation id -> region index
        self.quotes = tuple(
            region_quote_initial(n, nodes)
            for n, nodes in zip(self.names, self.world.nodes, strict=True)
        )

    def outcome(self) -> Outcome:
        job, out, market, g = self.job, self.out, self.market, self.g
        done, warmup, mode, ran, alloc = 0.0, 0.0, PaceMode.WAIT, False, None
        ran_in: int | None = None  # region of the spot allocation that ran last step
        checkpoint: int | None = None  # region where the job last made progress on spot
        noticed = False
        ours: set[int] = set()  # the job's allocations not yet ended
        finish_at = None
        for step in range(math.ceil(job.deadline_h / g) + 1):
            now = self.world.advance(step)
            if now is None or done >= job.work_h:
                break
            seen = (mode, ran, ran_in, checkpoint, noticed)
            action = self.policy(self._view(step * g, done, *seen))
            if action.mode == PaceMode.SPOT:
                self._bid(action, now, ran_in if alloc is not None else None)
            elif self.bid_id is not None:
                out.cost += _paid(market.cancel_bid(self.bid_id, now))
                self.bid_id, alloc = None, None
            decision = market.tick(now)
            self._see(decision, alloc)
            noticed = False
            if self.bid_id is not None:
                out.cost += _paid(decision, self.bid_id)
            for notice in decision.notices:
                if notice.bid_id == self.bid_id:  # the final save is done within the notice
                    settled = market.end_allocation(notice.allocation_id, "preempted", now)
                    out.cost += _paid(settled)
                    out.preemptions += 1
                    noticed = True
            for ending in decision.endings:  # a notice deadline passed (not with instant saves)
                if ending.bid_id == self.bid_id and ending.status is AllocationStatus.PREEMPTED:
                    out.preemptions += 1
            for p in decision.placements:
                if p.bid_id == self.bid_id:
                    ours.add(p.allocation_id)
                    self.where[p.allocation_id] = self.world.node_region[p.node_id]
            running = next((a for a in sorted(ours) if _runs(market, a)), None)
            ours = {a for a in ours if not _ended(market, a)}
            new_mode = (
                action.mode
                if action.mode == PaceMode.ON_DEMAND
                else (PaceMode.SPOT if running else PaceMode.WAIT)
            )
            fresh = new_mode != PaceMode.WAIT and (new_mode != mode or not ran or running != alloc)
            region = self.where[running] if new_mode == PaceMode.SPOT else None
            if fresh:
                warmup = job.restart_h
                if new_mode == PaceMode.SPOT and checkpoint not in (None, region):
                    warmup += job.migrate_h
                    out.migrations += 1
            alloc = running
            ran = new_mode != PaceMode.WAIT
            ran_in = region
            warming = min(warmup, g) if ran else 0.0
            productive = g - warming if ran else 0.0
            warmup -= warming
            if new_mode == PaceMode.SPOT and productive > 0:
                checkpoint = region
            used = g  # the last step is paid only for the time it needs
            if ran and done + productive >= job.work_h:
                used = warming + (job.work_h - done)
                out.finished_h = step * g + used
                done = job.work_h
                finish_at = now + used * 3600
            else:
                done += productive
            if new_mode == PaceMode.ON_DEMAND:
                out.cost += ON_DEMAND * self.gpus * used
                out.on_demand_h += used
            elif new_mode == PaceMode.SPOT:
                out.spot_h += used
            mode = new_mode
            out.steps.append(mode[0])
        if self.bid_id is not None:  # settle the last charges
            end = finish_at or self.world.t0 + len(out.steps) * self.regions.gap_seconds
            out.cost += _paid(market.cancel_bid(self.bid_id, end))
        if out.finished_h is not None and out.finished_h > job.deadline_h + 1e-9:
            out.finished_h = None
        return out

    def _view(self, now_h, done, mode, ran, ran_in, checkpoint, noticed) -> JobView:
        job, quotes = self.job, self.quotes
        if len(quotes) == 1:
            spot_open, spot_floor = quotes[0].open, quotes[0].floor
        else:
            spot_open = any(q.open for q in quotes)
            here = [quotes[ran_in]] if ran_in is not None else [q for q in quotes if q.open]
            spot_floor = min(q.floor for q in (here or quotes))
        return JobView(
            now_h, job.deadline_h, job.work_h, done, job.restart_h, self.g, mode, ran, job.cap,
            ON_DEMAND, spot_open, spot_floor, regions=quotes,
            region=None if ran_in is None else self.names[ran_in],
            migrate_h=job.migrate_h, noticed=noticed,
            checkpoint_region=None if checkpoint is None else self.names[checkpoint],
        )  # fmt: skip

    def _bid(self, action: Action, now: float, running_in: int | None) -> None:
        """Keep, reprice or replace the job's bid as ``action`` asks."""
        price = min(max(action.bid, MIN_BID), self.job.cap)
        if action.region is not None and action.region not in self.names:
            raise ValueError(
                f"region {action.region!r} is not a region of this market; "
                f"choose one of {', '.join(self.names)} or None"
            )
        if self.pinned:
            wanted = self.names[0]
        elif action.region is None:
            wanted = ANY_REGION
        else:
            wanted = action.region
        keep = self.bid_id is not None and (
            wanted == self.bid_region
            or (running_in is not None and action.region in (None, self.names[running_in]))
        )
        if keep:
            self.market.reprice_bid(self.bid_id, price)
            return
        if self.bid_id is not None:
            self.out.cost += _paid(self.market.cancel_bid(self.bid_id, now))
        self.bid_id, self.bid_region = self.next_bid, wanted
        self.next_bid += 1
        self.market.add_bid(Bid(self.bid_id, MODEL, self.gpus, price, wanted, now))

    def _see(self, decision, alloc: int | None) -> None:
        """The regions' quotes after a tick, as the next step's view shows them."""
        by_region = {q.region: q for q in decision.quotes}
        mine = self.where.get(alloc) if alloc is not None else None
        quotes = []
        for i, name in enumerate(self.names):
            quote = by_region[name]
            if quote.clearing_price is not None:
                self.history.add(i, decision.now, quote.clearing_price)
            quotes.append(
                region_quote(
                    quote, cap=self.job.cap, reserve=RESERVE, hysteresis=HYSTERESIS,
                    gpus_per_node=self.gpus, mine=mine == i,
                    forecast=self.history.forecast(i, decision.now),
                )
            )  # fmt: skip
        self.quotes = tuple(quotes)


def region_quote_initial(name: str, nodes: int) -> RegionQuote:
    """What a region looks like before the first tick: open at the reserve, nodes free."""
    return RegionQuote(name, True, RESERVE, nodes, None)


def _paid(result, bid_id: int | None = None) -> float:
    """What a decision or a settlement charged (``bid_id``'s only, when given): its charges and
    the notice fees its endings left owing, in units."""
    charges, fees = result.charges, result.fees
    if bid_id is None:
        return (charges.total() + sum(f.amount for f in fees)) / MICROS
    mine = charges.bid_id == bid_id
    owed = sum(f.amount for f in fees if f.bid_id == bid_id)
    return (int(charges.amount[mine].sum()) + owed) / MICROS


def _runs(market: Market, allocation_id: int) -> bool:
    return market.allocation_status(allocation_id) is AllocationStatus.RUNNING


def _ended(market: Market, allocation_id: int) -> bool:
    status = market.allocation_status(allocation_id)
    return status is None or status.is_terminal()
