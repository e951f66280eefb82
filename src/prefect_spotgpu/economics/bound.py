"""A lower bound on what any policy pays for a job in the replay (``replay.py``), single- or
multi-region: no policy -- however lucky or clairvoyant -- pays less in that exact simulator.

What the job cannot change is known ahead: the supply (the traces) and the competing demand
(``Demand`` draws from its own random stream and never looks at the market). So for every
region and step we know the live nodes ``S`` (of ``N``, live ones always the first ``S``) and
the competing maximum prices present, highest first (``P_k`` the k-th, 0 past the last).
Every bid wants one whole node. The market's rules (``market/clearing.py``, ``pricing.py``,
``allocations.py``) then give necessary conditions for what the job can do and pay:

1. *Price.* An allocation pays, for the interval after tick ``t``, the price set at ``t``:
   ``min(max(clearing, reserve), own bid)``; a reprice takes effect at the next tick, so it
   never lowers the price of an interval already begun (``reprice_bid``). A job still running
   after tick ``t`` that ran before (or was promoted from a reservation) was an eviction
   candidate and was not taken, and eviction takes the weakest candidate first: so every
   competitor above ``bid * (1 + h)`` (``h`` the hysteresis) holds a node, a reservation or a
   notice. At most
   ``K = (S-1) + min(N-1, D + O)`` do: one running or reserved bid on each other live node, ``D``
   allocations noticed by a reclaim and still in their notice, ``O`` outbid ones (none when a
   tick outlasts the notice: a competitor above the job is never evicted before it; else up
   to ``N-1``). So ``bid >= P_(K+1) / (1 + h)`` and the price is at least
   ``floor_run = max(reserve, P_(K+1) / (1 + h))``, where the job cannot hold a node at all if
   ``P_(K+1) > cap * (1 + h)``. A job placed new at ``t`` had no waiting competitor ranked above
   it, so its bid is at least the highest waiting one, ``P_(K'+1)`` (``K'`` also counting this
   tick's victims); ``floor_first`` is the lesser of the two. So every interval costs at least
   the floor at its start, the last one of a run too (cancelled, released or noticed: the
   seconds before the tick are billed at the price in force; the replay acknowledges a notice
   at once). Before the market's reprice took effect only at the next tick, a reprice lowered
   the interval already run, and this bound allowed for it (about 1.4 points of saving).
2. *Entry.* A waiting bid is placed (free fit, claim of noticed GPUs, eviction) only after
   every competitor ranked above it was placed: where more competitors bid above the cap than
   ``S - 1`` plus the noticed ones, the job cannot be placed. Placed new it also needs a node
   free at that tick (new supply, a competitor leaving, a notice ending, or a node left free
   by the tick before, when every competitor was placed; with notices that outlast a tick,
   any tick). After waiting a step it may also start on a takeover's reservation, up to
   ``(notice + grace) / tick`` ticks after it was placed, or on a migration reservation made
   at a notice the tick before, which needs a free node in that region then.
3. *Time.* Progress is counted in units of ``u`` (the tick or a divisor of it, about a
   minute); each start's overhead (``restart_h``, plus ``migrate_h`` away from the checkpoint's
   region, as the replay charges it) is rounded down to whole units and the work up; the last
   step is billed only for the units still to do, less one, and may end the job by the deadline.

The dynamic programme over (checkpoint region, waiting / on-demand / warm spot run in a region,
progress) minimises the cost over every schedule these conditions allow and that finishes by
the deadline. Every run of the replay is such a schedule and pays at least what the programme
charges for it, so the programme's minimum is a lower bound. The relaxations, exactly: the
conditions above are necessary, not sufficient (the job may start, run or pay as they allow
where the market would not: e.g. it may enter where only competitors below the cap are, bid
exactly what the competitors about to arrive permit, or migrate wherever a node could be
free); a migration needs no notice; a start whose warm-up is cut short is not modelled (it
costs money and changes nothing); and the rounding of 3.

``hindsight_schedule`` is the former "omniscient optimum": the cheapest schedule against the
prospects of the market replayed without the job. It is NOT a bound (the job changes who holds
what; whole-step overheads): policies beat it, and the tests show the check rejects it.
"""

from __future__ import annotations

import math

import numpy as np

from prefect_spotgpu.economics.regions import Regions, Trace, region_seed
from prefect_spotgpu.economics.replay import (
    MARKET_CONFIG,
    ON_DEMAND,
    RESERVE,
    Demand,
    Job,
    MarketReplay,
    Outcome,
    prospect,
)

INF = float("inf")


