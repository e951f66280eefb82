"""``deadline-aware``: the bidding policy that uses what the market tells it (issue 20).

Greedy spot bids the cap in one place and waits there; on the traces availability binds, not
price, so the lever is *where* to run. Each step this policy reads every region's quote
(:class:`~prefect_spotgpu.economics.deadline.RegionQuote`: open at the cap or not, the floor
that wins now, the free nodes, the forecast) and the deadline's slack:

1. **The deadline first.** When the slack can no longer absorb one more start (a restart, plus
   the migration when the checkpoint would move regions) and a step of bad luck, it runs on
   on-demand capacity to the end (:func:`must_finish_on_demand`).
2. **Holding GPUs, keep them**: bid the cap where it runs (an eviction costs a restart), unless
   a notice came: then the job resumes wherever step 3 says.
3. **Not holding any, go where capacity is, at the best price.** Among the open regions, the one
   whose floor is cheapest for the rest of the work, counting the migration's lost time (at
   that region's floor) when it is not where the checkpoint is. Bid the cap there, so the job
   is placed now and kept; with plenty of slack (more than ``patience`` of the work left) and a
   floor dearer than the region's forecast, it bids the forecast instead and lets the dearer
   hours pass. No region open: bid the cap in every region at once (``region=None``, the
   market's ``any``), so the first capacity anywhere takes it.

Example (10 h of work, deadline 20 h, cap 1.40, restart 0.2 h, migration 0.5 h, steps of
0.5 h; regions a and b)::

    t=0   nothing ran; a open at 1.10, b open at 0.95     -> spot in b at 1.40 (cheaper)
    t=3   running in b                                    -> spot in b at 1.40 (keep it)
    t=4   noticed in b; a open at 1.00, b closed          -> spot in a at 1.40 (migrate)
    t=6   nothing open anywhere                           -> spot anywhere at 1.40
    t=18  4 h left, slack below a start                   -> on-demand to the end
"""

from __future__ import annotations

from prefect_spotgpu.economics.deadline import Action, JobView, RegionQuote

PATIENCE = 0.5
"""The share of the remaining work the slack must exceed before the policy lets dear hours
pass (bids the forecast instead of the cap)."""


def must_finish_on_demand(view: JobView) -> bool:
    """Whether the slack can no longer absorb one more start and a step of bad luck.

    A start elsewhere than the checkpoint also pays the migration: the margin counts it when
    the job would have to move (it ran in a region and that region is closed now)."""
    start = view.restart_h + (view.migrate_h if _would_migrate(view) else 0.0)
    if view.mode == "on_demand" and view.ran and view.slack_h < 2 * start + view.step_h:
        return True  # already there: switching back would cost a start we cannot afford
    return view.slack_h <= start + view.step_h


def deadline_aware(view: JobView, patience: float = PATIENCE) -> Action:
    if must_finish_on_demand(view):
        return Action("on_demand")
    home = _checkpoint_region(view)
    if view.mode == "spot" and view.ran and not view.noticed:
        return Action("spot", view.cap, home)  # holding GPUs: keep them
    quotes = _quotes(view)
    open_ = [q for q in quotes if q.open]
    if not open_:
        return Action("spot", view.cap, quotes[0].region if len(quotes) == 1 else None)
    best = min(open_, key=lambda q: _cost_of_the_rest(view, q, home))
    bid = view.cap
    if (
        view.slack_h > patience * view.left_h
        and best.forecast is not None
        and best.floor > best.forecast
    ):
        bid = min(view.cap, best.forecast)  # below the floor: the dear hours pass
    return Action("spot", round(bid, 4), best.region)


def _quotes(view: JobView) -> tuple[RegionQuote, ...]:
    """Every region's quote; a single-region view's own quote as one region (named None)."""
    if view.regions:
        return view.regions
    return (RegionQuote(None, view.spot_open, view.spot_floor),)  # type: ignore[arg-type]


def _checkpoint_region(view: JobView) -> str | None:
    return view.region


def _would_migrate(view: JobView) -> bool:
    home = _checkpoint_region(view)
    if home is None or not view.regions:
        return False
    return not any(q.open for q in view.regions if q.region == home)


def _cost_of_the_rest(view: JobView, quote: RegionQuote, home: str | None) -> float:
    """What the rest of the work costs in ``quote``'s region at its floor: the work left,
    a restart, and the migration when the checkpoint is elsewhere."""
    hours = view.left_h + view.restart_h
    if home is not None and quote.region != home:
        hours += view.migrate_h
    return hours * max(quote.floor, 0.0)
