"""Retention: the rows the market no longer needs, removed in bounded batches; minute price
bars folded into hourly ones (what goes when: ``retention_rules``, pure; docs/operators/
retention.md).

Removed, once older than their retention: events, delivered or failed webhook deliveries,
node reports, ended allocations; minute bars become hourly bars, and hourly bars may go.

Never removed, whatever their age:

- ledger entries (a tenant's ``credits_micros`` is their sum) and bids;
- an allocation that has not ended, or of a bid still open or held, or of a gang with such a
  member (the worker paces a live bid by all its allocations);
- the charges of an ended allocation: the transaction that deletes it adds them to its
  tenant's ``archived_charges`` row (the only writer of that table), so ``spent_micros`` stays
  the sum of its allocations' ``charged_micros`` and its archived ones;
- a pending webhook delivery, and the event it will send;
- the newest row of each table: ids never go back (SQLite would hand a deleted newest id out
  again; the market numbers new allocations from the newest; long-poll cursors and the event
  watcher read the newest event id). A cursor older than the oldest kept event still answers,
  from the oldest kept.

Who prunes: the tick leader, from its loop (:class:`Pruner`: every
``retention_interval_seconds`` of the service's clock, each batch fenced on its epoch like a
tick), and the operator (``spotgpu server prune``, :func:`prune_all`). Every batch is one short
transaction of at most ``retention_batch_rows`` rows, idempotent: two pruners at once delete a
row once (charges are archived from what the delete returned), and a batch that fails is
done again by the next pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import delete, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.market import AllocationStatus
from prefect_spotgpu.protocol import LIVE_BID_STATUSES, DeliveryStatus
from prefect_spotgpu.service import leader
from prefect_spotgpu.service.leader import LostLeadership
from prefect_spotgpu.service.models import (
    AllocationRow,
    ArchivedCharges,
    BidRow,
    EventRow,
    NodeReport,
    PriceBar,
    WebhookDelivery,
)
from prefect_spotgpu.service.retention_rules import (
    HOUR_BAR,
    MINUTE_BAR,
    Bar,
    Cutoffs,
    RetentionPolicy,
    RowKind,
    cutoffs,
    fold_into_hours,
    fold_range,
    next_pass,
)
from prefect_spotgpu.service.settings import ServiceSettings

logger = logging.getLogger("prefect_spotgpu.service.retention")

ENDED = tuple(s.value for s in AllocationStatus if s.is_terminal())
FINISHED_DELIVERIES = (DeliveryStatus.DELIVERED.value, DeliveryStatus.FAILED.value)
LIVE_BIDS = tuple(s.value for s in LIVE_BID_STATUSES)


def _when(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


# ---------------------------------------------------------------- what may go


def _live_bids():
    """A select of the ids of bids still open or held, and of every bid of a gang one of whose
    members is: a worker that adopts such a run reads all its events and allocations, from the
    first, to know what runs (old ones included)."""
    live_gangs = select(BidRow.gang_id).where(
        BidRow.status.in_(LIVE_BIDS), BidRow.gang_id.is_not(None)
    )
    return select(BidRow.id).where(BidRow.status.in_(LIVE_BIDS) | BidRow.gang_id.in_(live_gangs))


BY_ID = {
    RowKind.EVENTS: EventRow,
    RowKind.WEBHOOK_DELIVERIES: WebhookDelivery,
    RowKind.NODE_REPORTS: NodeReport,
    RowKind.ENDED_ALLOCATIONS: AllocationRow,
}
"""The kinds removed row by row, by id: their tables."""


def _removable(kind: RowKind, cutoff: float) -> tuple:
    """``kind``'s age column, and what makes one of its rows removable at ``cutoff``."""
    if kind is RowKind.EVENTS:
        pending = select(WebhookDelivery.event_id).where(
            WebhookDelivery.status == DeliveryStatus.PENDING.value
        )
        return EventRow.created_at, [
            EventRow.created_at < _when(cutoff),
            EventRow.id.not_in(pending),
            EventRow.bid_id.not_in(_live_bids()),
        ]
    if kind is RowKind.WEBHOOK_DELIVERIES:
        return WebhookDelivery.updated_at, [
            WebhookDelivery.updated_at < _when(cutoff),
            WebhookDelivery.status.in_(FINISHED_DELIVERIES),
        ]
    if kind is RowKind.NODE_REPORTS:
        return NodeReport.created_at, [NodeReport.created_at < _when(cutoff)]
    return AllocationRow.ended_at, [
        AllocationRow.ended_at < cutoff,
        AllocationRow.status.in_(ENDED),
        AllocationRow.bid_id.not_in(_live_bids()),
    ]


