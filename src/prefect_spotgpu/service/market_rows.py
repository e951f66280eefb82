"""Database rows as ``market`` objects, and the leader's market rebuilt cold from them.

The one place a row becomes a market ``Node``, ``Bid`` or ``Allocation``: the cold rebuild
(:func:`load_market`, when a replica becomes leader or a tick failed) and the changes the
leader applies at each tick both build them here. Reads only; nothing here writes a row.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from prefect_spotgpu.economics.schedules import aware
from prefect_spotgpu.market import Allocation as MarketAllocation
from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    Interval,
    Market,
    MarketConfig,
    Node,
    NodeState,
)
from prefect_spotgpu.protocol import HELD_FOR_CREDIT, BidStatus, Capacity, normal_image_reference
from prefect_spotgpu.service.models import AllocationRow, BidRow, NodeRow
from prefect_spotgpu.service.settings import ServiceSettings


def _normal(image: str | None) -> str | None:
    return None if image is None else normal_image_reference(image)


def market_node(row: NodeRow) -> Node:
    """The node as the market sees it (its state as the row has it now)."""
    return Node(
        row.id,
        row.gpu_model,
        row.region,
        row.gpu_count,
        row.reserve_price,
        NodeState(row.state),
        row.capacity,
        frozenset(normal_image_reference(i) for i in row.images or ()),
        runner=row.runner,
        default_image=row.default_image is not None,
        job_network=row.job_subnet is not None,
    )


def market_bid(row: BidRow) -> Bid:
    window = None
    if row.window_start is not None and row.window_end is not None:
        window = Interval(aware(row.window_start).timestamp(), aware(row.window_end).timestamp())
    return Bid(
        id=row.id,
        gpu_model=row.gpu_model,
        gpu_count=row.gpu_count,
        max_price=row.max_price,
        region=row.region,
        created_at=aware(row.created_at).timestamp(),
        window=window,
        deadline=aware(row.deadline).timestamp() if row.deadline else None,
        tenant_id=row.tenant_id,
        capacity=row.capacity,
        image=_normal((row.job or {}).get("image")),
        node_count=row.node_count,
        gang_id=row.gang_id,
        min_node_count=row.min_node_count if row.node_count > 1 else None,
    )


def add_bid_row(market: Market, row: BidRow) -> None:
    """Add the row's bid to ``market`` (raising ``ValueError`` as ``Market.add_bid`` does).

    A gang's member may carry another price than its rank 0 when a reprice committed between
    the two reads (PostgreSQL's read committed; in ``load_market``, between its two queries).
    The gang then takes the member's price, so the member still shares every term of it
    instead of being held; the reprice's outbox change, still to be applied, settles the price
    to the database's."""
    bid = market_bid(row)
    joins_a_gang = bid.gang_id not in (None, bid.id) and market.has_bid(bid.gang_id)
    if joins_a_gang and market.bid_price(bid.gang_id) != bid.max_price:
        market.reprice_bid(bid.gang_id, bid.max_price)
    market.add_bid(bid)


def market_allocation(row: AllocationRow) -> MarketAllocation:
    return MarketAllocation(
        id=row.id,
        bid_id=row.bid_id,
        node_id=row.node_id,
        gpu_count=row.gpu_count,
        status=AllocationStatus(row.status),
        started_at=row.started_at,
        charged_until=row.charged_until,
        charge_carry=row.charge_carry,
        price=row.price,
        deadline=row.deadline,
        notice_reason=row.notice_reason,
        kind=row.kind,
        # what its charges have not covered yet (a leader's unwritten charges it bills again)
        notice_fee_owed=max(0, row.notice_fee_micros - row.charged_micros),
    )


def load_market(*, session: Session, settings: ServiceSettings) -> Market:
    """The in-memory market as the database has it (leader start, or after a failure).

    Plain bids (no window, no deadline, one node) are read as columns and bulk-loaded per
    pool; the rest one by one, in id order (a gang's rank 0 first). Bids that are cancelled
    or held but still hold GPUs are loaded too, with every member of their gang: their
    ``market_changes`` row (still in the outbox) ends them at this tick.
    """
    highest = session.scalar(select(AllocationRow.id).order_by(AllocationRow.id.desc()))
    config = MarketConfig(
        hysteresis=settings.hysteresis,
        notice_seconds=settings.notice_seconds,
        open_regions=True,
    )
    market = Market(config, next_allocation_id=(highest or 0) + 1)
    for node in session.scalars(select(NodeRow).order_by(NodeRow.id)):
        market.upsert_node(market_node(node))
    active = tuple(s.value for s in AllocationStatus.active_statuses())
    allocs = list(
        session.scalars(
            select(AllocationRow).where(AllocationRow.status.in_(active)).order_by(AllocationRow.id)
        )
    )
    holding = {a.bid_id for a in allocs}
    plain = (
        BidRow.window_start.is_(None)
        & BidRow.deadline.is_(None)
        & (BidRow.capacity == Capacity.SPOT.value)
        & (BidRow.node_count == 1)
    )
    columns = session.execute(
        select(
            BidRow.id,
            BidRow.tenant_id,
            BidRow.gpu_model,
            BidRow.region,
            BidRow.gpu_count,
            BidRow.max_price,
            BidRow.created_at,
            BidRow.job["image"].as_string().label("image"),
        )
        .where(BidRow.status == BidStatus.OPEN, plain)
        .order_by(BidRow.id)
    ).all()
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for row in columns:
        groups[(row.gpu_model, row.region)].append(row)
    loaded = set()
    for (model, region), rows in sorted(groups.items()):
        market.add_bid_arrays(
            gpu_model=model,
            region=region,
            ids=np.array([r.id for r in rows], np.int64),
            gpu_counts=np.array([r.gpu_count for r in rows], np.int64),
            max_prices=np.array([r.max_price for r in rows], np.float64),
            created_at=np.array([aware(r.created_at).timestamp() for r in rows]),
            tenant_ids=np.array([r.tenant_id for r in rows], np.int64),
            images=[_normal(r.image) for r in rows],
        )
        loaded.update(r.id for r in rows)
    others = list(
        session.scalars(
            select(BidRow).where((BidRow.status == BidStatus.OPEN) & ~plain).order_by(BidRow.id)
        )
    )
    missing = holding - loaded - {b.id for b in others}  # cancelled or held, holding GPUs
    others += [session.get(BidRow, bid_id) for bid_id in sorted(missing)]
    gang_ids = {b.gang_id for b in others if b.gang_id is not None}
    if gang_ids:  # a gang is loaded whole, or not at all
        others += session.scalars(
            select(BidRow).where(
                BidRow.gang_id.in_(gang_ids), BidRow.id.not_in({b.id for b in others})
            )
        )
    for row in sorted(others, key=lambda b: b.id):
        add_bid_row(market, row)
    for a in allocs:
        market.load_allocation(market_allocation(a))
    for row in others:  # held for credit while it still holds GPUs: it leaves once idle
        credit_held = row.status == BidStatus.HELD and is_credit_hold(row.hold_reason)
        if credit_held and market.has_bid(row.id) and not market.holds.is_held(row.id):
            market.holds.hold_bid(row.id)
    market.compact()
    return market


def is_credit_hold(reason: str | None) -> bool:
    """Whether a held bid's ``hold_reason`` says its tenant's credit ran short."""
    return bool(reason) and reason.startswith(HELD_FOR_CREDIT)
