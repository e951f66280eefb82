"""The one gate for every stateful row: allocations, bids and nodes change status only here.

Allocation status is changed only through :func:`set_allocation_status` (by the tick leader),
as a compare-and-set (``UPDATE ... WHERE id = :id AND status = :expected``) that also bumps the
allocation's epoch: agents and workers send ``(allocation id, epoch)`` with every report, and a
stale epoch is refused (the fencing token). A bid's status changes only through
:func:`set_bid_status` and a node's state only through :func:`set_node_state`, compare-and-set
too. The rules are plain data (``market.transitions``, ``protocol.BID_FROM_STATES``), checked
before any write; ``tests/test_architecture.py`` fails when any other module of the service
assigns a status or a state. The other allocation columns are written here too: new rows
(:func:`create_allocations`), charges (:func:`add_charges`), a durable checkpoint
(:func:`record_checkpoint`) and the outcome of the final save (:func:`record_final_save`).
The API only reads allocation rows.
"""

from __future__ import annotations

from sqlalchemy import Row, bindparam, insert, update
from sqlalchemy.orm import Session

from prefect_spotgpu.market import NodeState
from prefect_spotgpu.market.transitions import (
    ALLOCATION_FROM_STATES,
    ALLOCATION_NEW_STATES,
    NODE_FROM_STATES,
    refusal,
)
from prefect_spotgpu.protocol import (
    BID_FROM_STATES,
    DELIVERY_FROM_STATES,
    DELIVERY_NEW_STATES,
    AllocationStatus,
    BidStatus,
    DeliveryStatus,
    ReportOutcome,
)
from prefect_spotgpu.service.errors import Conflict, TransitionRejected
from prefect_spotgpu.service.models import AllocationRow, BidRow, NodeRow, WebhookDelivery

S = AllocationStatus
FINAL_BID_STATUSES = frozenset({BidStatus.CANCELLED, BidStatus.FINISHED})
FINAL_DELIVERY_STATUSES = frozenset({DeliveryStatus.DELIVERED, DeliveryStatus.FAILED})
HOLD_STATUSES = frozenset({BidStatus.OPEN, BidStatus.HELD})
"""The bid statuses whose ``hold_reason`` a change sets (held: why; open: none)."""


def check_transition(current: AllocationStatus, to: AllocationStatus) -> str | None:
    """The reason a transition is refused, or None when it is allowed."""
    terminal = frozenset(s for s in AllocationStatus if s.is_terminal())
    return refusal("allocation", current, to, ALLOCATION_FROM_STATES, terminal)


def set_bid_status(
    *,
    session: Session,
    bid_id: int,
    expected: BidStatus,
    to: BidStatus,
    reason: str | None = None,
    whole_gang: bool = True,
    **fields: object,
) -> bool:
    """Move the bid (with ``whole_gang``, every member row of its gang) from ``expected`` to
    ``to`` (held or open: with ``reason`` as its ``hold_reason``), compare-and-set; whether a
    row was ``expected`` and changed. A transition ``BID_FROM_STATES`` refuses raises."""
    why = refusal(f"bid {bid_id}", expected, to, BID_FROM_STATES, FINAL_BID_STATUSES)
    if why is not None:
        raise TransitionRejected(why)
    rows = (BidRow.id == bid_id) | (BidRow.gang_id == bid_id) if whole_gang else BidRow.id == bid_id
    values = {"status": to.value, **fields}
    if to in HOLD_STATUSES:
        values["hold_reason"] = reason
    return bool(
        session.execute(
            update(BidRow)
            .where(rows, BidRow.status == expected.value)
            .values(**values)
            .execution_options(synchronize_session="evaluate")
        ).rowcount
    )


def set_node_state(*, session: Session, node: NodeRow, to: NodeState, **fields: object) -> None:
    """Move ``node`` from the state it was read in to ``to`` (and set ``fields``),
    compare-and-set: ``Conflict`` when its state changed meanwhile, ``TransitionRejected``
    when ``NODE_FROM_STATES`` refuses the change."""
    expected = NodeState(node.state)
    why = refusal(f"node {node.id}", expected, to, NODE_FROM_STATES)
    if why is not None:
        raise TransitionRejected(why)
    changed = session.execute(
        update(NodeRow)
        .where(NodeRow.id == node.id, NodeRow.state == expected.value)
        .values(state=to.value, **fields)
        .execution_options(synchronize_session="evaluate")
    ).rowcount
    if not changed:
        raise Conflict(f"node {node.id} is no longer {expected.value}; its state changed")


def create_deliveries(*, session: Session, rows: list[dict]) -> None:
    """Insert new webhook deliveries (one statement for the lot), each pending."""
    for row in rows:
        if DeliveryStatus(row["status"]) not in DELIVERY_NEW_STATES:
            raise TransitionRejected(f"a webhook delivery cannot be created {row['status']}")
    if rows:
        session.execute(insert(WebhookDelivery), rows)


