"""Replay real spot availability traces through the real market, with deadline-bound jobs.

A trace (../shared/traces, from the NSDI '24 "Can't Be Late" paper) gives, every ``gap_seconds``,
how many spot instances were available. Replayed here, each available instance is a live node
of one pool of ``market.Market``; an instance that disappears is an owner's reclaim (a notice).
Competing demand follows a daily cycle (busy 09:00-21:00, quiet at night) with maximum prices
between the owners' reserve and 70 % of the on-demand price (bidders who would pay more buy
on-demand), so the clearing price moves between the reserve at night and about two thirds of
on-demand by day: the product's "about half the on-demand price". One job with
``work_h`` hours of work and a deadline is steered by a bidding policy (``deadline.py``); its
spot hours are paid at the market's clearing price per second, its on-demand hours at the
on-demand price. Every (re)start costs ``restart_h`` of lost time; a notice costs no work (the
final save finishes within the notice), a node that vanishes between ticks does the same, as
the notice (300 s) is shorter than every trace's tick.

The omniscient optimum is a dynamic programme over the same steps that knows, ahead of time,
when spot capacity is available to a bid at the cap and at what price (from the same market
replayed without the job): a lower bound on what any policy could pay.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefect_spotgpu.economics.deadline import JobView, get_policy
from prefect_spotgpu.market import (
    DEFAULT_CATALOG,
    AllocationStatus,
    Bid,
    Market,
    MarketConfig,
    Node,
    NodeState,
)
from prefect_spotgpu.market.money import MICROS

MODEL, REGION = "A100-80G", "trace"
RESERVE = 0.90  # the lowest A100-80G spot price of the product brief: the owners' floor
JOB_BID = 10**9  # the job's bid id; competing bids count up from 1
HYSTERESIS = MarketConfig().hysteresis


@dataclass(frozen=True)
class Trace:
    name: str
    gap_seconds: float
    available: np.ndarray  # instances available at each tick
    gpus_per_node: int

    @property
    def hours(self) -> float:
        return len(self.available) * self.gap_seconds / 3600


def load_trace(path: Path) -> Trace:
    raw = json.loads(Path(path).read_text())
    data = np.asarray(raw["data"], dtype=np.int64)
    size = path.stem.rsplit("_", 1)[-1]
    gpus = int(size) if size.isdigit() and int(size) in (1, 2, 4, 8) else 1
    name = f"{path.parent.parent.name}/{path.parent.name}/{path.stem}"
    return Trace(name, float(raw["metadata"]["gap_seconds"]), data, gpus)


def load_traces(root: Path) -> list[Trace]:
    """Every trace under ``root``, sorted by name."""
    return sorted((load_trace(p) for p in Path(root).rglob("*.json")), key=lambda t: t.name)


@dataclass(frozen=True)
class Job:
    work_h: float = 24.0
    deadline_h: float = 48.0
    cap: float = 1.40  # the user's maximum spot price per GPU-hour
    restart_h: float = 0.2


@dataclass
class Outcome:
    policy: str
    cost: float = 0.0
    on_demand_cost: float = 0.0  # the same work all on on-demand (the baseline)
    finished_h: float | None = None
    spot_h: float = 0.0
    on_demand_h: float = 0.0
    preemptions: int = 0
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
            "work_lost_h": round(self.work_lost_h, 3),
        }


class Demand:
    """Competing bids: a daily cycle of how many whole nodes others want, and at what price."""

    def __init__(self, trace: Trace, seed: int) -> None:
        self.rng = random.Random(seed)
        self.nodes = max(1, int(trace.available.max()))
        self.gpus = trace.gpus_per_node
        self.next_id = 1
        self.live: list[int] = []

    def refresh(self, market: Market, now: float) -> None:
        hour_of_day = (now / 3600) % 24
        busy = 0.5 + 1.0 * max(0.0, math.sin(math.pi * (hour_of_day - 9) / 12))
        wanted = sum(self.rng.random() < busy / 2 for _ in range(2 * self.nodes))
        keep = [b for b in self.live if self.rng.random() < 0.7]  # 30 % leave each tick
        for bid_id in self.live:
            if bid_id not in keep and market.has_bid(bid_id):
                market.cancel_bid(bid_id, now)
        self.live = [b for b in keep if market.has_bid(b)]
        top = 0.7 * DEFAULT_CATALOG.get(MODEL).on_demand_price  # above it, others buy on-demand
        while len(self.live) < wanted:
            price = round(self.rng.uniform(RESERVE, top), 2)
            market.add_bid(Bid(self.next_id, MODEL, self.gpus, price, REGION, created_at=now))
            self.live.append(self.next_id)
            self.next_id += 1


class MarketReplay:
    """A trace's pool in the real market, with competing demand, stepped by the trace's ticks.

    ``advance(step)`` makes the market's supply and demand those of tick ``start + step`` and
    returns its time (None past the trace's end); the caller adds its own bids and ticks."""

    def __init__(self, trace: Trace, start: int = 0, seed: int = 0) -> None:
        self.trace, self.start = trace, start
        self.nodes = max(1, int(trace.available.max()))
        self.market = Market(MarketConfig(notice_seconds=300))
        self.demand = Demand(trace, seed)
        self.t0 = 1_800_000_000.0 + start * trace.gap_seconds
        self._set_supply(self.nodes)

    def advance(self, step: int) -> float | None:
        index = self.start + step
        if index >= len(self.trace.available):
            return None
        now = self.t0 + step * self.trace.gap_seconds
        self._set_supply(int(self.trace.available[index]))
        self.demand.refresh(self.market, now)
        return now

    def _set_supply(self, count: int) -> None:
        for node in range(self.nodes):
            state = NodeState.LIVE if node < count else NodeState.RECLAIMED
            self.market.upsert_node(
                Node(node + 1, MODEL, REGION, self.trace.gpus_per_node, RESERVE, state)
            )


def replay(trace: Trace, policy_name: str, job: Job, start: int = 0, seed: int = 0) -> Outcome:
    """Run ``job`` from tick ``start`` of ``trace`` under ``policy_name``."""
    policy = get_policy(policy_name)
    od = DEFAULT_CATALOG.get(MODEL).on_demand_price
    g = trace.gap_seconds / 3600
    baseline = (job.work_h + job.restart_h) * od * trace.gpus_per_node  # one start, no stops
    out = Outcome(policy_name, on_demand_cost=baseline)
    pool = MarketReplay(trace, start, seed)
    market = pool.market
    done, warmup, mode, ran, alloc = 0.0, 0.0, "wait", False, None
    ours: set[int] = set()  # the job's allocations not yet ended
    quote = (True, RESERVE)  # what the pool's quote says before the first tick
    finish_at = None
    for step in range(math.ceil(job.deadline_h / g) + 1):
        now = pool.advance(step)
        if now is None or done >= job.work_h:
            break
        now_h = step * g
        view = JobView(now_h, job.deadline_h, job.work_h, done, job.restart_h, g, mode, ran,
                       job.cap, od, *quote)  # fmt: skip
        action = policy(view)
        if action.mode == "spot":
            if market.has_bid(JOB_BID):
                market.reprice_bid(JOB_BID, action.bid)
            else:
                market.add_bid(Bid(JOB_BID, MODEL, trace.gpus_per_node, action.bid, REGION, now))
        elif market.has_bid(JOB_BID):
            out.cost += market.cancel_bid(JOB_BID, now).charges.total() / MICROS
            alloc = None
        decision = market.tick(now)
        quote = prospect(decision, job.cap, mine=alloc is not None)
        out.cost += int(decision.charges.amount[decision.charges.bid_id == JOB_BID].sum()) / MICROS
        for notice in decision.notices:
            if notice.bid_id == JOB_BID:  # the final save is done within the notice
                settled = market.end_allocation(notice.allocation_id, "preempted", now)
                out.cost += settled.charges.total() / MICROS
                out.preemptions += 1
        for ending in decision.endings:  # a notice deadline passed (not with instant saves)
            if ending.bid_id == JOB_BID and ending.status is AllocationStatus.PREEMPTED:
                out.preemptions += 1
        ours.update(p.allocation_id for p in decision.placements if p.bid_id == JOB_BID)
        running = next(
            (a for a in sorted(ours) if market.allocation_status(a) is AllocationStatus.RUNNING),
            None,
        )
        ours = {a for a in ours if not _ended(market, a)}
        new_mode = "on_demand" if action.mode == "on_demand" else ("spot" if running else "wait")
        fresh = new_mode != "wait" and (new_mode != mode or not ran or running != alloc)
        if fresh:
            warmup = job.restart_h
        alloc = running
        ran = new_mode != "wait"
        warming = min(warmup, g) if ran else 0.0
        productive = g - warming if ran else 0.0
        warmup -= warming
        used = g  # the last step is paid only for the time it needs
        if ran and done + productive >= job.work_h:
            used = warming + (job.work_h - done)
            out.finished_h = now_h + used
            done = job.work_h
            finish_at = now + used * 3600
        else:
            done += productive
        if new_mode == "on_demand":
            out.cost += od * trace.gpus_per_node * used
            out.on_demand_h += used
        elif new_mode == "spot":
            out.spot_h += used
        mode = new_mode
        out.steps.append(mode[0])
    if market.has_bid(JOB_BID):  # settle the last charges
        end = finish_at or pool.t0 + len(out.steps) * trace.gap_seconds
        out.cost += market.cancel_bid(JOB_BID, end).charges.total() / MICROS
    if out.finished_h is not None and out.finished_h > job.deadline_h + 1e-9:
        out.finished_h = None
    return out


def prospect(decision, cap: float, mine: bool = False) -> tuple[bool, float]:
    """From the pool's quote: would a bid at ``cap`` hold GPUs now (it holds some already,
    GPUs are free, or it outbids the clearing price beyond the hysteresis), and the price."""
    (quote,) = decision.quotes
    floor = max(RESERVE, quote.clearing_price or RESERVE)
    outbids = floor * (1 + HYSTERESIS) < cap
    return quote.gpus_total > 0 and (mine or quote.gpus_free > 0 or outbids), floor


def _ended(market: Market, allocation_id: int) -> bool:
    status = market.allocation_status(allocation_id)
    return status is None or status.is_terminal()


def spot_prospects(trace: Trace, job: Job, start: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step, whether a bid at the cap would hold spot GPUs, and the price it would pay:
    the same market and demand replayed without the job (what the optimum knows ahead)."""
    g = trace.gap_seconds / 3600
    steps = math.ceil(job.deadline_h / g) + 1
    pool = MarketReplay(trace, start, seed)
    available, price = np.zeros(steps, bool), np.zeros(steps)
    for step in range(steps):
        now = pool.advance(step)
        if now is None:
            break
        available[step], price[step] = prospect(pool.market.tick(now), job.cap)
    return available, price


def optimum(trace: Trace, job: Job, start: int = 0, seed: int = 0) -> Outcome:
    """The cheapest schedule that meets the deadline, knowing the future (a lower bound)."""
    available, price = spot_prospects(trace, job, start, seed)
    g = trace.gap_seconds / 3600
    od = DEFAULT_CATALOG.get(MODEL).on_demand_price * trace.gpus_per_node
    spot_cost = price * trace.gpus_per_node * g
    need = math.ceil(job.work_h / g - 1e-9)  # productive steps
    r = math.ceil(job.restart_h / g - 1e-9)  # steps lost at each start
    steps = len(available)
    inf = float("inf")
    # cost[m, w, k]: cheapest cost with mode m (0 wait, 1 spot, 2 od), w warm-up steps left,
    # k productive steps done
    cost = np.full((3, r + 1, need + 1), inf)
    cost[0, 0, 0] = 0.0
    for t in range(steps):
        new = np.full_like(cost, inf)
        best_any = cost.min(axis=(0, 1))  # wait from anything
        new[0, 0] = np.minimum(new[0, 0], best_any)
        for m, unit in ((1, spot_cost[t]), (2, od * g)):
            if m == 1 and not available[t]:
                continue
            # continue in mode m: warm-up counts down, or progress advances
            for w in range(r + 1):
                prev = cost[m, w]
                if w > 0:
                    new[m, w - 1] = np.minimum(new[m, w - 1], prev + unit)
                else:
                    shifted = np.full(need + 1, inf)
                    shifted[1:] = prev[:-1] + unit
                    shifted[need] = min(shifted[need], prev[need] + unit)
                    new[m, 0] = np.minimum(new[m, 0], shifted)
            # start mode m from another mode: r warm-up steps, this one the first
            other = np.minimum.reduce([cost[o].min(axis=0) for o in range(3) if o != m])
            if r == 0:
                shifted = np.full(need + 1, inf)
                shifted[1:] = other[:-1] + unit
                new[m, 0] = np.minimum(new[m, 0], shifted)
            else:
                new[m, r - 1] = np.minimum(new[m, r - 1], other + unit)
        cost = new
        if (t + 1) * g >= job.deadline_h - 1e-9:
            break
    total = float(cost[:, :, need].min())
    out = Outcome("omniscient-optimum", on_demand_cost=(job.work_h + job.restart_h) * od)
    out.cost = total
    out.finished_h = job.deadline_h if math.isfinite(total) else None
    return out
