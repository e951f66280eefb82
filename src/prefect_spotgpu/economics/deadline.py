"""Deadline-aware bidding: the cheapest capacity that still finishes on time.

A job with ``work_h`` hours of GPU work and a deadline is steered, step by step, by a named
policy (docs/development/code-style.md#style-8: a small registry; an unknown name fails listing the
valid ones). Each step the policy sees a :class:`JobView` and answers an :class:`Action`: bid on
spot at some price (at most the user's cap), run on on-demand capacity (a non-preemptible pool at
the on-demand price), or wait.

``uniform-progress`` is ours, in the spirit of Uniform Progress (Wu et al., "Can't Be Late:
Optimizing Spot Instance Savings under Deadlines", NSDI '24): progress should keep pace with
the clock (``work * elapsed / deadline``). Holding spot GPUs, it bids the cap, so it is not
evicted (every eviction costs a restart). Not holding any, it enters at the cap when on pace or
behind, and at a lower base (75 % of the cap) when far ahead (more than a quarter of the work),
so a lead is spent waiting for the cheaper hours instead of buying the dear ones. Once the slack
can no longer absorb one more restart it runs on on-demand capacity to the end. Example (10 h
of work, deadline 20 h, cap 1.20, restart 0.2 h, steps of 0.5 h)::

    t=4.0  done 4.6  expected 2.0  2.6 h ahead, idle  -> spot, bid 0.90 (the base)
    t=4.0  done 3.25 expected 2.0  1.25 h ahead, idle -> spot, bid 1.05
    t=4.0  done 2.0  expected 2.0  on pace            -> spot, bid 1.20 (the cap)
    t=6.0  running on spot                            -> spot, bid 1.20 (keep it)
    t=15.0 done 5.0  left 5.0, slack 0.0 < 0.7        -> on-demand to the end

``greedy-spot`` bids the cap whenever it can and turns to on-demand only when the deadline
forces it; ``always-on-demand`` is the baseline every saving is measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class RegionQuote:
    """One region's pool as a policy sees it at one step (what the market's quotes and order
    book say, and the forecast from the prices seen so far: nothing of the future)."""

    region: str
    open: bool  # a bid at the cap would hold GPUs there now
    floor: float  # the lowest price that can win there now, per GPU-hour
    free_nodes: int = 0  # nodes free for the job's size there now
    forecast: float | None = None  # expected clearing price, next hours (None: no history)

    @classmethod
    def read(
        cls,
        region: str,
        *,
        clearing_price: float | None,
        reserve: float,
        gpus_total: int,
        gpus_free: int,
        gpus_per_node: int,
        cap: float,
        hysteresis: float,
        mine: bool = False,
        forecast: float | None = None,
    ) -> RegionQuote:
        """A pool's quote as a policy reads it (the replay's and the worker's one rule): open
        when a bid at ``cap`` would hold GPUs there now (it holds some already, a node's worth
        is free, or the cap beats the clearing price by the hysteresis margin), and the floor,
        the lowest price that can win there now."""
        floor = max(reserve, clearing_price or reserve)
        outbids = floor * (1 + hysteresis) < cap
        free_nodes = gpus_free // max(1, gpus_per_node)
        is_open = gpus_total > 0 and (mine or free_nodes > 0 or outbids)
        return cls(region, is_open, floor, free_nodes, forecast)


class PaceMode(StrEnum):
    """What a paced run does for a step (a policy's ``Action``, the ``JobView`` of the last)."""

    SPOT = "spot"
    """Bid on spot capacity (at most ``Action.bid``)."""
    ON_DEMAND = "on_demand"
    """Run on on-demand capacity at its price."""
    WAIT = "wait"
    """Hold no GPUs this step."""


@dataclass(frozen=True, slots=True)
class JobView:
    """What a policy knows at one step; times in hours since the job was submitted."""

    now_h: float
    deadline_h: float
    work_h: float
    done_h: float
    restart_h: float  # lost at every (re)start: provisioning, image, restore
    step_h: float  # time until the next decision
    mode: PaceMode  # what ran during the last step
    ran: bool  # whether it actually made progress during the last step
    cap: float  # the user's maximum spot price per GPU-hour
    on_demand_price: float
    spot_open: bool = True  # the pool's last quote: a bid at the cap would hold GPUs now
    spot_floor: float = 0.0  # the pool's last quote: the lowest price that can win now
    regions: tuple[RegionQuote, ...] = ()  # every region the job may run in (multi-region)
    region: str | None = None  # where it ran on spot during the last step (None: nowhere)
    migrate_h: float = 0.0  # lost on top of restart_h when it resumes in another region
    noticed: bool = False  # its spot allocation got a notice during the last step
    checkpoint_region: str | None = None  # where it last made progress on spot (None: nowhere)

    @property
    def left_h(self) -> float:
        return max(0.0, self.work_h - self.done_h)

    @property
    def slack_h(self) -> float:
        """Time to spare if the rest ran without a pause from now on."""
        return self.deadline_h - self.now_h - self.left_h

    @property
    def behind_h(self) -> float:
        """How far progress trails the uniform pace (negative: ahead)."""
        return self.work_h * min(1.0, self.now_h / self.deadline_h) - self.done_h


@dataclass(frozen=True, slots=True)
class Action:
    mode: PaceMode
    bid: float = 0.0  # the spot bid's maximum price, for mode "spot"
    region: str | None = None  # the spot bid's region (None: the job's own, or any region)


Policy = Callable[[JobView], Action]


def must_finish_on_demand(view: JobView, start_h: float | None = None) -> bool:
    """Whether the slack can no longer absorb one more start (and a step of bad luck);
    ``start_h``: what that start costs (default: a restart)."""
    start = view.restart_h if start_h is None else start_h
    if view.mode == PaceMode.ON_DEMAND and view.ran and view.slack_h < 2 * start + view.step_h:
        return True  # already there: switching back would cost a start we cannot afford
    return view.slack_h <= start + view.step_h


def always_on_demand(view: JobView) -> Action:
    return Action(PaceMode.ON_DEMAND)


def greedy_spot(view: JobView) -> Action:
    if must_finish_on_demand(view):
        return Action(PaceMode.ON_DEMAND)
    return Action(PaceMode.SPOT, view.cap)


def uniform_progress(view: JobView, base_fraction: float = 0.75) -> Action:
    if must_finish_on_demand(view):
        return Action(PaceMode.ON_DEMAND)
    if view.mode == PaceMode.SPOT and view.ran:
        return Action(PaceMode.SPOT, view.cap)  # holding GPUs: keep them (eviction: a restart)
    base = view.cap * base_fraction
    lead = 0.25 * view.work_h  # ahead by more than this: start only on the cheaper hours
    behind = min(1.0, max(0.0, (view.behind_h + lead) / lead))
    return Action(PaceMode.SPOT, round(base + (view.cap - base) * behind, 4))