def _prunable_ids(session: Session, kind: RowKind, cut: Cutoffs):
    """A select of the ids of ``kind``'s rows that may go, oldest first, never the newest row
    (None: none may)."""
    if kind not in BY_ID:
        raise ValueError(f"{kind} is not pruned by id")
    cutoff = cut.of(kind)
    if cutoff is None:
        return None
    table = BY_ID[kind]
    newest = session.scalar(select(func.max(table.id))) or 0
    aged, removable = _removable(kind, cutoff)
    return select(table.id).where(*removable, table.id < newest).order_by(aged, table.id)


# ---------------------------------------------------------------- one batch


@dataclass
class Pruned:
    """What batches of one kind did: rows removed; for minute bars, the hourly bars made."""

    removed: int = 0
    made: int = 0
    full: bool = False  # the last batch was full: more may be left

    def add(self, other: Pruned) -> None:
        self.removed += other.removed
        self.made += other.made
        self.full = other.full


def prune_batch(*, session: Session, kind: RowKind, cut: Cutoffs, batch_rows: int) -> Pruned:
    """One batch of ``kind``: at most ``batch_rows`` rows removed (for minute bars, the hours
    they fill folded), in the caller's transaction. Never commits."""
    if kind is RowKind.MINUTE_BARS:
        return _fold_minute_bars(session, cut, batch_rows)
    if kind is RowKind.HOURLY_BARS:
        return _drop_hourly_bars(session, cut, batch_rows)
    query = _prunable_ids(session, kind, cut)
    if query is None:
        return Pruned()
    ids = list(session.scalars(query.limit(batch_rows)))
    if not ids:
        return Pruned()
    full = len(ids) >= batch_rows
    if kind is RowKind.ENDED_ALLOCATIONS:
        return Pruned(removed=_delete_allocations(session, ids), full=full)
    table = BY_ID[kind]
    removed = session.execute(
        delete(table).where(table.id.in_(ids)), execution_options={"synchronize_session": False}
    ).rowcount
    return Pruned(removed=removed, full=full)


def _delete_allocations(session: Session, ids: list[int]) -> int:
    """Delete the ended allocations of ``ids``; add what the delete returned (only the rows
    this transaction removed) to their tenants' archived charges."""
    gone = session.execute(
        delete(AllocationRow)
        .where(AllocationRow.id.in_(ids), AllocationRow.status.in_(ENDED))
        .returning(
            AllocationRow.tenant_id, AllocationRow.charged_micros, AllocationRow.charged_seconds
        ),
        execution_options={"synchronize_session": False},
    ).all()
    per_tenant: dict[int, list] = {}
    for tenant_id, micros, seconds in gone:
        entry = per_tenant.setdefault(tenant_id, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += micros
        entry[2] += seconds
    if per_tenant:
        dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
        statement = dialect.insert(ArchivedCharges).values(
            [
                {
                    "tenant_id": tenant_id,
                    "allocations": count,
                    "charged_micros": micros,
                    "charged_seconds": seconds,
                }
                for tenant_id, (count, micros, seconds) in sorted(per_tenant.items())
            ]
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=[ArchivedCharges.tenant_id],
                set_={
                    "allocations": ArchivedCharges.allocations + statement.excluded.allocations,
                    "charged_micros": ArchivedCharges.charged_micros
                    + statement.excluded.charged_micros,
                    "charged_seconds": ArchivedCharges.charged_seconds
                    + statement.excluded.charged_seconds,
                },
            )
        )
    return len(gone)


