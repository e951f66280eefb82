"""The life of an allocation: create, notice, migrate, promote, end (a part of ``Market``).

Allocation rows change status only through ``_new_alloc``, ``notice``, ``_try_promote`` and
``end``, which keep the per-node GPU counters, the per-pool aggregates and the bid links
consistent with the rows. Every ending names its ``EndReason``. A takeover that notices the
allocations it outbid (``outbid``) owes their notice's fee, charged at its end for what its
charges did not cover (:mod:`prefect_spotgpu.market.notice_fee`). Reads and writes the state
declared in :mod:`prefect_spotgpu.market.index`; calls ``Pricing.final_charge``.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Protocol

import numpy as np

from prefect_spotgpu.market.decision import (
    Ending,
    Notice,
    NoticeFee,
    PlacementKind,
)
from prefect_spotgpu.market.notice_fee import fee_due, notice_fee
from prefect_spotgpu.market.tables import (
    ACTIVE,
    KIND_CODES,
    MIGRATING_REASONS,
    NOTICED,
    PREEMPTED,
    REASONS,
    RELEASED,
    RESERVED,
    RUNNING,
    STATUSES,
    WAITING,
)
from prefect_spotgpu.market.types import (
    Allocation,
    EndReason,
    NodeState,
    NoticeReason,
)

if TYPE_CHECKING:
    from prefect_spotgpu.market.index import MarketIndex
    from prefect_spotgpu.market.pricing import Pricing


class GangRules(Protocol):
    """What an allocation change asks of the gang rules (``gangs.Gangs``): a notice to a
    gang member notices its gang, and an ending may end or park its gang."""

    def notice(self, arow: int, reason: NoticeReason, deadline: float, now: float) -> None: ...

    def cascade(self, brow: int, old: int, status: int, at: float) -> None: ...


class Allocations:
    """The allocation changes of a market, on its index: final charges through its
    ``Pricing``, gang members through its gang rules (``gangs``: given once both exist, the
    one cycle between the parts, as the gang rules place and end allocations through this)."""

    gangs: GangRules

    def __init__(self, index: MarketIndex, pricing: Pricing) -> None:
        self.index = index
        self.pricing = pricing

    # ------------------------------------------------------------------ allocations

    def load(self, alloc: Allocation) -> None:
        ix = self.index
        brow = ix.bid_row_of(alloc.bid_id)
        nrow = ix.node_row[alloc.node_id]
        status = STATUSES.index(alloc.status)
        self._new_alloc(
            alloc.id,
            brow,
            nrow,
            alloc.gpu_count,
            status,
            alloc.started_at,
            alloc.deadline,
            alloc.notice_reason,
            migration=alloc.kind == PlacementKind.MIGRATION,
        )
        arow = ix.alloc_row_of(alloc.id)
        ix.a.price[arow] = alloc.price
        ix.a.charged[arow] = alloc.charged_until
        ix.a.carry[arow] = alloc.charge_carry
        ix.a.fee_owed[arow] = alloc.notice_fee_owed
        ix.a.tick[arow] = -1
        ix.suspect_nodes.add(nrow)

    def _new_alloc(
        self,
        alloc_id: int,
        brow: int,
        nrow: int,
        gpus: int,
        status: int,
        now: float,
        deadline: float | None,
        reason: NoticeReason | None,
        migration: bool = False,
    ) -> int:
        ix = self.index
        s = ix.a.reserve(1)
        arow = s.start
        a = ix.a
        a.id[arow], a.bid[arow], a.node[arow] = alloc_id, brow, nrow
        a.pool[arow], a.gpus[arow], a.status[arow] = ix.n_pool[nrow], gpus, status
        a.price[arow], a.charged[arow], a.started[arow] = 0.0, now, now
        a.carry[arow] = a.fee_owed[arow] = 0
        a.deadline[arow] = math.nan if deadline is None else deadline
        a.reason[arow] = -1 if reason is None else REASONS.index(reason)
        a.tick[arow] = ix.tick_number
        a.mig[arow] = 1 if (migration and status == RESERVED) else 0
        ix.alloc_row[alloc_id] = arow
        pool = ix.pools[ix.n_pool[nrow]]
        pool.busy += gpus
        if ix.csr is not None:
            ix.node_extra.setdefault(nrow, []).append(arow)
            ix.extra_count += 1
        b = ix.b
        if status == RESERVED:
            b.res[brow] = arow
        else:
            b.run[brow] = arow
        if b.status[brow] == WAITING:
            ix.leave_book(brow)
        if status == RUNNING:
            ix.n_running[nrow] += gpus
            if b.window[brow] >= 0:
                ix.track_window(arow, True)
        elif status == NOTICED:
            ix.n_noticed[nrow] += gpus
            pool.noticed_nodes.add(nrow)
            heappush(ix.deadlines, (deadline, alloc_id, arow))
            if reason is NoticeReason.OUTBID:
                ix.noticed_outbid.add(arow)
        else:
            ix.n_reserved[nrow] += gpus
            if a.mig[arow]:
                ix.n_res_mig[nrow] += gpus
            ix.reserved.add(arow)
            heappush(ix.deadlines, (deadline, alloc_id, arow))
        ix.refresh_free(nrow)
        return arow

    def place(
        self, brow: int, nrow: int, kind: PlacementKind, now: float, expires: float | None = None
    ) -> int:
        ix = self.index
        alloc_id = ix.next_alloc_id
        ix.next_alloc_id += 1
        gpus = int(ix.b.gpus[brow])
        status = RUNNING if kind is PlacementKind.NEW else RESERVED
        arow = self._new_alloc(
            alloc_id,
            brow,
            nrow,
            gpus,
            status,
            now,
            expires,
            None,
            migration=kind is PlacementKind.MIGRATION,
        )
        out = ix.out
        out.p_alloc.append(alloc_id)
        out.p_bid.append(int(ix.b.id[brow]))
        out.p_node.append(ix.n_id[nrow])
        out.p_gpus.append(gpus)
        out.p_kind.append(KIND_CODES[kind])
        out.p_expires.append(math.nan if expires is None else expires)
        return arow

    def outbid(self, takeover: int, victims: list[int], deadline: float, now: float) -> None:
        """Notice ``victims`` (running allocations on the node of the reservation
        ``takeover``, which outbid them), and make the takeover owe their notice's fee: its
        GPUs for the notice's seconds at the highest maximum it outbid
        (:mod:`prefect_spotgpu.market.notice_fee`)."""
        ix = self.index
        a, b = ix.a, ix.b
        brow = int(a.bid[takeover])
        a.fee_owed[takeover] = notice_fee(
            outbid_prices=[float(b.price[a.bid[r]]) for r in victims],
            reserve=ix.n_reserve[int(a.node[takeover])],
            max_price=float(b.price[brow]),
            gpus=int(a.gpus[takeover]),
            notice_seconds=deadline - now,
        )
        for r in victims:
            self.notice(r, NoticeReason.OUTBID, deadline, now)

    def notice(self, arow: int, reason: NoticeReason, deadline: float, now: float) -> None:
        """Notice a running allocation (and, for a gang, every running member: one notice,
        one deadline) and reserve where it resumes when the reason allows."""
        ix = self.index
        if ix.a.status[arow] != RUNNING:
            return  # noticed already (with the rest of its gang)
        brow = int(ix.a.bid[arow])
        if ix.b.gang[brow] >= 0:
            self.gangs.notice(arow, reason, deadline, now)
            return
        self.notice_one(arow, reason, deadline)
        if reason in MIGRATING_REASONS:
            self._migrate(brow, deadline, now)

    def notice_one(self, arow: int, reason: NoticeReason, deadline: float) -> None:
        ix = self.index
        a = ix.a
        nrow, gpus = int(a.node[arow]), int(a.gpus[arow])
        a.status[arow] = NOTICED
        a.deadline[arow] = deadline
        a.reason[arow] = REASONS.index(reason)
        ix.n_running[nrow] -= gpus
        ix.n_noticed[nrow] += gpus
        ix.pools[ix.n_pool[nrow]].noticed_nodes.add(nrow)
        ix.track_window(arow, False)
        alloc_id = int(a.id[arow])
        heappush(ix.deadlines, (deadline, alloc_id, arow))
        if reason is NoticeReason.OUTBID:
            ix.noticed_outbid.add(arow)
        brow = int(a.bid[arow])
        ix.out.notices.append(Notice(alloc_id, int(ix.b.id[brow]), ix.n_id[nrow], reason, deadline))
        ix.refresh_free(nrow)

    def _migrate(self, brow: int, deadline: float, now: float) -> None:
        """Reserve free GPUs of the bid's pool at once for a noticed bid
        (docs/operators/architecture.md#design-3)."""
        ix = self.index
        if ix.b.res[brow] >= 0:
            return
        nrow = ix.free_fit(brow)
        if nrow is not None:
            self.place(
                brow,
                nrow,
                PlacementKind.MIGRATION,
                now,
                deadline + ix.config.reservation_grace_seconds,
            )

    def end(self, arow: int, status: int, reason: EndReason, at: float) -> None:
        ix = self.index
        a = ix.a
        old = int(a.status[arow])
        nrow, gpus, brow = int(a.node[arow]), int(a.gpus[arow]), int(a.bid[arow])
        if old == NOTICED:  # billed until its deadline at most, whoever ends it
            at = min(at, float(a.deadline[arow]))
        if old in (RUNNING, NOTICED):
            self.pricing.final_charge(arow, at)
        if a.fee_owed[arow] > 0:  # (after its last charge, which counts towards it)
            self._settle_fee(arow, old, reason)
        if old == RUNNING:
            ix.n_running[nrow] -= gpus
            ix.track_window(arow, False)
        elif old == NOTICED:
            ix.n_noticed[nrow] -= gpus
            if not ix.n_noticed[nrow]:
                ix.pools[ix.n_pool[nrow]].noticed_nodes.discard(nrow)
            ix.noticed_outbid.discard(arow)
        else:
            ix.n_reserved[nrow] -= gpus
            if a.mig[arow]:
                ix.n_res_mig[nrow] -= gpus
            ix.reserved.discard(arow)
        a.status[arow] = status
        ix.pools[ix.n_pool[nrow]].busy -= gpus
        if old == RUNNING:
            ix.pools[int(a.pool[arow])].incumbents = None
        b = ix.b
        if b.res[brow] == arow:
            b.res[brow] = -1
        if b.run[brow] == arow:
            b.run[brow] = -1
        if b.res[brow] < 0 and b.run[brow] < 0 and b.status[brow] == ACTIVE:
            ix.to_waiting(brow)
        ix.out.endings.append(
            Ending(
                int(a.id[arow]),
                int(ix.b.id[brow]),
                ix.n_id[nrow],
                STATUSES[status],
                reason,
                at,
                STATUSES[old],
            )
        )
        ix.refresh_free(nrow)
        if b.gang[brow] >= 0 and not ix.gang_ending:
            self.gangs.cascade(brow, old, status, at)

    def _settle_fee(self, arow: int, old: int, reason: EndReason) -> None:
        """Charge what an ending allocation still owes of its notice fee (unless its node
        ended it: ``notice_fee.fee_due``)."""
        ix = self.index
        a = ix.a
        owed, a.fee_owed[arow] = int(a.fee_owed[arow]), 0
        noticed_for = REASONS[a.reason[arow]] if old == NOTICED else None
        due = fee_due(owed, reason, noticed_for)
        if due:
            brow = int(a.bid[arow])
            ix.out.fees.append(
                NoticeFee(int(a.id[arow]), int(ix.b.id[brow]), int(ix.b.tenant[brow]), due)
            )

    def node_conditions(self, now: float) -> None:
        """Notices or endings for allocations on reclaimed, lost or re-priced nodes, and on
        nodes that no longer serve them (an agent restarted with another runner: to those
        jobs, the owner took the node back)."""
        ix = self.index
        suspects = sorted(ix.suspect_nodes, key=ix.n_id.__getitem__)
        ix.suspect_nodes = set()
        a = ix.a
        deadline = now + ix.config.notice_seconds
        for nrow in suspects:
            state = ix.n_state[nrow]
            for arow in ix.node_allocs(nrow):
                status = a.status[arow]
                if status >= PREEMPTED:
                    continue  # ended with its gang on another node
                if state is NodeState.LOST:
                    ended = RELEASED if status == RESERVED else PREEMPTED
                    self.end(arow, ended, EndReason.NODE_LOST, now)
                elif state is NodeState.DRAINING and status == RESERVED:
                    self.end(arow, RELEASED, EndReason.NODE_DRAINING, now)
                elif state is NodeState.RECLAIMED or not ix.serves(
                    nrow, int(ix.b.image[a.bid[arow]])
                ):
                    if status == RESERVED:
                        self.end(arow, RELEASED, EndReason.NODE_RECLAIMED, now)
                    elif status == RUNNING:
                        self.notice(arow, NoticeReason.RECLAIMED, deadline, now)
                elif ix.b.price[a.bid[arow]] < ix.n_reserve[nrow]:
                    if status == RUNNING:
                        self.notice(arow, NoticeReason.BELOW_RESERVE, deadline, now)
                    elif status == RESERVED:
                        self.end(arow, RELEASED, EndReason.BELOW_RESERVE, now)

    def deadlines_due(self, now: float) -> None:
        ix = self.index
        a = ix.a
        heap = ix.deadlines
        while heap and heap[0][0] <= now:
            deadline, _, arow = heappop(heap)
            status = a.status[arow]
            if status in (NOTICED, RESERVED) and a.deadline[arow] == deadline:
                if status == NOTICED:
                    self.end(arow, PREEMPTED, EndReason.NOTICE_DEADLINE_PASSED, deadline)
                elif not self._try_promote(arow, now):  # late tick: start it if it can
                    self.end(arow, RELEASED, EndReason.RESERVATION_EXPIRED, deadline)

    def windows_closing(self, now: float) -> None:
        ix = self.index
        a = ix.a
        for window in sorted(ix.window_allocs, key=ix.windows.__getitem__):
            interval = ix.windows[window]
            if interval.end - now > ix.config.notice_seconds and interval.start <= now:
                continue
            deadline = max(interval.end, now) if interval.start <= now else now
            for arow in sorted(ix.window_allocs[window], key=lambda r: a.id[r]):
                self.notice(arow, NoticeReason.WINDOW_CLOSING, deadline, now)

    def promote(self, now: float) -> None:
        """Start every reservation that can start, by allocation id."""
        ix = self.index
        a, b = ix.a, ix.b
        rows = np.fromiter(ix.reserved, np.int64, len(ix.reserved))
        failed: dict[int, int] = {}  # gang -> promotions so far when it could not start
        for arow in rows[np.argsort(a.id[rows])].tolist():
            gang = int(b.gang[a.bid[arow]])
            if gang < 0:
                self._try_promote(arow, now)
                continue
            started = len(ix.out.promotions)
            if failed.get(gang) == started:
                continue  # its check failed and nothing has started since: it fails again
            if not self._try_promote(arow, now):
                failed[gang] = started

    def _try_promote(self, arow: int, now: float) -> bool:
        """Start a reservation whose bid runs nowhere else and whose GPUs are free now."""
        ix = self.index
        brow = int(ix.a.bid[arow])
        members = ix.members(brow)
        if len(members) > 1:  # a gang starts at once: every reserved member startable, no
            b = ix.b  # member running, and at least its fewest nodes (all, unless it may shrink)
            rows = [int(b.res[m]) for m in members if b.res[m] >= 0]
            least = ix.books[b.book[members[0]]].least
            if len(rows) < least or any(b.run[m] >= 0 for m in members):
                return False
            if not all(self._can_start(r, now) for r in rows):
                return False
            for r in rows:
                self._start(r, now)
            return True
        if not self._can_start(arow, now):
            return False
        self._start(arow, now)
        return True

    def _can_start(self, arow: int, now: float) -> bool:
        """Whether a reservation may run now: its bid runs nowhere else, its GPUs are free,
        its node is live and serves it, its reserve is met and its window is open."""
        ix = self.index
        a = ix.a
        brow, nrow, gpus = int(a.bid[arow]), int(a.node[arow]), int(a.gpus[arow])
        return (
            ix.b.run[brow] < 0
            and ix.n_running[nrow] + ix.n_noticed[nrow] + gpus <= ix.n_cap[nrow]
            and ix.n_state[nrow] is NodeState.LIVE
            and ix.serves(nrow, int(ix.b.image[brow]))
            and ix.b.price[brow] >= ix.n_reserve[nrow]
            and ix.window_open(int(ix.b.window[brow]), now)  # else waits (or expires)
        )

    def _start(self, arow: int, now: float) -> None:
        """RESERVED -> RUNNING."""
        ix = self.index
        a = ix.a
        brow, nrow, gpus = int(a.bid[arow]), int(a.node[arow]), int(a.gpus[arow])
        ix.reserved.discard(arow)
        ix.b.res[brow], ix.b.run[brow] = -1, arow
        ix.n_reserved[nrow] -= gpus
        if a.mig[arow]:
            ix.n_res_mig[nrow] -= gpus
            a.mig[arow] = 0
        ix.n_running[nrow] += gpus
        a.status[arow] = RUNNING
        a.charged[arow] = a.started[arow] = now
        a.deadline[arow] = math.nan
        a.tick[arow] = -1  # an incumbent: challengers of this tick may outbid it
        ix.track_window(arow, True)
        ix.out.promotions.append(int(a.id[arow]))
        ix.refresh_free(nrow)
