"""Bids held for their tenant's credit (``market/credit.py`` decides which; this applies it).

A held bid takes no new GPUs from the next tick on: its reservations are released, its running
allocations get a notice (``out_of_credit``, with no migration: there is nothing to resume on
until the tenant has credit), and it leaves the market once it holds nothing — the service
keeps it ``held`` and adds it again, as a new bid of the book, when credit returns. A hold
taken back before that (:meth:`Holds.unhold_bid`) lets the bid wait again as before.

Invariant: a row in ``MarketIndex.held`` is the first member of an open bid (a gang's, or a one-node
bid); :meth:`MarketIndex.to_waiting` closes such a bid instead of returning it to its book.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prefect_spotgpu.market.tables import ACTIVE, GONE, RELEASED, RESERVED, RUNNING
from prefect_spotgpu.market.types import EndReason, NoticeReason

if TYPE_CHECKING:
    from prefect_spotgpu.market.allocations import Allocations
    from prefect_spotgpu.market.index import MarketIndex


class Holds:
    """The credit holds of a market, on its index; notices and ends through its ``Allocations``."""

    def __init__(self, index: MarketIndex, allocations: Allocations) -> None:
        self.index = index
        self.allocations = allocations

    def hold_bid(self, bid_id: int) -> None:
        """Hold an open bid (every member of its gang) from the next tick (module doc)."""
        ix = self.index
        ix.held.add(ix.members(ix.bid_row_of(bid_id))[0])

    def unhold_bid(self, bid_id: int) -> bool:
        """Take a hold back while the bid is still in the market; whether it was."""
        ix = self.index
        row = ix.bid_row.get(bid_id)
        if row is None or ix.b.status[row] == GONE:
            return False
        leader = ix.members(row)[0]
        held = leader in ix.held
        ix.held.discard(leader)
        return held

    def is_held(self, bid_id: int) -> bool:
        ix = self.index
        row = ix.bid_row.get(bid_id)
        return row is not None and ix.members(row)[0] in ix.held

    def credit_rates(self) -> dict[int, tuple[float, float]]:
        """Each tenant's open bids as GPU-hour rates: ``(all, holding GPUs)``, the sums of
        maximum price x GPUs over its bids in the market (gang members each), not held."""
        ix = self.index
        b = ix.b
        n = b.n
        live = b.status[:n] != GONE
        if ix.held:
            for leader in ix.held:
                live[ix.members(leader)] = False
        if not live.any():
            return {}
        tenant = b.tenant[:n][live]
        rate = b.price[:n][live] * b.gpus[:n][live]
        holding = np.where(b.status[:n][live] == ACTIVE, rate, 0.0)
        if int(tenant.min()) >= 0 and int(tenant.max()) < 1 << 22:  # ids: one linear pass
            every = np.bincount(tenant, weights=rate)
            active = np.bincount(tenant, weights=holding, minlength=len(every))
            tenants = np.flatnonzero(np.bincount(tenant, minlength=len(every)))
            every, active = every[tenants], active[tenants]
        else:
            tenants, inverse = np.unique(tenant, return_inverse=True)
            every = np.bincount(inverse, weights=rate, minlength=len(tenants))
            active = np.bincount(inverse, weights=holding, minlength=len(tenants))
        return {
            int(t): (float(e), float(h))
            for t, e, h in zip(tenants.tolist(), every.tolist(), active.tolist(), strict=True)
        }

    def tenant_bids(self, tenant_id: int) -> list[tuple[int, float, int, bool]]:
        """A tenant's open bids not held, one per gang (its first member's id):
        ``(bid id, maximum price, GPUs of every member, holds GPUs)``, by id."""
        ix = self.index
        b = ix.b
        n = b.n
        rows = np.flatnonzero((b.tenant[:n] == tenant_id) & (b.status[:n] != GONE)).tolist()
        out = []
        for row in rows:
            members = ix.members(row)
            if members[0] != row or row in ix.held:
                continue
            gpus = int(sum(int(b.gpus[m]) for m in members))
            active = any(b.status[m] == ACTIVE for m in members)
            out.append((int(b.id[row]), float(b.price[row]), gpus, active))
        return sorted(out)

    def due(self, now: float) -> None:
        """Apply the holds: release reservations, notice what runs, close what is idle."""
        ix = self.index
        a, b = ix.a, ix.b
        deadline = now + ix.config.notice_seconds
        for leader in sorted(ix.held, key=lambda r: int(b.id[r])):
            members = ix.members(leader)
            for m in members:
                res = int(b.res[m])
                if res >= 0 and a.status[res] == RESERVED:
                    self.allocations.end(res, RELEASED, EndReason.BID_HELD, now)
            if leader not in ix.held:
                continue  # it left with its last reservation
            for m in members:
                run = int(b.run[m])
                if run >= 0 and a.status[run] == RUNNING:
                    self.allocations.notice(run, NoticeReason.OUT_OF_CREDIT, deadline, now)
            if all(ix.idle(m) for m in members):
                ix.close_held(members)