def competing(regions: Regions, job: Job, start: int, seed: int) -> tuple[np.ndarray, ...]:
    """Per region and step: live nodes, competing prices present (highest first, 0-padded)
    and competing bids that left, from the same demand the replay draws."""
    gap = regions.gap_seconds
    steps = min(math.ceil(job.deadline_h * 3600 / gap) + 1, regions.length - start)
    t0 = 1_800_000_000.0 + start * gap
    live = np.stack([t.available[start : start + steps] for t in regions.traces]).astype(int)
    nodes = [max(1, int(t.available.max())) for t in regions.traces]
    prices = np.zeros((len(nodes), steps, 2 * max(nodes) + 1))
    gone = np.zeros((len(nodes), steps), int)
    for r, n in enumerate(nodes):
        demand = Demand(n, regions.gpus_per_node, region_seed(seed, r))
        for t in range(steps):
            left, _ = demand.step(t0 + t * gap)
            present = sorted(demand.live.values(), reverse=True)
            prices[r, t, : len(present)] = present
            gone[r, t] = len(left)
    return live, np.asarray(nodes), prices, gone


def _window(x: np.ndarray, back: int) -> np.ndarray:
    """Per step, the sum of ``x`` over that step and the ``back`` before it."""
    c = np.cumsum(np.pad(x, ((0, 0), (back + 1, 0))), axis=1)
    return c[:, back + 1 :] - c[:, : -back - 1]


