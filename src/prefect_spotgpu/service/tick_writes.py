"""The writes of one tick: the market's decision as allocation rows, events and deliveries,
and each pool's quote and price bar.

Allocation rows are written through ``gate`` (new rows, status changes); charges accrue in the
ticker's :class:`~prefect_spotgpu.service.ledger.Accrued` and are written by the ledger. Events
are written in bulk at the end of the tick (:meth:`TickWrites.flush_events`), in order, with
their webhook deliveries, so a cold tick that places 100,000 bids stays a few statements.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from prefect_spotgpu.market import Decision, Market, PlacementKind
from prefect_spotgpu.market.compensation import LossCause
from prefect_spotgpu.protocol import (
    AllocationStatus,
    Capacity,
    DeliveryStatus,
    EndReason,
    EventKind,
    EventPlacement,
)
from prefect_spotgpu.service import gate, job_network, ledger
from prefect_spotgpu.service.models import (
    AllocationRow,
    EventRow,
    PoolQuoteRow,
    PriceBar,
    Tenant,
)

if TYPE_CHECKING:
    from prefect_spotgpu.service.credit import BidLimits

S = AllocationStatus


class TickWrites:
    """The writes of one tick, in its transaction: allocations (through the gate), events,
    deliveries; and the tenants' balances and webhooks as read during it."""

    def __init__(
        self,
        session: Session,
        market: Market,
        accrued: ledger.Accrued,
        now: float,
        limits: BidLimits | None = None,
    ):
        self.session = session
        self.limits = limits  # the operator's limits on bids (the credit holds read them)
        self.market = market
        self.accrued = accrued
        self.now = now
        self.now_dt = datetime.fromtimestamp(now, UTC)
        self.events = 0
        self.ended = False
        self.final_saves: list[str] = []  # final-save reports applied (saved, save_failed)
        self._pending_events: list[dict] = []
        self._webhooks: dict[int, str | None] = {}
        self._tenants: dict[int, tuple[float, float]] = {}
        self._bid_tenant: dict[int, int] = {}

    def balances(self, tenant_ids) -> dict[int, tuple[int, int]]:
        """Each tenant's ``(credits, spent)`` in micros, as written."""
        out = {}
        for tenant_id in tenant_ids:
            if tenant_id not in self._tenants:
                self.refresh_tenant(tenant_id)
            out[tenant_id] = self._tenants[tenant_id]
        return out

    def refresh_tenant(self, tenant_id: int) -> None:
        row = self.session.execute(
            select(Tenant.credits_micros, Tenant.spent_micros, Tenant.webhook_url).where(
                Tenant.id == tenant_id
            )
        ).first()
        if row is not None:
            self._tenants[tenant_id] = (row.credits_micros, row.spent_micros)
            self._webhooks[tenant_id] = row.webhook_url

    def tenant_of(self, bid_id: int) -> int:
        tenant = self._bid_tenant.get(bid_id)
        if tenant is None:
            tenant = self._bid_tenant[bid_id] = self.market.bid_tenant(bid_id)
        return tenant

    def event(
        self,
        kind: EventKind,
        *,
        alloc_id: int,
        bid_id: int,
        node_id: int,
        tenant_id: int,
        **payload,
    ) -> None:
        body = {
            "allocation_id": alloc_id,
            "bid_id": bid_id,
            "node_id": node_id,
            "event": kind,
            "at": self.now,
            **payload,
        }
        self._pending_events.append(
            {
                "tenant_id": tenant_id,
                "bid_id": bid_id,
                "node_id": node_id,
                "allocation_id": alloc_id,
                "kind": kind,
                "payload": body,
                "created_at": self.now_dt,
            }
        )

    def flush_events(self) -> None:
        rows, self._pending_events = self._pending_events, []
        if not rows:
            return
        ids = (
            self.session.execute(
                insert(EventRow).returning(EventRow.id, sort_by_parameter_order=True), rows
            )
            .scalars()
            .all()
        )
        self.events += len(rows)
        deliveries = []
        for event_id, row in zip(ids, rows, strict=True):
            tenant_id = row["tenant_id"]
            if tenant_id not in self._webhooks:
                self.refresh_tenant(tenant_id)
            url = self._webhooks.get(tenant_id)
            if url and row["kind"] != EventKind.PULLING:  # webhooks get changes, not progress
                deliveries.append(
                    {
                        "tenant_id": tenant_id,
                        "event_id": event_id,
                        "url": url,
                        "status": DeliveryStatus.PENDING.value,
                        "attempts": 0,
                        "next_attempt_at": self.now,
                        "updated_at": self.now_dt,
                    }
                )
        gate.create_deliveries(session=self.session, rows=deliveries)

    def decision(self, decision: Decision) -> None:
        placements = list(decision.placements)
        rows = [
            {
                "id": p.allocation_id,
                "bid_id": p.bid_id,
                "node_id": p.node_id,
                "tenant_id": self.tenant_of(p.bid_id),
                "gpu_count": p.gpu_count,
                "status": p.status.value,
                "kind": p.kind.value,
                "started_at": self.now,
                "charged_until": self.now,
                # in force from the start: a leader killed before its next flush must
                # not leave a restarted one billing this interval at 0
                "price": self.market.price_in_force(p.allocation_id),
                "deadline": p.expires_at,
                "charged_micros": 0,
                "charged_seconds": 0.0,
                # a takeover's floor for the notices it caused (market/notice_fee.py)
                "notice_fee_micros": self.market.notice_fee_owed(p.allocation_id),
            }
            for p in placements
        ]
        job_network.assign_addresses(session=self.session, rows=rows)
        gate.create_allocations(session=self.session, rows=rows)
        for p in placements:
            kind = EventKind.ALLOCATED if p.kind is PlacementKind.NEW else EventKind.RESERVED
            self.event(
                kind,
                alloc_id=p.allocation_id,
                bid_id=p.bid_id,
                node_id=p.node_id,
                tenant_id=self.tenant_of(p.bid_id),
                status=p.status.value,
                gpu_count=p.gpu_count,
                placement=p.kind.value,
                epoch=1,
                expires_at=p.expires_at,
            )
        # A reservation promoted in this tick and then outbid or ended in it (the market's own
        # order: promotions before the clearing) is written running first, as those writes
        # expect; every other promotion after the endings, as its events have always come (a
        # migration's: the old allocation's end, then the new one's start).
        changed = {n.allocation_id for n in decision.notices} | {
            e.allocation_id for e in decision.endings
        }
        promoted_first = [a for a in decision.promotions if a in changed]
        for alloc_id in promoted_first:
            self.promote(alloc_id)
        for n in decision.notices:
            row = gate.set_allocation_status(
                session=self.session,
                allocation_id=n.allocation_id,
                expected=S.RUNNING,
                to=S.NOTICED,
                deadline=n.deadline,
                notice_reason=n.reason.value,
            )
            self.event(
                EventKind.NOTICED,
                alloc_id=n.allocation_id,
                bid_id=n.bid_id,
                node_id=n.node_id,
                tenant_id=row.tenant_id,
                reason=n.reason.value,
                deadline=n.deadline,
                epoch=row.epoch,
            )
        self.accrued.add(decision.charges, decision.fees)  # first: compensation reads it
        self.settlement_endings(decision.endings)
        for alloc_id in decision.promotions:
            if alloc_id not in promoted_first:
                self.promote(alloc_id)

    def promote(self, alloc_id: int) -> None:
        """A reservation started: reserved to running, and its ``allocated`` event."""
        row = gate.set_allocation_status(
            session=self.session,
            allocation_id=alloc_id,
            expected=S.RESERVED,
            to=S.RUNNING,
            started_at=self.now,
            charged_until=self.now,
            price=self.market.price_in_force(alloc_id),
            deadline=None,
        )
        self.event(
            EventKind.ALLOCATED,
            alloc_id=alloc_id,
            bid_id=row.bid_id,
            node_id=row.node_id,
            tenant_id=row.tenant_id,
            status=S.RUNNING.value,
            gpu_count=row.gpu_count,
            placement=EventPlacement.PROMOTED,
            epoch=row.epoch,
        )

    def settlement(self, settlement, reason: str, detail: str | None = None) -> None:
        """Write a settlement made outside the tick (a cancel, a hold, an agent's report;
        ``detail``: what the node said of a failed job, in the ending event)."""
        self.accrued.add(settlement.charges, settlement.fees)
        self.settlement_endings(settlement.endings, reason=reason, detail=detail)

    def paid(self, alloc: AllocationRow) -> int:
        """Micros the allocation has paid so far: written charges plus this leader's unwritten."""
        return self.accrued.paid(alloc)

    def settlement_endings(
        self, endings, reason: str | None = None, detail: str | None = None
    ) -> None:
        for e in endings:
            self.ended = True
            fields = {"ended_at": e.at, "end_reason": reason or e.reason}
            if e.previous.is_charged():  # its last charge took any carry
                fields["charged_until"], fields["charge_carry"] = e.at, 0
            row = gate.set_allocation_status(
                session=self.session,
                allocation_id=e.allocation_id,
                expected=e.previous,
                to=e.status,
                **fields,
            )
            self.event(
                EventKind(e.status.value),
                alloc_id=e.allocation_id,
                bid_id=e.bid_id,
                node_id=e.node_id,
                tenant_id=row.tenant_id,
                reason=fields["end_reason"],
                epoch=row.epoch,
                **({"detail": detail} if detail else {}),
            )
            if e.reason == EndReason.NODE_LOST and e.previous.is_charged():
                self.compensate(
                    self.session.get(AllocationRow, e.allocation_id), LossCause.NODE_LOST
                )

    def compensate(self, alloc: AllocationRow, cause: LossCause, reclaimed: bool = False) -> None:
        """Credit what the allocation lost, when the loss was the platform's (the ledger's rule)."""
        ledger.compensate(
            session=self.session,
            alloc=alloc,
            cause=cause,
            paid=self.paid(alloc),
            now=self.now_dt,
            reclaimed=reclaimed,
        )


