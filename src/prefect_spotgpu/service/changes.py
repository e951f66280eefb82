"""What changes the tick leader's market between two clearings: the outbox's changes, applied
in order, and the nodes whose heartbeats stopped.

Each change names a row (``outbox.Entity``); the row, read now, says what to do, so a change
applied twice does nothing more. An agent's report (checked by the API: its own allocation, its
current epoch) may end the allocation at once and, when the loss was the platform's,
compensate it. Writes go through the tick's :class:`~prefect_spotgpu.service.tick_writes.
TickWrites` (allocations through ``gate``) and the ledger.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from prefect_spotgpu.market import ANY_REGION, NodeState
from prefect_spotgpu.market.compensation import LossCause
from prefect_spotgpu.protocol import (
    HELD_UNSERVED,
    LIVE_BID_STATUSES,
    AllocationStatus,
    BidStatus,
    EndReason,
    EventKind,
    NoticeReason,
    ReportOutcome,
)
from prefect_spotgpu.service import credit, gangs, gate
from prefect_spotgpu.service.market_rows import (
    add_bid_row,
    is_credit_hold,
    market_bid,
    market_node,
)
from prefect_spotgpu.service.models import AllocationRow, BidRow, MarketChange, NodeRow
from prefect_spotgpu.service.outbox import Entity
from prefect_spotgpu.service.tick_writes import TickWrites

logger = logging.getLogger("prefect_spotgpu.service.ticker")  # the tick loop's log

S = AllocationStatus


def read_bid_rows(session: Session, changes: list[MarketChange]) -> list[BidRow]:
    """Read the bid rows that ``changes`` name, a chunk of ids a query, into the session: a
    fan-out's batch of bids then costs the tick a few queries, not one per bid (each change
    still reads its row through ``session.get``, which finds it here). Keep the list while
    the changes are applied: the session's identity map holds its rows only weakly."""
    ids = sorted({c.entity_id for c in changes if c.entity == Entity.BID})
    rows: list[BidRow] = []
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        rows.extend(session.scalars(select(BidRow).where(BidRow.id.in_(chunk))))
    return rows


def apply_change(writes: TickWrites, change: MarketChange, now: float) -> None:
    market, session = writes.market, writes.session
    if change.entity == Entity.NODE:
        row = session.get(NodeRow, change.entity_id)
        if row is not None:
            try:
                market.upsert_node(market_node(row))
            except ValueError:
                logger.exception("node %s cannot change that way", row.id)
            else:
                reopen_unserved(writes, row)
    elif change.entity == Entity.BID:
        row = session.get(BidRow, change.entity_id)
        if row is None:
            return
        if row.status == BidStatus.OPEN and not market.has_bid(row.id):
            try:
                first_row = row.gang_id in (None, row.id)  # (members follow their rank 0)
                bid = market_bid(row)
                unserved = None
                if first_row:
                    unserved = market.runners.unserved(bid)
                if unserved is not None:  # no node of its pools runs it as asked: named
                    raise ValueError(f"{HELD_UNSERVED}: {unserved}")
                add_bid_row(market, row)
            except ValueError as exc:  # e.g. a region no node offers yet: hold it
                gate.set_bid_status(
                    session=session,
                    bid_id=row.id,
                    expected=BidStatus.OPEN,
                    to=BidStatus.HELD,
                    reason=str(exc),
                    whole_gang=False,
                )
                first = gangs.gang_rows(session=session, bid=row)[0]
                if first.status == BidStatus.HELD and first.hold_reason:  # as its rank 0 was
                    row.hold_reason = first.hold_reason
        elif row.status == BidStatus.OPEN and market.bid_price(row.id) != row.max_price:
            market.reprice_bid(row.id, row.max_price)
        elif row.status == BidStatus.HELD and is_credit_hold(row.hold_reason):
            if market.has_bid(row.id) and not market.holds.is_held(row.id):
                market.holds.hold_bid(row.id)  # its jobs get a notice, never a kill (credit.py)
        elif row.status in (BidStatus.CANCELLED, BidStatus.FINISHED, BidStatus.HELD) and (
            market.has_bid(row.id)
        ):
            writes.settlement(
                market.cancel_bid(row.id, now),
                reason=EndReason.BID_CANCELLED
                if row.status == BidStatus.CANCELLED
                else row.hold_reason or row.status,
            )
    elif change.entity == Entity.ALLOCATION:
        apply_report(writes, change, now)
    elif change.entity == Entity.TENANT:
        writes.refresh_tenant(change.entity_id)
        credit.reopen_credit_holds(writes, change.entity_id, writes.limits.admission_seconds)


