"""Read-only queries of the routes (and of the route guard, ``roles``) that ``crud`` does not hold.

Each is a keyword-only ``verb_noun(*, session, ...)`` that reads and returns rows, never
writes and never commits; the route opens the transaction (a reading one for a ``GET``). The
routes call only these and ``crud``: no SQL is written in a route.
"""

from __future__ import annotations

from sqlalchemy import Connection, Row, func, select
from sqlalchemy.orm import Session

from prefect_spotgpu.protocol import HOLDING_STATUSES, AllocationStatus, BidStatus
from prefect_spotgpu.service.models import (
    AllocationRow,
    ApiKey,
    BidRow,
    NodeRow,
    PoolQuoteRow,
    PriceBar,
    Tenant,
)

_ACTIVE = tuple(s.value for s in AllocationStatus.active_statuses())


def list_tenants(*, session: Session) -> list[Tenant]:
    """Every tenant, oldest first."""
    return list(session.scalars(select(Tenant).order_by(Tenant.id)))


def get_bids(*, session: Session, bid_ids: set[int]) -> dict[int, BidRow]:
    """The bids of ``bid_ids``, by id."""
    return {b.id: b for b in session.scalars(select(BidRow).where(BidRow.id.in_(bid_ids)))}


def list_notice_reasons(*, session: Session, bid_ids: set[int]) -> dict[int, str]:
    """bid id -> the reason of its noticed allocation, for the bids of ``bid_ids`` that have
    one (what moves a bid to its migration target)."""
    if not bid_ids:
        return {}
    return dict(
        session.execute(
            select(AllocationRow.bid_id, AllocationRow.notice_reason).where(
                AllocationRow.bid_id.in_(bid_ids),
                AllocationRow.status == AllocationStatus.NOTICED.value,
            )
        ).all()
    )


def list_quotes(*, session: Session) -> list[PoolQuoteRow]:
    """Every pool's current quote, by model, region, then spot before on-demand."""
    return list(
        session.scalars(
            select(PoolQuoteRow).order_by(
                PoolQuoteRow.gpu_model, PoolQuoteRow.region, PoolQuoteRow.capacity.desc()
            )
        )
    )


def count_busy_gpus(*, session: Session) -> dict[int, int]:
    """node id -> the GPUs its running and noticed allocations hold (nodes with none left out)."""
    return dict(
        session.execute(
            select(AllocationRow.node_id, func.sum(AllocationRow.gpu_count))
            .where(AllocationRow.status.in_(HOLDING_STATUSES))
            .group_by(AllocationRow.node_id)
        ).all()
    )


def list_book_orders(
    *, session: Session, gpu_model: str, region: str, capacity: str
) -> list[Row[tuple[float, int, bool]]]:
    """A pool's order book, one ``(max_price, gpu_count, held)`` per open bid that may be placed
    in it: ``held`` when one of its active allocations is in this region; bids held in another
    pool are left out."""
    active = AllocationRow.status.in_(_ACTIVE)
    holding = select(AllocationRow.bid_id).where(active).scalar_subquery()
    here = (
        select(AllocationRow.bid_id)
        .join(NodeRow, NodeRow.id == AllocationRow.node_id)
        .where(active, NodeRow.region == region)
        .scalar_subquery()
    )
    return list(
        session.execute(
            select(BidRow.max_price, BidRow.gpu_count, BidRow.id.in_(here)).where(
                BidRow.status == BidStatus.OPEN,
                BidRow.gpu_model == gpu_model,
                BidRow.capacity == capacity,
                BidRow.region.in_((region, "any")),
                BidRow.id.in_(here) | BidRow.id.not_in(holding),  # not held in another pool
            )
        ).all()
    )


def list_minute_bars(
    *, session: Session, gpu_model: str, region: str | None, since_minute: int
) -> list[Row[tuple[int, float, float, float, float]]]:
    """``(minute, open, high, low, close)`` of a pool since ``since_minute``, oldest first; of
    every pool of the model (each region's bars) when ``region`` is None."""
    query = select(PriceBar.minute, PriceBar.open, PriceBar.high, PriceBar.low, PriceBar.close)
    query = query.where(PriceBar.gpu_model == gpu_model, PriceBar.minute >= since_minute)
    if region is not None:
        query = query.where(PriceBar.region == region)
    return list(session.execute(query.order_by(PriceBar.minute)).all())


def list_bar_regions(*, session: Session, gpu_model: str, since_minute: int) -> list[str]:
    """The regions whose pools of ``gpu_model`` have price bars since ``since_minute``."""
    query = select(PriceBar.region).where(
        PriceBar.gpu_model == gpu_model, PriceBar.minute >= since_minute
    )
    return sorted(session.scalars(query.distinct()))


def find_node_by_token(*, connection: Connection, token_hash: str) -> int | None:
    """The id of the node whose agent token hashes to ``token_hash``."""
    return connection.scalar(select(NodeRow.id).where(NodeRow.token_hash == token_hash))


def find_tenant_by_key(*, connection: Connection, key_hash: str) -> Row[tuple[int, bool]] | None:
    """``(id, provider)`` of the tenant with a live API key hashing to ``key_hash``."""
    return connection.execute(
        select(Tenant.id, Tenant.provider)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).first()