class PoolQuotes:
    """Each pool's latest quote as written (written again only when it changes), and this
    leader's price bars not written yet."""

    def __init__(self) -> None:
        self.written: dict[tuple[str, str, str], tuple] = {}
        self.bars: dict[tuple[str, str, int], list[float]] = {}

    def write(self, session: Session, decision: Decision, now: float) -> bool:
        """Each pool's quote and this minute's price bar; whether any quote changed."""
        moved = False
        minute = int(now // 60)
        for q in decision.quotes:
            key = (q.gpu_model, q.region, q.capacity.value)
            if q.clearing_price is not None and q.capacity is Capacity.SPOT:
                bar = self.bars.get((q.gpu_model, q.region, minute))
                p = q.clearing_price
                if bar is None:
                    self.bars[(q.gpu_model, q.region, minute)] = [p, p, p, p]
                else:
                    bar[1], bar[2], bar[3] = max(bar[1], p), min(bar[2], p), p
            values = (
                q.clearing_price,
                q.reserve_price,
                q.gpus_total,
                q.gpus_free,
                q.gpus_running,
                q.waiting_bids,
            )
            if self.written.get(key) == values:
                continue
            row = session.get(PoolQuoteRow, key)
            if row is None:
                row = PoolQuoteRow(gpu_model=q.gpu_model, region=q.region, capacity=key[2])
                session.add(row)
            (
                row.clearing_price,
                row.reserve_price,
                row.gpus_total,
                row.gpus_free,
                row.gpus_running,
                row.waiting_bids,
            ) = values
            row.updated_at = now
            self.written[key] = values
            moved = True
        return moved

    def write_bars(self, session: Session) -> None:
        """Merge the accrued price bars into the ``price_bars`` rows; then forget them."""
        for (model, region, minute), (o, h, lo, c) in self.bars.items():
            bar = session.get(PriceBar, (model, region, minute))
            if bar is None:
                session.add(
                    PriceBar(
                        gpu_model=model,
                        region=region,
                        minute=minute,
                        open=o,
                        high=h,
                        low=lo,
                        close=c,
                    )
                )
            else:
                bar.high, bar.low, bar.close = max(bar.high, h), min(bar.low, lo), c
        self.bars.clear()
