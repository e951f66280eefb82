"""``deadline-aware``: uniform progress, across regions, with on-demand as a bridge
(docs/explanation/economics.md).

What it adds to ``uniform-progress`` (``deadline.py``), from what the market tells it:

1. **Every region at once.** It reads every region's quote (:class:`RegionQuote`) and bids in
   ``any`` region (``Action.region=None``): the market places it where a node fits now and, at
   a notice, reserves the migration target in any region before the job stops. Pinning the
   cheapest region measured worse: a pinned bid that has to move is a new bid and loses the
   reservation (``benchmarks/replay.py``).
2. **Its price follows the deadline**, as uniform progress: the cap when on pace or behind, a
   lower bid when far ahead (the dearer hours pass); holding GPUs, the cap (an eviction costs
   a restart). Shading a running bid under the clearing price, which the market's hysteresis
   would allow, was measured too: it is evicted at every rise of demand (74 preemptions a job).
3. **On-demand as a bridge, not an end.** When spot is open nowhere and the slack falls below
   ``BRIDGE_H``, it runs on on-demand capacity instead of waiting the slack away, and goes back
   to spot as soon as some region opens while the slack still pays for that start and for the
   one back. The deadline's last resort stays (:func:`must_finish_on_demand`), counting the
   migration when the checkpoint's region is closed.

Measured on the shared traces (``benchmarks/results/replay.json``), this is level with
uniform progress and greedy spot: on these traces availability binds and the demand is not
predictable from one replay's history, and what the lower bound has beyond it is mostly
foresight of supply (which zone stays up, when every zone goes dark), not of price
(README, "Market economics"). Example (10 h of work, deadline 20 h, cap 1.40,
restart 0.2 h, migration 0.5 h, steps of 0.5 h)::

    t=0   on pace, two regions open                        -> spot anywhere at 1.40
    t=4   2.6 h ahead, waiting                              -> spot anywhere at 1.05
    t=9   nothing open anywhere, slack 1.5 h < 2 h           -> on-demand (the bridge)
    t=10  on-demand, a region opens, slack 1.5 h > 2 starts  -> spot anywhere at 1.40
    t=19  slack below one start                              -> on-demand to the end
"""

from __future__ import annotations

from prefect_spotgpu.economics.deadline import (
    Action,
    JobView,
    PaceMode,
    uniform_progress,
)
from prefect_spotgpu.economics.deadline import must_finish_on_demand as _must_finish

BRIDGE_H = 2.0
"""Below this slack, a job that finds spot open nowhere runs on on-demand capacity until some
region opens again (it keeps its slack for later spot hours instead of waiting it away)."""


def must_finish_on_demand(view: JobView) -> bool:
    """``deadline.must_finish_on_demand`` with the next start's cost: a start away from the
    checkpoint pays the migration too (its region is closed now)."""
    return _must_finish(view, _start_h(view))


def deadline_aware(view: JobView, bridge_h: float = BRIDGE_H) -> Action:
    if must_finish_on_demand(view):
        return Action(PaceMode.ON_DEMAND)
    spot_open = any(q.open for q in view.regions) if view.regions else view.spot_open
    if view.mode == PaceMode.ON_DEMAND and view.ran:
        back = spot_open and view.slack_h - 2 * _start_h(view) - 2 * view.step_h > 0
        return Action(PaceMode.SPOT, view.cap) if back else Action(PaceMode.ON_DEMAND)
    if view.mode == PaceMode.SPOT and view.ran and not view.noticed:
        return Action(PaceMode.SPOT, view.cap)  # holding GPUs: keep them
    if not spot_open and view.slack_h < bridge_h:
        return Action(PaceMode.ON_DEMAND)  # the bridge
    paced = uniform_progress(view)
    return Action(paced.mode, paced.bid)  # region None: any region


def _start_h(view: JobView) -> float:
    """What the next spot start costs: a restart, and the migration when the checkpoint's
    region is not open (in a single-region view, never)."""
    home = view.checkpoint_region
    if home is None or not view.regions:
        return view.restart_h
    home_open = any(q.open for q in view.regions if q.region == home)
    return view.restart_h + (0.0 if home_open else view.migrate_h)
