"""Credit reserved at admission and bids held when it runs short
(docs/operators/architecture.md#design-7; the rules are ``market/credit.py``'s, this writes what
they decide).

- **Admission** (:func:`reserve_for_bid`, on the API): under the tenant's row lock (PostgreSQL
  ``FOR UPDATE``; SQLite's write transactions queue), a new bid must fit the operator's cap on
  open bids and its exposure over the admission horizon must fit the balance beside every bid
  the tenant has open; otherwise a 409 or a 402 that names the balance and the amount needed,
  and nothing is written. Parallel requests therefore cannot overspend a balance.
- **Holds** (:func:`hold_short_of_credit`, on the tick leader, before each clearing): a tenant
  whose available balance — credits less charges, written or only accrued — no longer covers
  its open bids over the holding horizon has bids held (``status: held``, ``hold_reason`` from
  :func:`~prefect_spotgpu.service.ledger.credit_hold_reason`), newest waiting ones first; when
  it does not cover even the bids holding GPUs, all are held and their jobs get a notice
  (``out_of_credit``) paid for by the credit kept for it (``market/holds.py``).
- **Reopening** (:func:`reopen_credit_holds`, when a credit is applied): held bids reopen, oldest
  first, while the balance covers them over the admission horizon.

Bid statuses written here: ``open -> held`` and ``held -> open``, each compare-and-set (a
cancel may have won).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from prefect_spotgpu.market.credit import (
    BidExposure,
    admission_refusal,
    credit_holds,
    exposure_micros,
)
from prefect_spotgpu.protocol import HELD_FOR_CREDIT, HELD_UNSERVED, BidStatus
from prefect_spotgpu.service import gangs, gate
from prefect_spotgpu.service.errors import Conflict, NotFound, PaymentRequired
from prefect_spotgpu.service.ledger import credit_hold_reason
from prefect_spotgpu.service.market_rows import add_bid_row
from prefect_spotgpu.service.models import BidRow, Tenant

if TYPE_CHECKING:
    from prefect_spotgpu.service import schemas
    from prefect_spotgpu.service.settings import ServiceSettings
    from prefect_spotgpu.service.tick_writes import TickWrites


@dataclass(frozen=True, slots=True)
class BidLimits:
    """The operator's limits on a tenant's bids (from ``ServiceSettings``)."""

    admission_seconds: float  # exposure reserved at admission: the notice and a few ticks
    hold_seconds: float  # exposure kept while bids run: the notice and two ticks
    max_open_bids: int  # open or held bid rows (a gang's members each) per tenant

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> BidLimits:
        return cls(
            admission_seconds=settings.admission_horizon_seconds(),
            hold_seconds=settings.notice_seconds + 2 * settings.tick_seconds,
            max_open_bids=settings.max_open_bids_per_tenant,
        )


def reserve_for_bid(
    *, session: Session, tenant_id: int, data: schemas.BidCreate, limits: BidLimits
) -> None:
    """Admit a new bid of the tenant, or raise (module doc). Call before inserting it."""
    reserve_for_bids(session=session, tenant_id=tenant_id, items=[data], limits=limits)


def reserve_for_bids(
    *,
    session: Session,
    tenant_id: int,
    items: Sequence[schemas.BidCreate],
    limits: BidLimits,
) -> None:
    """Admit new bids of the tenant all together (a batch: every member of every gang), or
    raise for all of them (module doc). Call before inserting them."""
    tenant = _locked(session, tenant_id)
    rows = session.scalar(
        select(func.count(BidRow.id)).where(
            BidRow.tenant_id == tenant_id,
            BidRow.status.in_((BidStatus.OPEN.value, BidStatus.HELD.value)),
        )
    )
    adding = sum(data.node_count for data in items)
    if rows + adding > limits.max_open_bids:
        more = "" if len(items) == 1 else f", these {len(items)} bids would add {adding},"
        raise Conflict(
            f"you have {rows} open or held bid rows (a gang counts each member){more} and "
            f"the operator's cap is {limits.max_open_bids}: cancel some before placing more",
        )
    _check_cover(
        session=session,
        tenant=tenant,
        needed=sum(
            exposure_micros(
                max_price=data.max_price,
                gpus=data.gpu_count * data.node_count,
                seconds=limits.admission_seconds,
            )
            for data in items
        ),
        limits=limits,
        what="this bid" if len(items) == 1 else f"these {len(items)} bids",
    )


def reserve_for_reprice(
    *, session: Session, bid: BidRow, rows: list[BidRow], max_price: float, limits: BidLimits
) -> None:
    """Admit a raised maximum price of an open bid (``rows``: its gang's members), or raise:
    the balance must cover the raise's exposure beside every open bid as it is now."""
    waits_for_a_node = bid.status == BidStatus.HELD and (bid.hold_reason or "").startswith(
        HELD_UNSERVED
    )
    if max_price <= bid.max_price or (bid.status != BidStatus.OPEN and not waits_for_a_node):
        return  # a lower price reserves less; a held bid reserves when it reopens
    _check_cover(
        session=session,
        tenant=_locked(session, bid.tenant_id),
        needed=exposure_micros(
            max_price=max_price - bid.max_price,
            gpus=sum(r.gpu_count for r in rows),
            seconds=limits.admission_seconds,
        ),
        limits=limits,
        what="this raise",
    )


def lock_tenant(*, session: Session, tenant_id: int) -> Tenant:
    """The tenant's row, locked until the transaction ends: admissions of its bids queue."""
    return _locked(session, tenant_id)


def _locked(session: Session, tenant_id: int) -> Tenant:
    """The tenant's row, locked until the transaction ends (admissions queue on it)."""
    tenant = session.get(Tenant, tenant_id, with_for_update=True, populate_existing=True)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id} not found")
    return tenant


