"""PURE: the texts and figures the worker shows of a run's bids — the cost report (its
allocations table and markdown summary), the quote line, a bid described in words.

No Prefect, no HTTP: ``attempt.py`` publishes the report as the run's artifacts, and the
rules (``reactions.py``) and placement (``placement.py``) use the words.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.messages import AllocationResponse, BidResponse, QuoteResponse
from prefect_spotgpu.protocol import AllocationStatus, Capacity


@dataclass(frozen=True, slots=True)
class BidCosts:
    """What a bid cost against the same GPU-hours on demand (money in the market's units)."""

    gpu_hours: float
    spot_cost: float
    on_demand_cost: float
    on_demand_price: float
    saving: float | None  # 1 - spot / on demand (None: nothing ran)
    preemptions: int
    final_saves_ok: int
    work_lost_seconds: float  # since the last checkpoint, of preemptions without a final save


def bid_costs(bid: BidResponse, allocations: list[AllocationResponse]) -> BidCosts:
    """A bid's spot cost against the same GPU-hours on-demand, its preemptions, final saves
    and the work lost (seconds since the last checkpoint of preemptions without a final save).
    """
    on_demand_price = DEFAULT_CATALOG.get(bid.gpu_model).on_demand_price
    spot = sum(a.charged_amount for a in allocations)
    gpu_hours = sum(a.charged_seconds * a.gpu_count for a in allocations) / 3600
    preempted = [a for a in allocations if a.status == AllocationStatus.PREEMPTED]
    lost = sum(
        a.ended_at - max(a.last_checkpoint_at or a.started_at, a.started_at)
        for a in preempted
        if a.final_save != "ok" and a.ended_at is not None
    )
    on_demand = gpu_hours * on_demand_price
    return BidCosts(
        gpu_hours=gpu_hours,
        spot_cost=spot,
        on_demand_cost=on_demand,
        on_demand_price=on_demand_price,
        saving=1 - spot / on_demand if on_demand > 0 else None,
        preemptions=len(preempted),
        final_saves_ok=sum(a.final_save == "ok" for a in allocations),
        work_lost_seconds=lost,
    )


def _bids(allocations: list[AllocationResponse], bid: BidResponse) -> str:
    ids = sorted({a.bid_id for a in allocations} | {bid.id})
    return f"bid {ids[0]}" if len(ids) == 1 else "bids " + ", ".join(map(str, ids))


def allocation_report(
    bid: BidResponse, allocations: list[AllocationResponse]
) -> tuple[list[dict], str]:
    """Rows for the allocations table and the markdown summary of the cost of a run's bid (and
    of the bids it replaced, whose allocations come with it): what was paid, on spot or
    on-demand, against the same GPU-hours all on-demand. A gang's table has one row per member
    allocation, with its ``rank``; its GPU-hours and cost are every member's."""
    rows = []
    gang = any(a.rank is not None for a in allocations)
    for a in sorted(allocations, key=lambda a: a.id):
        if a.status in (AllocationStatus.RESERVED, AllocationStatus.RELEASED):
            continue
        end = a.ended_at
        rows.append(
            {
                "allocation": a.id,
                "bid": a.bid_id,
                **({"rank": a.rank} if gang else {}),
                "node": a.node_id,
                "gpu": f"{a.gpu_count} x {bid.gpu_model}",
                "start": iso(a.started_at),
                "end": iso(end) if end else AllocationStatus.RUNNING.value,
                "status": a.status,
                "price": round(a.price, 4),
                "cost": round(a.charged_amount, 6),
            }
        )
    c = bid_costs(bid, allocations)
    saving = "n/a" if c.saving is None else f"{c.saving:.0%}"
    summary = "\n".join(
        [
            f"### GPU cost of {_bids(allocations, bid)}",
            "",
            "| | |",
            "|---|---|",
            f"| GPUs | {describe(bid)} |",
            f"| GPU-hours | {c.gpu_hours:.4f} |",
            f"| Cost paid | {c.spot_cost:.6f} |",
            f"| On-demand cost | {c.on_demand_cost:.6f} (at {c.on_demand_price:.2f}/GPU-h) |",
            f"| Saving | {saving} |",
            f"| Preemptions | {c.preemptions} |",
            f"| Work lost | {c.work_lost_seconds:.1f} s (preemptions without a final save) |",
        ]
    )
    return rows, summary


def quote_summary(bid: BidResponse, quotes: list[QuoteResponse]) -> tuple[str, bool]:
    """A line on the pools a bid can run in, and whether none of them accepts its price (its
    maximum is below every node's reserve: it would wait for ever).

        >>> pool = QuoteResponse(gpu_model="A100-80G", region="eu-west", capacity="spot",
        ...     clearing_price=None, reserve_price=0.9, on_demand_price=2.1, gpus_total=1,
        ...     gpus_free=1, gpus_running=0, waiting_bids=0)
        >>> bid = BidResponse.model_construct(  # the fields it reads
        ...     gpu_model="A100-80G", region="any", capacity="spot", max_price=0.4)
        >>> text, refused = quote_summary(bid, [pool])
        >>> refused, text.split(": ")[0]
        (True, 'no A100-80G node in any region accepts 0.40 per GPU-hour')
        >>> text.split(": ")[1]
        'the lowest reserve is 0.90; raise max_price to at least 0.90'
        >>> quote_summary(bid.model_copy(update={"max_price": 1.2}), [pool])
        ('market from 0.90 per GPU-hour, 1 GPU free', False)
    """
    pools = [
        q
        for q in quotes
        if q.gpu_model == bid.gpu_model
        and bid.region in ("any", q.region)
        and q.capacity == bid.capacity
    ]
    if not pools:
        kind = "on-demand " if bid.capacity == Capacity.ON_DEMAND else ""
        return f"no {kind}{bid.gpu_model} nodes in {bid.region} yet", False
    reserves = [q.reserve_price for q in pools if q.reserve_price is not None]
    if reserves and bid.capacity == Capacity.SPOT and bid.max_price < min(reserves):
        where = "any region" if bid.region == "any" else bid.region
        return (
            f"no {bid.gpu_model} node in {where} accepts {bid.max_price:.2f} per "
            f"GPU-hour: the lowest reserve is {min(reserves):.2f}; raise max_price to at "
            f"least {min(reserves):.2f}"
        ), True
    free = sum(q.gpus_free for q in pools)
    prices = [q.clearing_price or q.reserve_price for q in pools]
    prices = [p for p in prices if p is not None]
    price = f"from {min(prices):.2f}" if prices else "no price yet"
    return f"market {price} per GPU-hour, {free} GPU{'' if free == 1 else 's'} free", False


def lead_allocations(allocations: list[AllocationResponse]) -> list[AllocationResponse]:
    """A bid's allocations that measure its run's progress: all of a one-node bid's, rank 0's
    of a gang (its members run side by side: one hour of the gang is one hour of work)."""
    return [a for a in allocations if a.rank in (None, 0)]


def describe(bid: BidResponse) -> str:
    """A bid in words: its GPUs (and nodes), region and price."""
    gpus = f"{bid.gpu_count} x {bid.gpu_model}"
    if bid.node_count > 1:
        gpus = f"{bid.node_count} nodes of {gpus}"
        if bid.min_node_count is not None and bid.min_node_count < bid.node_count:
            gpus += f" (going on with {bid.min_node_count} or more)"
    if bid.capacity == Capacity.ON_DEMAND:
        return f"{gpus} in {bid.region}, on-demand at {bid.max_price:.2f} per GPU-hour"
    return f"{gpus} in {bid.region}, at most {bid.max_price:.2f} per GPU-hour"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")