def apply_report(writes: TickWrites, change: MarketChange, now: float) -> None:
    """A node's report (checked by the API: its own allocation, its current epoch).

    A durable checkpoint (periodic, or the final save) records what the allocation had
    paid by then, so compensation never covers work that was saved. A failed final save,
    or a job that ends during its notice, ends the allocation at once: GPUs freed,
    billing stopped. An image pull's progress becomes a ``pulling`` event, nothing else."""
    market, session = writes.market, writes.session
    alloc = session.get(AllocationRow, change.entity_id)
    status = market.allocation_status(change.entity_id)
    if alloc is None or status is None or status.is_terminal():
        return
    data = change.data or {}
    at = min(float(data.get("at", now)), now)
    checkpoint_at = data.get("checkpoint_at")
    outcome = change.op
    if outcome in (ReportOutcome.CHECKPOINT, ReportOutcome.SAVED) and checkpoint_at is not None:
        gate.record_checkpoint(
            alloc=alloc, checkpoint_at=checkpoint_at, paid_micros=writes.paid(alloc)
        )
    if outcome == ReportOutcome.SAVED and status is S.NOTICED:
        gate.record_final_save(alloc=alloc, outcome=ReportOutcome.SAVED)
        writes.final_saves.append(outcome)
        writes.settlement(
            market.end_allocation(alloc.id, S.PREEMPTED, at), reason=EndReason.SAVED_AND_STOPPED
        )
    elif outcome == ReportOutcome.SAVE_FAILED and status is S.NOTICED:
        gate.record_final_save(alloc=alloc, outcome=ReportOutcome.SAVE_FAILED)
        writes.final_saves.append(outcome)
        cause = LossCause(data.get("cause") or LossCause.JOB)
        in_time = alloc.deadline is None or at <= alloc.deadline
        writes.settlement(
            market.end_allocation(alloc.id, S.PREEMPTED, at),
            reason=f"final save failed ({cause.value})",
        )
        if cause is LossCause.STORAGE and in_time:
            writes.compensate(alloc, cause, reclaimed=alloc.notice_reason == NoticeReason.RECLAIMED)
    elif outcome == ReportOutcome.FINISHED and status in (S.RUNNING, S.NOTICED):
        writes.settlement(
            market.end_allocation(alloc.id, S.FINISHED, at), reason=EndReason.JOB_FINISHED
        )
        bid = session.get(BidRow, alloc.bid_id)
        for row in [] if bid is None else gangs.gang_rows(session=session, bid=bid):
            if row.status in LIVE_BID_STATUSES:  # a gang's job is done on every member
                gate.set_bid_status(
                    session=session,
                    bid_id=row.id,
                    expected=BidStatus(row.status),
                    to=BidStatus.FINISHED,
                    whole_gang=False,
                )
    elif outcome == ReportOutcome.PULLING and status in (S.RUNNING, S.NOTICED):
        writes.event(  # progress for the run's log: the allocation does not change
            EventKind.PULLING,
            alloc_id=alloc.id,
            bid_id=alloc.bid_id,
            node_id=alloc.node_id,
            tenant_id=alloc.tenant_id,
            epoch=alloc.epoch,
            detail=data.get("detail") or "",
        )
    elif outcome == ReportOutcome.FAILED and status in (S.RUNNING, S.NOTICED):
        writes.settlement(
            market.end_allocation(alloc.id, S.PREEMPTED, at),
            reason=EndReason.JOB_FAILED,
            detail=data.get("detail"),
        )


SILENT_IS_LOST = (NodeState.LIVE.value, NodeState.DRAINING.value, NodeState.RECLAIMED.value)
"""The node states in which silence is loss: every state but lost itself
(docs/operators/architecture.md#design-4). A reclaimed node whose agent dies would otherwise bill
its noticed jobs to their deadline."""


def lose_silent_nodes(writes: TickWrites, timeout_seconds: float, now: float) -> None:
    """Mark lost the nodes that sent no heartbeat for ``timeout_seconds``, whatever their
    state (``SILENT_IS_LOST``): the market ends their allocations at once (a noticed one
    too, compensated as a loss without notice), and a bid resumes on its reservation."""
    cutoff = datetime.fromtimestamp(now - timeout_seconds, UTC)
    lost = writes.session.scalars(
        select(NodeRow)
        .where(
            NodeRow.state.in_(SILENT_IS_LOST),
            NodeRow.last_heartbeat_at < cutoff,
        )
        .order_by(NodeRow.id)
    )
    for node in lost:
        gate.set_node_state(
            session=writes.session,
            node=node,
            to=NodeState.LOST,
            # a node its agent left keeps what it was before (routes/presence.py)
            state_before_loss=node.state_before_loss or node.state,
        )
        writes.market.upsert_node(market_node(node))
        logger.warning("node %s missed heartbeats for %ss: lost", node.id, timeout_seconds)


def reopen_unserved(writes: TickWrites, node: NodeRow) -> None:
    """Open again, oldest first, the bids held because no node served them (``HELD_UNSERVED``)
    that a live node of this one's pool now serves (it registered, or said its runner)."""
    if node.state != NodeState.LIVE:
        return
    market, session = writes.market, writes.session
    held = session.scalars(
        select(BidRow)
        .where(
            BidRow.status == BidStatus.HELD,
            BidRow.hold_reason.startswith(HELD_UNSERVED, autoescape=True),
            BidRow.gpu_model == node.gpu_model,
            BidRow.capacity == node.capacity,
            BidRow.region.in_((ANY_REGION, node.region)),
            (BidRow.gang_id.is_(None)) | (BidRow.gang_id == BidRow.id),  # one row per gang
        )
        .order_by(BidRow.id)
    ).all()
    for first in held:
        if market.runners.unserved(market_bid(first)) is not None or market.has_bid(first.id):
            continue
        if not gate.set_bid_status(
            session=session, bid_id=first.id, expected=BidStatus.HELD, to=BidStatus.OPEN
        ):
            continue
        try:
            for row in gangs.gang_rows(session=session, bid=first):  # rank 0 first
                add_bid_row(market, row)
        except ValueError as exc:  # (the market refused it after all: held again, saying why)
            if market.has_bid(first.id):
                market.cancel_bid(first.id, 0.0)
            gate.set_bid_status(
                session=session,
                bid_id=first.id,
                expected=BidStatus.OPEN,
                to=BidStatus.HELD,
                reason=str(exc),
            )