def _fold_minute_bars(session: Session, cut: Cutoffs, batch_rows: int) -> Pruned:
    """Fold the hours of one pool that its oldest minute bars before the cutoff fill (at most
    ``batch_rows`` minutes): delete every bar of those hours, insert one hourly bar each."""
    if cut.minute_bars is None:
        return Pruned()
    oldest = _oldest_bar(session, MINUTE_BAR, cut.minute_bars)
    if oldest is None:
        return Pruned()
    start, end = fold_range(oldest.minute, cut.minute_bars, batch_rows)
    pool = (PriceBar.gpu_model == oldest.gpu_model) & (PriceBar.region == oldest.region)
    rows = session.execute(
        delete(PriceBar)
        .where(pool, PriceBar.minute >= start, PriceBar.minute < end)
        .returning(
            PriceBar.minute,
            PriceBar.open,
            PriceBar.high,
            PriceBar.low,
            PriceBar.close,
            PriceBar.seconds,
        ),
        execution_options={"synchronize_session": False},
    ).all()
    folded = fold_into_hours(Bar(*row) for row in rows)  # [] if another pruner took them
    if folded:
        session.execute(
            insert(PriceBar),
            [
                {
                    "gpu_model": oldest.gpu_model,
                    "region": oldest.region,
                    "minute": bar.minute,
                    "open": bar.open,
                    "high": bar.high,
                    "low": bar.low,
                    "close": bar.close,
                    "seconds": HOUR_BAR,
                }
                for bar in folded
            ],
        )
    minutes = sum(1 for row in rows if row.seconds == MINUTE_BAR)
    # more may be left, of this pool or the next: the next batch looks (and finds none, last)
    return Pruned(removed=minutes, made=len(folded), full=bool(rows))


