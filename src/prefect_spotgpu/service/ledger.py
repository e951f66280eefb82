"""The ledger: credits, charges written, compensation, and bids held for credit.

Money is whole micros. A tenant's ``credits_micros`` is exactly the sum of its ledger entries,
written only by :func:`add_credit` (starting credit, top-ups, compensation); its
``spent_micros`` exactly the sum of its allocations' ``charged_micros``, written only by
:meth:`Accrued.write` on the tick leader, together with those allocations' charges (through
``gate``). The market decides what is charged and ``market.compensation`` what a loss is
credited; this module writes what they decide.

Credit is reserved at admission and bids are held when it runs short in ``service/credit.py``;
a held bid's ``hold_reason`` is :func:`credit_hold_reason`'s, starting with
``HELD_FOR_CREDIT``.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from enum import StrEnum

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from prefect_spotgpu.market import Market
from prefect_spotgpu.market.compensation import Loss, LossCause, compensation
from prefect_spotgpu.market.money import from_micros
from prefect_spotgpu.protocol import HELD_FOR_CREDIT
from prefect_spotgpu.service import gate
from prefect_spotgpu.service.errors import NotFound
from prefect_spotgpu.service.models import AllocationRow, LedgerEntry, NodeRow, Tenant
from prefect_spotgpu.service.outbox import Entity, record_change


class CreditKind(StrEnum):
    """The ``kind`` of a ledger entry."""

    STARTING = "starting_credit"
    """What a new tenant starts with."""
    CREDIT = "credit"
    """A top-up by the operator."""
    COMPENSATION = "compensation"
    """What a platform-caused loss is credited (at most once per allocation)."""


def add_credit(
    *,
    session: Session,
    tenant_id: int,
    amount: int,
    kind: str,
    reason: str,
    now: datetime,
    allocation_id: int | None = None,
) -> LedgerEntry:
    tenant = session.get(Tenant, tenant_id, with_for_update=True)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id} not found")
    tenant.credits_micros += amount  # micros: exactly the sum of its entries
    entry = LedgerEntry(
        tenant_id=tenant_id,
        kind=kind,
        amount_micros=amount,
        allocation_id=allocation_id,
        reason=reason,
        created_at=now,
    )
    session.add(entry)
    record_change(session=session, entity=Entity.TENANT, entity_id=tenant_id, op="credit")
    return entry


def ledger_entries(
    *, session: Session, tenant_id: int, limit: int, before_id: int | None
) -> list[LedgerEntry]:
    """A page of the tenant's ledger entries, newest first, older than ``before_id``."""
    query = select(LedgerEntry).where(LedgerEntry.tenant_id == tenant_id)
    if before_id is not None:
        query = query.where(LedgerEntry.id < before_id)
    return list(session.scalars(query.order_by(LedgerEntry.id.desc()).limit(limit)))


def credit_hold_reason(balance_micros: int, needed_micros: int | None = None) -> str:
    """The ``hold_reason`` of a bid held because its tenant's balance ran short (of
    ``needed_micros``: what its open bids keep for their notices, ``service/credit.py``)."""
    reason = f"{HELD_FOR_CREDIT}: balance {from_micros(balance_micros):.4f}"
    if needed_micros is None:
        return reason
    return (
        f"{reason} does not cover the {from_micros(needed_micros):.4f} that the notices of "
        "your open bids may cost"
    )


# ---------------------------------------------------------------- on the tick leader


def compensate(
    *,
    session: Session,
    alloc: AllocationRow,
    cause: LossCause,
    paid: int,
    now: datetime,
    reclaimed: bool = False,
) -> None:
    """Credit what the allocation paid (``paid`` micros so far) since its last durable
    checkpoint, when the loss was the platform's (``market.compensation`` decides; this
    writes it, once)."""
    node = session.get(NodeRow, alloc.node_id)
    already = session.scalar(
        select(LedgerEntry.id).where(
            LedgerEntry.allocation_id == alloc.id, LedgerEntry.kind == CreditKind.COMPENSATION
        )
    )
    decided = compensation(
        Loss(
            cause,
            paid_total=paid,
            paid_at_checkpoint=alloc.paid_at_checkpoint_micros,
            own_node=node is not None and node.owner_id == alloc.tenant_id,
            already_compensated=already is not None,
            reclaimed=reclaimed,
        )
    )
    if decided is None:
        return
    add_credit(
        session=session,
        tenant_id=alloc.tenant_id,
        amount=decided.amount,
        kind=CreditKind.COMPENSATION,
        allocation_id=alloc.id,
        now=now,
        reason=decided.reason,
    )


