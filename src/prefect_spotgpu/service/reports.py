"""What a node's agent reports about its allocations, as the API takes it.

A report (a durable checkpoint, the final save or its failure, the job's exit) is checked here
(the node's own allocation, in its current epoch, not ended, times that make sense) and passed
to the tick leader through the outbox, which applies it
(:func:`~prefect_spotgpu.service.changes.apply_report`). Every report, accepted or refused, is
kept in ``node_reports`` (:func:`audit_report`). Nothing here writes the allocation row.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from prefect_spotgpu.protocol import AllocationStatus, ReportOutcome
from prefect_spotgpu.service import schemas
from prefect_spotgpu.service.errors import Conflict, Invalid, NotFound
from prefect_spotgpu.service.models import AllocationRow, NodeReport
from prefect_spotgpu.service.outbox import Entity, record_change

CLOCK_SKEW_SECONDS = 60
"""How far a reported ``checkpoint_at`` may lie past now, or before the allocation started."""


def report_allocation(
    *,
    session: Session,
    node_id: int,
    allocation_id: int,
    report: schemas.AllocationReport,
    now: datetime,
) -> AllocationRow:
    """Check what the node's agent says about its allocation (its own allocation, in its
    current epoch) and pass it to the tick leader through the outbox, which records it."""
    alloc = session.get(AllocationRow, allocation_id)
    if alloc is None or alloc.node_id != node_id:
        raise NotFound(f"allocation {allocation_id} is not on this node")
    if report.epoch != alloc.epoch:
        raise Conflict(
            f"stale epoch {report.epoch}: allocation {allocation_id} is at epoch {alloc.epoch} "
            f"({alloc.status})",
            field="epoch",
        )
    if AllocationStatus(alloc.status).is_terminal():
        raise Conflict(f"allocation {allocation_id} already ended ({alloc.status})")
    outcome, checkpoint_at = ReportOutcome(report.outcome), report.checkpoint_at
    if outcome in (ReportOutcome.CHECKPOINT, ReportOutcome.SAVED) and checkpoint_at is None:
        raise Invalid(f"outcome {outcome.value!r} needs checkpoint_at", field="checkpoint_at")
    if checkpoint_at is not None and checkpoint_at > now.timestamp() + CLOCK_SKEW_SECONDS:
        raise Invalid("checkpoint_at is in the future", field="checkpoint_at")
    if checkpoint_at is not None and checkpoint_at < alloc.started_at - CLOCK_SKEW_SECONDS:
        raise Invalid("checkpoint_at is before the allocation started", field="checkpoint_at")
    record_change(
        session=session,
        entity=Entity.ALLOCATION,
        entity_id=alloc.id,
        op=outcome.value,
        data={
            "at": now.timestamp(),
            "epoch": alloc.epoch,
            "checkpoint_at": checkpoint_at,
            "cause": report.cause,
            "detail": report.detail,
        },
    )
    return alloc


def audit_report(
    *,
    session: Session,
    node_id: int,
    allocation_id: int,
    report: schemas.AllocationReport,
    status_code: int,
    detail: str | None,
    now: datetime,
) -> None:
    """Keep a node's report, whatever the API answered it."""
    session.add(
        NodeReport(
            node_id=node_id,
            allocation_id=allocation_id,
            epoch=report.epoch,
            outcome=report.outcome,
            cause=report.cause,
            checkpoint_at=report.checkpoint_at,
            step=report.step,
            status_code=status_code,
            detail=None if detail is None else detail[:500],
            created_at=now,
        )
    )