def set_delivery_status(
    *, session: Session, delivery_id: int, attempts: int, to: DeliveryStatus, **fields: object
) -> bool:
    """Record how attempt ``attempts`` of a pending delivery went: ``to`` (pending again for
    a retry, delivered, or failed) and ``fields``, compare-and-set on its status and its
    attempts, so only the attempt that claimed it records; whether it did. A transition
    ``DELIVERY_FROM_STATES`` refuses raises."""
    expected = DeliveryStatus.PENDING
    why = refusal(
        f"webhook delivery {delivery_id}", expected, to, DELIVERY_FROM_STATES,
        FINAL_DELIVERY_STATUSES,
    )  # fmt: skip
    if why is not None:
        raise TransitionRejected(why)
    return bool(
        session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.status == expected.value,
                WebhookDelivery.attempts == attempts,
            )
            .values(status=to.value, **fields)
            .execution_options(synchronize_session=False)
        ).rowcount
    )


def create_allocations(*, session: Session, rows: list[dict]) -> None:
    """Insert new allocations (one statement for the lot), each RUNNING or RESERVED, epoch 1."""
    for row in rows:
        status = AllocationStatus(row["status"])
        if status not in ALLOCATION_NEW_STATES:
            raise TransitionRejected(f"an allocation cannot be created {status.value}")
        row["epoch"] = 1
    if rows:
        session.execute(insert(AllocationRow), rows)


RETURNED = (
    AllocationRow.epoch,
    AllocationRow.tenant_id,
    AllocationRow.bid_id,
    AllocationRow.node_id,
    AllocationRow.gpu_count,
    AllocationRow.started_at,
    AllocationRow.last_checkpoint_at,
    AllocationRow.price,
)
"""What a status change returns about the row it changed."""


def set_allocation_status(
    *,
    session: Session,
    allocation_id: int,
    expected: AllocationStatus,
    to: AllocationStatus,
    **fields: object,
) -> Row:
    """Move one allocation from ``expected`` to ``to`` (and set ``fields``), or raise.

    Returns the row's new epoch and the columns in ``RETURNED``.
    """
    reason = check_transition(expected, to)
    if reason is not None:
        raise TransitionRejected(f"allocation {allocation_id}: {reason}")
    row = session.execute(
        update(AllocationRow)
        .where(AllocationRow.id == allocation_id, AllocationRow.status == expected.value)
        .values(status=to.value, epoch=AllocationRow.epoch + 1, **fields)
        .returning(*RETURNED)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        raise Conflict(
            f"allocation {allocation_id} is no longer {expected.value}; its status changed"
        )
    return row


def add_charges(*, session: Session, rows: list[dict]) -> None:
    """Add accrued charges to allocations (one executemany per kind of row).

    Each row is ``b_id``, ``b_amount`` (micros), ``b_seconds``, and ``b_price``, ``b_until``,
    ``b_carry``. Running allocations also get their price in force, ``charged_until`` and
    ``charge_carry`` (written together, so a restarted leader bills from exactly there); those
    that ended this tick (``b_price`` None) keep what their ending wrote.
    """
    table = AllocationRow.__table__
    running = [r for r in rows if r["b_price"] is not None]
    ended = [
        {k: r[k] for k in ("b_id", "b_amount", "b_seconds")} for r in rows if r["b_price"] is None
    ]
    added = {
        "charged_micros": table.c.charged_micros + bindparam("b_amount"),
        "charged_seconds": table.c.charged_seconds + bindparam("b_seconds"),
    }
    if running:
        session.execute(
            table.update()
            .where(table.c.id == bindparam("b_id"))
            .values(
                **added,
                price=bindparam("b_price"),
                charged_until=bindparam("b_until"),
                charge_carry=bindparam("b_carry"),
            ),
            running,
        )
    if ended:
        session.execute(
            table.update().where(table.c.id == bindparam("b_id")).values(**added), ended
        )


def record_checkpoint(*, alloc: AllocationRow, checkpoint_at: float, paid_micros: int) -> None:
    """A durable checkpoint at ``checkpoint_at``, when it is newer than the last one: what the
    allocation had paid by now (``paid_micros``) is no longer at risk (compensation never
    covers work that was saved). An older checkpoint changes nothing."""
    if checkpoint_at > (alloc.last_checkpoint_at or 0.0):
        alloc.last_checkpoint_at = checkpoint_at
        alloc.paid_at_checkpoint_micros = paid_micros


FINAL_SAVES = {ReportOutcome.SAVED: "ok", ReportOutcome.SAVE_FAILED: "failed"}
"""An allocation's ``final_save`` after each final-save report of its agent."""


def record_final_save(*, alloc: AllocationRow, outcome: ReportOutcome) -> None:
    alloc.final_save = FINAL_SAVES[outcome]