def _drop_hourly_bars(session: Session, cut: Cutoffs, batch_rows: int) -> Pruned:
    """Drop the hourly bars of one pool from its oldest before the cutoff, at most
    ``batch_rows`` hours of them."""
    if cut.hourly_bars is None:
        return Pruned()
    oldest = _oldest_bar(session, HOUR_BAR, cut.hourly_bars)
    if oldest is None:
        return Pruned()
    end = min(cut.hourly_bars, oldest.minute + batch_rows * (HOUR_BAR // 60))
    removed = session.execute(
        delete(PriceBar).where(
            PriceBar.gpu_model == oldest.gpu_model,
            PriceBar.region == oldest.region,
            PriceBar.seconds == HOUR_BAR,
            PriceBar.minute >= oldest.minute,
            PriceBar.minute < end,
        ),
        execution_options={"synchronize_session": False},
    ).rowcount
    return Pruned(removed=removed, full=removed > 0)


def _oldest_bar(session: Session, seconds: int, before_minute: int):
    """``(gpu_model, region, minute)`` of the oldest bar of width ``seconds`` before
    ``before_minute``, of any pool (the ``(seconds, minute)`` index); None when none is."""
    return session.execute(
        select(PriceBar.gpu_model, PriceBar.region, PriceBar.minute)
        .where(PriceBar.seconds == seconds, PriceBar.minute < before_minute)
        .order_by(PriceBar.minute, PriceBar.gpu_model, PriceBar.region)
        .limit(1)
    ).first()


# ---------------------------------------------------------------- counts (a dry run)


@dataclass(frozen=True)
class KindCount:
    """One kind of row: how many there are and how many would go (or went) at ``cutoff``."""

    kind: RowKind
    days: float | None  # its retention (None: for ever)
    cutoff: datetime | None
    rows: int  # rows of the kind now (allocations: ended ones; bars: of that width)
    going: int  # rows that go (minute bars: that are folded)
    made: int = 0  # minute bars: the hourly bars they become


def count_prunable(*, session: Session, policy: RetentionPolicy, cut: Cutoffs) -> list[KindCount]:
    """Per kind, its rows and those a prune at ``cut`` would remove (what ``--dry-run``
    prints). Reads only."""
    counts = []
    for kind in RowKind:
        seconds = cut.as_seconds(kind)
        rows, going, made = _counts(session, kind, cut)
        counts.append(
            KindCount(
                kind=kind,
                days=policy.days(kind),
                cutoff=None if seconds is None else _when(seconds),
                rows=rows,
                going=going,
                made=made,
            )
        )
    return counts


def _count(session: Session, query) -> int:
    return session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0


def _counts(session: Session, kind: RowKind, cut: Cutoffs) -> tuple[int, int, int]:
    if kind in (RowKind.MINUTE_BARS, RowKind.HOURLY_BARS):
        width = MINUTE_BAR if kind is RowKind.MINUTE_BARS else HOUR_BAR
        rows = session.scalar(select(func.count()).where(PriceBar.seconds == width)) or 0
        cutoff = cut.of(kind)
        if cutoff is None:
            return rows, 0, 0
        old = (PriceBar.seconds == width) & (PriceBar.minute < cutoff)
        going = session.scalar(select(func.count()).where(old)) or 0
        if kind is RowKind.HOURLY_BARS:
            return rows, going, 0
        hours = select(PriceBar.gpu_model, PriceBar.region, PriceBar.minute // 60).where(old)
        return rows, going, _count(session, hours.distinct())
    table = BY_ID[kind]
    everything = select(table.id)
    if kind is RowKind.ENDED_ALLOCATIONS:
        everything = everything.where(AllocationRow.status.in_(ENDED))
    rows = _count(session, everything)
    query = _prunable_ids(session, kind, cut)
    return rows, 0 if query is None else _count(session, query), 0


# ---------------------------------------------------------------- who prunes


def prune_all(
    *, sessions: sessionmaker[Session], cut: Cutoffs, batch_rows: int
) -> dict[RowKind, Pruned]:
    """Every batch of every kind until none is left (``spotgpu server prune``): one
    transaction per batch."""
    done = {}
    for kind in RowKind:
        done[kind] = total = Pruned()
        while True:
            with sessions.begin() as session:
                batch = prune_batch(session=session, kind=kind, cut=cut, batch_rows=batch_rows)
            total.add(batch)
            if not batch.full:
                break
    return done


class Pruner:
    """The tick leader's retention: a pass every ``retention_interval_seconds`` of the
    service's clock, one batch of each kind per pass, each fenced on the leader's epoch; a
    pass that left a backlog is followed by another ``BACKLOG_PAUSE_SECONDS`` later."""

    def __init__(self, settings: ServiceSettings, sessions: sessionmaker[Session]) -> None:
        self.policy = RetentionPolicy.from_settings(settings)
        self.interval = settings.retention_interval_seconds
        self.batch_rows = settings.retention_batch_rows
        self.sessions = sessions
        self.next_at = float("-inf")
        self.passes = 0
        self.last_pass_at: float | None = None  # the service's time of the last pass
        self.removed = dict.fromkeys(RowKind, 0)  # since this process started (tests, logs)

    def run_due(self, *, now: float, epoch: int) -> None:
        """A pass when one is due (raises ``LostLeadership`` when another replica leads; any
        other failure is logged, and the batch is done again at the next pass)."""
        if self.interval <= 0 or now < self.next_at or self.policy.keeps_everything:
            return
        cut = cutoffs(self.policy, now)
        backlog = False
        for kind in RowKind:
            if cut.of(kind) is None:
                continue
            try:
                with self.sessions.begin() as session:
                    leader.fence(session=session, epoch=epoch, now=now)
                    batch = prune_batch(
                        session=session, kind=kind, cut=cut, batch_rows=self.batch_rows
                    )
            except LostLeadership:
                raise
            except Exception:
                logger.exception("pruning %s failed; the next pass tries again", kind)
                continue
            self.removed[kind] += batch.removed
            backlog = backlog or batch.full
        self.passes += 1
        self.last_pass_at = now
        self.next_at = next_pass(now=now, interval=self.interval, backlog=backlog)
