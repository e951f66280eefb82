"""Deadline pacing for the worker: what a flow run with a deadline should bid for, now.

A run that states its work (``gpu_hours``) and a deadline is steered by a named bidding policy
of ``prefect_spotgpu.economics.deadline``. The worker asks :func:`plan` when it places the
run's bid and every ``PACE_SECONDS`` while it follows it; the answer is one :class:`Plan`:

- ``spot`` at a price: keep (or reprice) the spot bid to that maximum;
- ``on_demand``: the policy moves the run to on-demand capacity (the slack can no longer
  absorb a restart; or, for ``deadline-aware``, spot is open nowhere and the slack is short).
  A waiting spot bid is cancelled and an on-demand bid placed; a *running* spot job is first
  given the usual notice (the worker lowers its bid below every reserve: ``RELEASE_PRICE``),
  saves its checkpoint, and resumes on-demand.
- back to ``spot`` from on-demand, when the policy says so (``deadline-aware``: some region
  opened and the slack pays this start and one more; ``greedy-spot`` and
  ``uniform-progress`` never do, as they move only when the slack is gone): a running
  on-demand job is released the same way (its bid lowered below the on-demand price: a
  notice, billed at the on-demand price), and the run resumes on a spot bid.

Progress is read from the bid's allocations: the seconds each ran, less ``restart_minutes``
per start (provisioning and restore). It is an estimate: the flow's own step counter is not
visible to the worker. Nothing here does I/O; the worker supplies the bid, its allocations
and the clock. Example (4 h of work, deadline 6 h after the scheduled start, restart 5 min)::

    t=0 h     nothing ran                      slack 2.0 h   -> spot at the cap (on pace)
    t=1 h     running since 0 (0.92 h done)    0.25 h ahead  -> spot at the cap (holds GPUs)
    t=3 h     preempted at 1.5 h (1.42 done)   slack 0.42 h  -> spot at the cap (behind)
    t=3.35 h  still waiting                    slack 0.07 h  -> on-demand to the end
              (below one restart and one step: 0.083 + 0.017 h)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta

from prefect_spotgpu.economics.deadline import JobView, PaceMode, RegionQuote
from prefect_spotgpu.economics.policies import get_policy
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.messages import AllocationResponse, BidResponse, QuoteResponse
from prefect_spotgpu.protocol import HOLDING_STATUSES, AllocationStatus, Capacity, MarketTerms

RAN_AND_ENDED = (AllocationStatus.PREEMPTED, AllocationStatus.FINISHED)
"""Allocations that held GPUs and ended (a reserved one released never ran)."""

PACE_SECONDS = float(os.environ.get("SPOTGPU_PACE_SECONDS", "60"))
"""How often the worker asks the policy again while it follows a paced run (the policy's step;
``SPOTGPU_PACE_SECONDS`` in the worker's environment changes it)."""
RELEASE_PRICE = 0.0001
"""A spot bid repriced to this is below every reserve: its running job gets a notice."""


@dataclass(frozen=True, slots=True)
class Pace:
    """A run's deadline terms, from its job configuration."""

    gpu_hours: float
    deadline: datetime
    origin: datetime  # the run's scheduled start: hours are counted from here
    policy: str
    restart_minutes: float
    cap: float  # the run's maximum spot price per GPU-hour
    gpu_model: str
    on_demand_fallback: bool = True
    region: str = "any"  # the run's region, or any: the policy then sees every region's quote
    gpu_count: int = 1  # GPUs a node (the size a quote must have free)

    def __post_init__(self) -> None:
        get_policy(self.policy)  # an unknown name fails listing the valid ones


@dataclass(frozen=True, slots=True)
class Plan:
    mode: PaceMode  # SPOT or ON_DEMAND
    price: float  # the spot bid's maximum, or the on-demand price
    view: JobView
    region: str | None = None  # where the policy would run it now (None: wherever it fits)

    def describe(self) -> str:
        v = self.view
        on_demand = self.mode == PaceMode.ON_DEMAND
        where = "on-demand" if on_demand else f"spot at most {self.price:.2f}"
        if self.mode == PaceMode.SPOT and self.region and len(v.regions) > 1:
            where += f", best now in {self.region}"
        return (
            f"{where}: {v.done_h:.2f} of {v.work_h:.2f} GPU-hours done, "
            f"{v.deadline_h - v.now_h:.2f} h to the deadline, slack {v.slack_h:.2f} h"
        )


def done_hours(
    allocations: list[AllocationResponse], now: float, restart_h: float
) -> tuple[float, bool]:
    """Hours of work the allocations did (each start costs ``restart_h``), and whether one
    holds GPUs now."""
    done, holding = 0.0, False
    for a in allocations:
        if a.status in HOLDING_STATUSES:
            holding = True
            end = now
        elif a.status in RAN_AND_ENDED and a.ended_at is not None:
            end = a.ended_at
        else:
            continue  # reserved, released: never ran
        done += max(0.0, (end - a.started_at) / 3600 - restart_h)
    return done, holding


def region_quotes(
    pace: Pace, quotes: list[QuoteResponse], hysteresis: float = MarketTerms().hysteresis
) -> tuple[RegionQuote, ...]:
    """The spot pools of the run's model (of its region, or every region for ``any``) from
    the market's ``GET /prices``, as the policy reads them: open when a bid at the cap would
    hold GPUs there now (a node's worth free, or the cap beats the clearing price by the
    hysteresis margin: the market's, ``MarketTerms``), and the floor that wins there now.

    >>> from datetime import UTC
    >>> p = Pace(4, datetime(2026, 12, 2, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC),
    ...          "deadline-aware", 5, 1.2, "A100-80G", gpu_count=2)
    >>> q = dict(gpu_model="A100-80G", capacity="spot", reserve_price=0.9, on_demand_price=2.1,
    ...          gpus_total=2, gpus_running=0, waiting_bids=0)
    >>> eu = QuoteResponse(**q, region="eu", clearing_price=1.15, gpus_free=0)
    >>> found = region_quotes(p, [eu, QuoteResponse(**q, region="us", clearing_price=None,
    ...                                             gpus_free=2)])
    >>> [(r.region, r.open, r.floor, r.free_nodes) for r in found]
    [('eu', False, 1.15, 0), ('us', True, 0.9, 1)]
    """
    found = []
    for q in quotes:
        if q.gpu_model != pace.gpu_model or q.capacity != Capacity.SPOT:
            continue
        if pace.region != "any" and q.region != pace.region:
            continue
        seen = RegionQuote.read(
            q.region, clearing_price=q.clearing_price, reserve=q.reserve_price or 0.0,
            gpus_total=q.gpus_total, gpus_free=q.gpus_free,
            gpus_per_node=pace.gpu_count, cap=pace.cap, hysteresis=hysteresis,
        )  # fmt: skip
        found.append(seen)
    return tuple(sorted(found, key=lambda r: r.region))


def plan(
    pace: Pace,
    now: datetime,
    bid: BidResponse | None,
    allocations: list[AllocationResponse],
    quotes: list[QuoteResponse] | None = None,
    hysteresis: float = MarketTerms().hysteresis,
) -> Plan:
    """What the run should bid for now (see the module docstring); ``quotes``: the market's
    ``GET /prices``, every pool's quote (None: unknown, spot assumed open); ``hysteresis``:
    the market's margin (``MarketTerms``)."""
    restart_h = pace.restart_minutes / 60
    done, holding = done_hours(allocations, now.timestamp(), restart_h)
    on_demand_price = DEFAULT_CATALOG.get(pace.gpu_model).on_demand_price
    mode = PaceMode.WAIT
    if holding and bid is not None:
        mode = PaceMode.ON_DEMAND if bid.capacity == Capacity.ON_DEMAND else PaceMode.SPOT
    regions = region_quotes(pace, quotes, hysteresis) if quotes is not None else ()
    view = JobView(
        now_h=_hours(now - pace.origin),
        deadline_h=_hours(pace.deadline - pace.origin),
        work_h=pace.gpu_hours,
        done_h=done,
        restart_h=restart_h,
        step_h=PACE_SECONDS / 3600,
        mode=mode,
        ran=holding,
        cap=pace.cap,
        on_demand_price=on_demand_price,
        spot_open=quotes is None or any(r.open for r in regions),  # no spot pool: none open
        spot_floor=min((r.floor for r in regions), default=0.0),
        regions=regions,
    )
    action = get_policy(pace.policy)(view)  # from on-demand too: the policy weighs the restart
    if action.mode == PaceMode.ON_DEMAND and pace.on_demand_fallback:
        return Plan(PaceMode.ON_DEMAND, on_demand_price, view)
    price = pace.cap if action.mode != PaceMode.SPOT else min(pace.cap, action.bid)
    return Plan(PaceMode.SPOT, round(price, 4), view, action.region)


def _hours(delta: timedelta) -> float:
    return delta.total_seconds() / 3600