class Accrued:
    """Charges the leader's market made that are not written yet.

    ``allocations``: allocation id -> ``[micros, seconds, tenant]``; ``tenants``: tenant ->
    micros. They are written every ``charge_flush_seconds`` (and at once when an allocation
    ends); a leader that dies before loses nothing, as the next one bills the gap from each
    allocation's ``charged_until``.
    """

    def __init__(self) -> None:
        self.allocations: dict[int, list] = {}
        self.tenants: defaultdict[int, int] = defaultdict(int)

    def add(self, charges, fees=()) -> None:
        """Accrue a tick's (or a settlement's) ``market.Charges``, and the notice fees its
        endings left owing (``market.NoticeFee``: money on the allocation, no seconds)."""
        for fee in fees:
            self.tenants[fee.tenant_id] += fee.amount
            entry = self.allocations.setdefault(fee.allocation_id, [0, 0.0, fee.tenant_id])
            entry[0] += fee.amount
        if len(charges) == 0:
            return
        tenants, inverse = np.unique(charges.tenant_id, return_inverse=True)
        for tenant, amount in zip(
            tenants.tolist(), _sums_by(inverse, charges.amount, len(tenants)), strict=True
        ):
            self.tenants[tenant] += amount
        for alloc_id, amount, seconds, tenant in zip(
            charges.allocation_id.tolist(),
            charges.amount.tolist(),
            charges.seconds.tolist(),
            charges.tenant_id.tolist(),
            strict=True,
        ):
            entry = self.allocations.get(alloc_id)
            if entry is None:
                self.allocations[alloc_id] = [amount, seconds, tenant]
            else:
                entry[0] += amount
                entry[1] += seconds

    def paid(self, alloc: AllocationRow) -> int:
        """Micros the allocation has paid so far: written charges plus this leader's unwritten."""
        pending = self.allocations.get(alloc.id)
        return alloc.charged_micros + (pending[0] if pending else 0)

    def clear(self) -> None:
        self.allocations.clear()
        self.tenants.clear()

    def write(self, session: Session, market: Market) -> None:
        """Write the accrued charges (allocations' and tenants' ``spent_micros``) and each
        running allocation's price in force, ``charged_until`` and carry; then forget them."""
        ids, prices, charged, carry = market.charge_state()
        in_force = dict(
            zip(
                ids.tolist(),
                zip(prices.tolist(), charged.tolist(), carry.tolist(), strict=True),
                strict=True,
            )
        )
        rows, spent = [], defaultdict(int)
        for alloc_id, (amount, seconds, tenant) in self.allocations.items():
            price, until, owed_below_a_micro = in_force.get(alloc_id, (None, None, 0))
            rows.append(
                {
                    "b_id": alloc_id,
                    "b_amount": amount,
                    "b_seconds": seconds,
                    "b_price": price,
                    "b_until": until,
                    "b_carry": owed_below_a_micro,
                }
            )
            spent[int(tenant)] += amount
        for alloc_id, (price, until, owed_below_a_micro) in in_force.items():
            if alloc_id not in self.allocations:  # running, nothing charged yet
                rows.append(
                    {
                        "b_id": alloc_id,
                        "b_amount": 0,
                        "b_seconds": 0.0,
                        "b_price": price,
                        "b_until": until,
                        "b_carry": owed_below_a_micro,
                    }
                )
        gate.add_charges(session=session, rows=rows)
        for tenant_id, amount in spent.items():
            session.execute(
                update(Tenant)
                .where(Tenant.id == tenant_id)
                .values(spent_micros=Tenant.spent_micros + amount)
                .execution_options(synchronize_session=False)
            )
        self.clear()


def _sums_by(groups: np.ndarray, micros: np.ndarray, n: int) -> list[int]:
    """Exact integer sums of ``micros`` per group (``np.bincount`` sums in floats)."""
    sums = np.zeros(n, np.int64)
    np.add.at(sums, groups, micros)
    return sums.tolist()
