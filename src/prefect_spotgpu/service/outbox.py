"""The ``market_changes`` outbox: how an API write reaches the tick leader's market.

A write the leader must see (a bid, a node, an agent's report, a credit) also records a change
here (:func:`record_change`), in the writer's own transaction, so nothing accepted is lost. A
change only marks a row dirty: the row itself says what to do, so applying a change twice is
harmless. The leader reads them in order (:func:`take_changes`), applies them
(:mod:`~prefect_spotgpu.service.changes`) and deletes them in the same tick transaction
(:func:`clear_changes`).
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from prefect_spotgpu.service.models import MarketChange


class Entity(StrEnum):
    """What a change is about (its ``entity_id`` is that row's id)."""

    NODE = "node"
    """Registered, offered, drained, reclaimed, repriced or back from lost (op ``upsert``)."""
    BID = "bid"
    """Created, repriced or cancelled (op ``create``, ``reprice``, ``cancel``)."""
    ALLOCATION = "allocation"
    """An agent's report (op: its ``ReportOutcome``; data: ``at``, ``epoch``,
    ``checkpoint_at``, ``cause``)."""
    TENANT = "tenant"
    """Credited (op ``credit``) or its webhook changed (op ``webhook``)."""


def record_change(
    *, session: Session, entity: str, entity_id: int, op: str, data: dict | None = None
) -> None:
    session.add(MarketChange(entity=entity, entity_id=entity_id, op=op, data=data))


def take_changes(*, session: Session) -> list[MarketChange]:
    """Every change not applied yet, oldest first."""
    return list(session.scalars(select(MarketChange).order_by(MarketChange.id)))


def clear_changes(*, session: Session, changes: list[MarketChange]) -> None:
    """Delete the changes applied (those recorded meanwhile stay for the next tick)."""
    if changes:
        session.execute(
            delete(MarketChange).where(MarketChange.id.in_([c.id for c in changes])),
            execution_options={"synchronize_session": False},  # the tick holds them no more
        )