def _check_cover(
    *, session: Session, tenant: Tenant, needed: int, limits: BidLimits, what: str
) -> None:
    # open bids reserve, and so do bids held until a node serves them: they open by themselves
    waiting_for_a_node = (BidRow.status == BidStatus.HELD.value) & BidRow.hold_reason.startswith(
        HELD_UNSERVED, autoescape=True
    )
    open_rate = session.scalar(
        select(func.sum(BidRow.max_price * BidRow.gpu_count)).where(
            BidRow.tenant_id == tenant.id,
            (BidRow.status == BidStatus.OPEN.value) | waiting_for_a_node,
        )
    )
    reserved = exposure_micros(
        max_price=float(open_rate or 0.0), gpus=1, seconds=limits.admission_seconds
    )
    refusal = admission_refusal(
        balance=tenant.balance_micros, reserved=reserved, needed=needed, what=what
    )
    if refusal is not None:
        raise PaymentRequired(refusal, field="max_price")


# ---------------------------------------------------------------- on the tick leader


def hold_short_of_credit(writes: TickWrites, owed: dict[int, int], hold_seconds: float) -> None:
    """Hold the bids that the available balance of tenants with charges (``owed``: micros
    accrued, not yet written) no longer covers; the market notices their jobs (module doc)."""
    if not owed:
        return
    market = writes.market
    rates = market.holds.credit_rates()
    for tenant_id, (credits, spent) in writes.balances(list(owed)).items():
        available = credits - spent - owed[tenant_id]
        every, _ = rates.get(tenant_id, (0.0, 0.0))
        needed = exposure_micros(max_price=every, gpus=1, seconds=hold_seconds)
        if available > needed:
            continue  # every bid it has open is covered (the common case: one vector pass)
        bids = [
            BidExposure(bid_id, exposure_micros(max_price=p, gpus=g, seconds=hold_seconds), run)
            for bid_id, p, g, run in market.holds.tenant_bids(tenant_id)
        ]
        decided = credit_holds(available=available, bids=bids)
        reason = credit_hold_reason(available, needed)
        for bid_id in decided.held:
            if gate.set_bid_status(
                session=writes.session,
                bid_id=bid_id,
                expected=BidStatus.OPEN,
                to=BidStatus.HELD,
                reason=reason,
            ):
                market.holds.hold_bid(bid_id)


def reopen_credit_holds(writes: TickWrites, tenant_id: int, admission_seconds: float) -> None:
    """Reopen, oldest first, the tenant's bids held for credit that its balance (less what
    its open bids reserve) covers again over the admission horizon."""
    market, session = writes.market, writes.session
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        return
    held = session.scalars(
        select(BidRow)
        .where(
            BidRow.tenant_id == tenant_id,
            BidRow.status == BidStatus.HELD,
            BidRow.hold_reason.startswith(HELD_FOR_CREDIT, autoescape=True),
            (BidRow.gang_id.is_(None)) | (BidRow.gang_id == BidRow.id),  # one row per gang
        )
        .order_by(BidRow.id)
    ).all()
    if not held:
        return
    every, _ = market.holds.credit_rates().get(tenant_id, (0.0, 0.0))
    spare = (
        tenant.balance_micros
        - writes.accrued.tenants.get(tenant_id, 0)
        - exposure_micros(max_price=every, gpus=1, seconds=admission_seconds)
    )
    for first in held:
        rows = gangs.gang_rows(session=session, bid=first)
        needed = exposure_micros(
            max_price=first.max_price,
            gpus=sum(r.gpu_count for r in rows),
            seconds=admission_seconds,
        )
        if needed > spare:
            return  # a newer bid never jumps an older one that does not fit
        spare -= needed
        if not gate.set_bid_status(
            session=session, bid_id=first.id, expected=BidStatus.HELD, to=BidStatus.OPEN
        ):
            continue
        if market.holds.unhold_bid(first.id):  # still in the market (its notice runs): it stays
            if market.bid_price(first.id) != first.max_price:
                market.reprice_bid(first.id, first.max_price)
        elif not market.has_bid(first.id):
            for row in rows:  # rank 0 first, as the market takes a gang
                add_bid_row(market, row)