def _kth(prices: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The ``k``-th highest price per region and step (1-based; 0 past the last)."""
    idx = np.clip(k - 1, 0, prices.shape[2] - 1)
    got = np.take_along_axis(prices, idx[..., None], axis=2)[..., 0]
    return np.where((k >= 1) & (k <= prices.shape[2]), got, 0.0)


def limits(regions: Regions, job: Job, start: int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    """The necessary conditions of the module docstring, per region and step: ``cont`` (may
    run), ``start_new`` (may be placed new: from any state), ``start_waiting`` (may start
    after waiting the step before: new, a takeover's or a migration's reservation), the least
    price in force per GPU-hour (``floor_run``: running the step before too; ``floor_first``:
    a new allocation)."""
    live, nodes, prices, gone = competing(regions, job, start, seed)
    cfg, cap = MARKET_CONFIG, job.cap
    h, gap = 1.0 + cfg.hysteresis, regions.gap_seconds
    n = nodes[:, None]
    up = live >= 1
    before = np.pad(live[:, :-1], ((0, 0), (1, 0)))  # no allocation exists before step 0
    flips = np.maximum(0, before - live)  # nodes reclaimed at the tick: their notices
    back = math.ceil(cfg.notice_seconds / gap) - 1  # earlier ticks whose notices still run
    noticed = _window(flips, back)
    long_tick = gap >= cfg.notice_seconds
    outbid = 0 if long_tick else n - 1
    k_run = (live - 1) + np.minimum(n - 1, noticed + outbid)
    k_new = (live - 1) + np.minimum(n - 1, noticed + (live - 1) + outbid)
    p_run, p_new = _kth(prices, k_run + 1), _kth(prices, k_new + 1)
    floor_run = np.maximum(RESERVE, p_run / h)
    floor_first = np.maximum(RESERVE, np.minimum(p_run / h, p_new))
    cont = up & ((p_run <= cap * h) | (p_new <= cap))
    above_cap = (prices > cap).sum(axis=2)
    threat = _window(((prices > cap * h).sum(axis=2) > 0).astype(int), back) > 0
    enter = up & (above_cap <= (live - 1) + np.minimum(n, noticed + np.where(threat, n, 0)))
    if long_tick:  # a free node at a tick: new supply, a bid leaving, a notice ending, or
        present = (prices > 0).sum(axis=2)  # one left free by the tick before
        all_placed = up & (present <= (live - 1) + np.minimum(n - 1, noticed + (live - 1)))
        freed = up & (
            (live > before)
            | (_window(gone, 1) > 0)
            | (_window(flips, 1) > 0)
            | np.pad(all_placed[:, :-1], ((0, 0), (1, 0)))
        )
    else:  # notices outlast a tick: the job's own takeovers may free nodes too
        freed = up
    promote = math.ceil((cfg.notice_seconds + cfg.reservation_grace_seconds) / gap)
    taken = np.pad(_window(enter.astype(int), promote - 1)[:, :-1], ((0, 0), (1, 0))) > 0
    start_new = cont & enter & freed
    start_waiting = start_new | (cont & (taken | np.pad(freed[:, :-1], ((0, 0), (1, 0)))))
    return {"cont": cont, "start_new": start_new, "start_waiting": start_waiting,
            "floor_run": floor_run, "floor_first": floor_first}  # fmt: skip


def lower_bound(where: Trace | Regions, job: Job, start: int = 0, seed: int = 0) -> Outcome:
    """The least cost at which any policy could finish ``job`` by its deadline (module doc)."""
    regions = Regions.single(where) if isinstance(where, Trace) else where
    lim = limits(regions, job, start, seed)
    gpus, gap = regions.gpus_per_node, regions.gap_seconds
    out = Outcome("lower-bound", on_demand_cost=(job.work_h + job.restart_h) * ON_DEMAND * gpus)
    out.cost = _cheapest(lim, job, gap, gpus)
    out.finished_h = job.deadline_h if math.isfinite(out.cost) else None
    return out


def _cheapest(lim: dict[str, np.ndarray], job: Job, gap: float, gpus: int) -> float:
    """The dynamic programme: cost arrays over progress units, per checkpoint region (the last
    index: none yet) for waiting and on-demand, and per region for a warm spot run."""
    cont = lim["cont"]
    regions, steps = cont.shape
    m = max(1, round(gap / 60))  # progress units per step
    u = gap / m
    need = math.ceil(job.work_h * 3600 / u - 1e-9)
    o_restart = math.floor(job.restart_h * 3600 / u + 1e-9)
    o_migrate = math.floor((job.restart_h + job.migrate_h) * 3600 / u + 1e-9)
    g_h, u_h, deadline_s = gap / 3600, u / 3600, job.deadline_h * 3600
    per_step = gpus * g_h
    carry_run = np.where(cont, lim["floor_run"], INF) * per_step  # an interval, run before
    carry_first = np.where(cont, lim["floor_first"], INF) * per_step  # ... placed new
    known = np.where(np.isfinite(carry_run), carry_run, 0.0)  # starts check ``run``
    carry_sum = np.pad(np.cumsum(known, axis=1), ((0, 0), (1, 0)))
    rate_run, rate_first = lim["floor_run"] * gpus, lim["floor_first"] * gpus
    last = lim["floor_first"] * per_step  # a run's last interval, however it ends
    od_step, od_rate = ON_DEMAND * per_step, np.full(regions + 1, ON_DEMAND * gpus)
    run = np.zeros((regions, steps + 1), int)  # consecutive steps a run may go on from t
    for t in range(steps - 1, -1, -1):
        run[:, t] = np.where(cont[:, t], run[:, t + 1] + 1, 0)
    p = np.arange(need)
    wait = np.full((regions + 1, need), INF)
    wait[regions, 0] = 0.0
    od = np.full((regions + 1, need), INF)
    spot = np.full((regions, need), INF)
    arrive_spot: dict[int, np.ndarray] = {}
    arrive_od: dict[int, np.ndarray] = {}
    best = INF

    def finish(base: np.ndarray, gain: int, warm: int, rate: np.ndarray, t: int) -> float:
        """The cheapest finish within step ``t`` from each progress, with ``gain`` units to
        make in it (``warm`` of them overhead first), billed only for what is left."""
        lo = max(0, need - gain)
        left = warm + np.maximum(0, need - 1 - p[lo:])
        ok = t * gap + left * u <= deadline_s + 1e-6
        costs = base[:, lo:] + np.multiply.outer(rate, left * u_h)
        return float(np.where(ok, costs, INF).min(initial=INF))

    def shift(base: np.ndarray, gain: int) -> np.ndarray:
        moved = np.full_like(base, INF)
        if gain < need:
            moved[:, gain:] = base[:, : need - gain]
        return moved

    def checkpoint_moves(free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per region, the cheapest start from no checkpoint or its own (a restart), and from
        another region's (a migration)."""
        same = np.minimum(free[regions][None, :], free[:regions])
        if regions == 1:
            return same, np.full_like(same, INF)
        order = np.argsort(free[:regions], axis=0)
        first = np.take_along_axis(free[:regions], order[:1], axis=0)[0]
        second = np.take_along_axis(free[:regions], order[1:2], axis=0)[0]
        other = np.where(order[0][None, :] == np.arange(regions)[:, None], second, first)
        return same, other

    for t in range(steps):
        prev = max(t - 1, 0)  # states are of the step before (none before step 0)
        waited = np.minimum(np.minimum(wait, od), _with(spot, last[:, prev : prev + 1], regions))
        direct = np.minimum(od, _with(spot, last[:, prev : prev + 1], regions))
        new_spot = arrive_spot.pop(t, np.full((regions, need), INF))
        new_od = arrive_od.pop(t, np.full((regions + 1, need), INF))
        if t > 0:  # runs that go on
            base = np.where(cont[:, t : t + 1], spot + carry_run[:, prev : prev + 1], INF)
            new_spot = np.minimum(new_spot, shift(base, m))
            best = min(best, finish(base, m, 0, rate_run[:, t], t))
            new_od = np.minimum(new_od, shift(od + od_step, m))
            best = min(best, finish(od, m, 0, od_rate, t))
        w_same, w_other = checkpoint_moves(wait)
        d_same, d_other = checkpoint_moves(direct)
        for from_wait, from_direct, over in (
            (w_same, d_same, o_restart),
            (w_other, d_other, o_migrate),
        ):
            k, gain = over // m, m * (over // m + 1) - over
            if t + k >= steps:
                continue
            base = np.minimum(
                np.where(lim["start_waiting"][:, t : t + 1], from_wait, INF),
                np.where(lim["start_new"][:, t : t + 1], from_direct, INF),
            )
            ok = (run[:, t] >= k + 1)[:, None]
            if k == 0:  # the arrival step is the first: its interval is charged when it ends
                with np.errstate(invalid="ignore"):  # inf - inf where it cannot run: not ok
                    spent = (carry_first[:, t] - carry_run[:, t])[:, None]
                rate = rate_first[:, t]
            else:
                spent = (carry_first[:, t] + carry_sum[:, t + k] - carry_sum[:, t + 1])[:, None]
                rate = rate_run[:, t + k]
            base = np.where(ok, base + np.where(ok, spent, 0.0), INF)
            best = min(best, finish(base, gain, over - k * m, rate, t + k))
            land = shift(base, gain)
            if k == 0:
                new_spot = np.minimum(new_spot, land)
            else:
                arrive_spot[t + k] = np.minimum(arrive_spot.get(t + k, INF), land)
        # on-demand starts (a restart; the checkpoint stays where it is)
        k, gain = o_restart // m, m * (o_restart // m + 1) - o_restart
        if t + k < steps:
            base = np.minimum(wait, direct)
            best = min(best, finish(base + k * od_step, gain, o_restart - k * m, od_rate, t + k))
            land = shift(base + (k + 1) * od_step, gain)
            if k == 0:
                new_od = np.minimum(new_od, land)
            else:
                arrive_od[t + k] = np.minimum(arrive_od.get(t + k, INF), land)
        wait, spot, od = waited, new_spot, new_od
    return best


def _with(spot: np.ndarray, cost, regions: int) -> np.ndarray:
    """Warm spot runs (per region) ending at a cost, as states per checkpoint region."""
    out = np.full((regions + 1, spot.shape[1]), INF)
    out[:regions] = spot + cost
    return out


def spot_prospects(trace: Trace, job: Job, start: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step, whether a bid at the cap would hold spot GPUs, and the price it would pay,
    in the same market and demand replayed without the job."""
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


def hindsight_schedule(trace: Trace, job: Job, start: int = 0, seed: int = 0) -> Outcome:
    """The cheapest schedule against ``spot_prospects`` (whole steps, restarts of whole
    steps): what knowing the job-less market's future suggests. Not a bound (module doc)."""
    available, price = spot_prospects(trace, job, start, seed)
    g = trace.gap_seconds / 3600
    od = ON_DEMAND * trace.gpus_per_node
    spot_cost = price * trace.gpus_per_node * g
    need = math.ceil(job.work_h / g - 1e-9)  # productive steps
    r = math.ceil(job.restart_h / g - 1e-9)  # steps lost at each start
    # cost[m, w, k]: mode m (0 wait, 1 spot, 2 od), w warm-up steps left, k steps done
    cost = np.full((3, r + 1, need + 1), INF)
    cost[0, 0, 0] = 0.0
    for t in range(len(available)):
        new = np.full_like(cost, INF)
        new[0, 0] = cost.min(axis=(0, 1))  # wait from anything
        for mode, unit in ((1, spot_cost[t]), (2, od * g)):
            if mode == 1 and not available[t]:
                continue
            for w in range(r + 1):  # go on in this mode
                prev = cost[mode, w]
                if w > 0:
                    new[mode, w - 1] = np.minimum(new[mode, w - 1], prev + unit)
                else:
                    moved = np.full(need + 1, INF)
                    moved[1:] = prev[:-1] + unit
                    moved[need] = min(moved[need], prev[need] + unit)
                    new[mode, 0] = np.minimum(new[mode, 0], moved)
            other = np.minimum.reduce([cost[o].min(axis=0) for o in range(3) if o != mode])
            if r == 0:  # start this mode: r warm-up steps, this one the first
                moved = np.full(need + 1, INF)
                moved[1:] = other[:-1] + unit
                new[mode, 0] = np.minimum(new[mode, 0], moved)
            else:
                new[mode, r - 1] = np.minimum(new[mode, r - 1], other + unit)
        cost = new
        if (t + 1) * g >= job.deadline_h - 1e-9:
            break
    out = Outcome("hindsight-schedule", on_demand_cost=(job.work_h + job.restart_h) * od)
    out.cost = float(cost[:, :, need].min())
    out.finished_h = job.deadline_h if math.isfinite(out.cost) else None
    return out
