"""The life of an allocation: create, notice, migrate, promote, end (a part of ``Market``).

Allocation rows change status only through ``_new_alloc``, ``_notice``, ``_try_promote`` and
``_end``, which keep the per-node GPU counters, the per-pool aggregates and the bid links
consistent with the rows. Every ending names its ``EndReason``. Reads and writes the state
declared in :mod:`prefect_spotgpu.market.index`; calls ``_final_charge`` (pricing.py).
"""

from __future__ import annotations

import math
from heapq import heappop, heappush

import numpy as np

from prefect_spotgpu.market.decision import (
    Ending,
    Notice,
    PlacementKind,
)
from prefect_spotgpu.market.index import MarketIndex
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


class AllocationsMixin(MarketIndex):
    """The allocation changes of :class:`prefect_spotgpu.market.engine.Market`."""

    # ------------------------------------------------------------------ allocations

    def _load_allocation(self, alloc: Allocation) -> None:
        brow = self._bid_row_of(alloc.bid_id)
        nrow = self._node_row[alloc.node_id]
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
            migration=alloc.kind == "migration",
        )
        arow = self._alloc_row_of(alloc.id)
        self.a.price[arow] = alloc.price
        self.a.charged[arow] = alloc.charged_until
        self.a.carry[arow] = alloc.charge_carry
        self.a.tick[arow] = -1
        self._suspect_nodes.add(nrow)

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
        s = self.a.reserve(1)
        arow = s.start
        a = self.a
        a.id[arow], a.bid[arow], a.node[arow] = alloc_id, brow, nrow
        a.pool[arow], a.gpus[arow], a.status[arow] = self.n_pool[nrow], gpus, status
        a.price[arow], a.charged[arow], a.started[arow] = 0.0, now, now
        a.carry[arow] = 0
        a.deadline[arow] = math.nan if deadline is None else deadline
        a.reason[arow] = -1 if reason is None else REASONS.index(reason)
        a.tick[arow] = self._tick
        a.mig[arow] = 1 if (migration and status == RESERVED) else 0
        self._alloc_row[alloc_id] = arow
        pool = self._pools[self.n_pool[nrow]]
        pool.busy += gpus
        if self._csr is not None:
            self._node_extra.setdefault(nrow, []).append(arow)
            self._extra_count += 1
        b = self.b
        if status == RESERVED:
            b.res[brow] = arow
        else:
            b.run[brow] = arow
        if b.status[brow] == WAITING:
            self._leave_book(brow)
        if status == RUNNING:
            self.n_running[nrow] += gpus
            if b.window[brow] >= 0:
                self._track_window(arow, True)
        elif status == NOTICED:
            self.n_noticed[nrow] += gpus
            pool.noticed_nodes.add(nrow)
            heappush(self._deadlines, (deadline, alloc_id, arow))
            if reason is NoticeReason.OUTBID:
                self._noticed_outbid.add(arow)
        else:
            self.n_reserved[nrow] += gpus
            if a.mig[arow]:
                self.n_res_mig[nrow] += gpus
            self._reserved.add(arow)
            heappush(self._deadlines, (deadline, alloc_id, arow))
        self._refresh_free(nrow)
        return arow

    def _place(
        self, brow: int, nrow: int, kind: PlacementKind, now: float, expires: float | None = None
    ) -> int:
        alloc_id = self._next_alloc_id
        self._next_alloc_id += 1
        gpus = int(self.b.gpus[brow])
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
        out = self._out
        out.p_alloc.append(alloc_id)
        out.p_bid.append(int(self.b.id[brow]))
        out.p_node.append(self.n_id[nrow])
        out.p_gpus.append(gpus)
        out.p_kind.append(KIND_CODES[kind])
        out.p_expires.append(math.nan if expires is None else expires)
        return arow

    def _notice(self, arow: int, reason: NoticeReason, deadline: float, now: float) -> None:
        """Notice a running allocation (and, for a gang, every running member: one notice,
        one deadline) and reserve where it resumes when the reason allows."""
        if self.a.status[arow] != RUNNING:
            return  # noticed already (with the rest of its gang)
        brow = int(self.a.bid[arow])
        if self.b.gang[brow] >= 0:
            self._notice_gang(arow, reason, deadline, now)
            return
        self._notice_one(arow, reason, deadline)
        if reason in MIGRATING_REASONS:
            self._migrate(brow, deadline, now)

    def _notice_one(self, arow: int, reason: NoticeReason, deadline: float) -> None:
        a = self.a
        nrow, gpus = int(a.node[arow]), int(a.gpus[arow])
        a.status[arow] = NOTICED
        a.deadline[arow] = deadline
        a.reason[arow] = REASONS.index(reason)
        self.n_running[nrow] -= gpus
        self.n_noticed[nrow] += gpus
        self._pools[self.n_pool[nrow]].noticed_nodes.add(nrow)
        self._track_window(arow, False)
        alloc_id = int(a.id[arow])
        heappush(self._deadlines, (deadline, alloc_id, arow))
        if reason is NoticeReason.OUTBID:
            self._noticed_outbid.add(arow)
        brow = int(a.bid[arow])
        self._out.notices.append(
            Notice(alloc_id, int(self.b.id[brow]), self.n_id[nrow], reason, deadline)
        )
        self._refresh_free(nrow)

    def _migrate(self, brow: int, deadline: float, now: float) -> None:
        """Reserve free GPUs of the bid's pool at once for a noticed bid
        (docs/operators/architecture.md#design-3)."""
        if self.b.res[brow] >= 0:
            return
        nrow = self._free_fit(brow)
        if nrow is not None:
            self._place(
                brow,
                nrow,
                PlacementKind.MIGRATION,
                now,
                deadline + self.config.reservation_grace_seconds,
            )

    def _end(self, arow: int, status: int, reason: EndReason, at: float) -> None:
        a = self.a
        old = int(a.status[arow])
        nrow, gpus, brow = int(a.node[arow]), int(a.gpus[arow]), int(a.bid[arow])
        if old == NOTICED:  # billed until its deadline at most, whoever ends it
            at = min(at, float(a.deadline[arow]))
        if old in (RUNNING, NOTICED):
            self._final_charge(arow, at)
        if old == RUNNING:
            self.n_running[nrow] -= gpus
            self._track_window(arow, False)
        elif old == NOTICED:
            self.n_noticed[nrow] -= gpus
            if not self.n_noticed[nrow]:
                self._pools[self.n_pool[nrow]].noticed_nodes.discard(nrow)
            self._noticed_outbid.discard(arow)
        else:
            self.n_reserved[nrow] -= gpus
            if a.mig[arow]:
                self.n_res_mig[nrow] -= gpus
            self._reserved.discard(arow)
        a.status[arow] = status
        self._pools[self.n_pool[nrow]].busy -= gpus
        if old == RUNNING:
            self._pools[int(a.pool[arow])].incumbents = None
        b = self.b
        if b.res[brow] == arow:
            b.res[brow] = -1
        if b.run[brow] == arow:
            b.run[brow] = -1
        if b.res[brow] < 0 and b.run[brow] < 0 and b.status[brow] == ACTIVE:
            self._to_waiting(brow)
        self._out.endings.append(
            Ending(
                int(a.id[arow]),
                int(self.b.id[brow]),
                self.n_id[nrow],
                STATUSES[status],
                reason,
                at,
                STATUSES[old],
            )
        )
        self._refresh_free(nrow)
        if b.gang[brow] >= 0 and not self._gang_ending:
            self._gang_cascade(brow, old, status, at)

    def _node_conditions(self, now: float) -> None:
        """Notices or endings for allocations on reclaimed, lost or re-priced nodes, and on
        nodes that no longer serve them (an agent restarted with another runner: to those
        jobs, the owner took the node back)."""
        suspects = sorted(self._suspect_nodes, key=self.n_id.__getitem__)
        self._suspect_nodes = set()
        a = self.a
        deadline = now + self.config.notice_seconds
        for nrow in suspects:
            state = self.n_state[nrow]
            for arow in self._node_allocs(nrow):
                status = a.status[arow]
                if status >= PREEMPTED:
                    continue  # ended with its gang on another node
                if state is NodeState.LOST:
                    ended = RELEASED if status == RESERVED else PREEMPTED
                    self._end(arow, ended, EndReason.NODE_LOST, now)
                elif state is NodeState.DRAINING and status == RESERVED:
                    self._end(arow, RELEASED, EndReason.NODE_DRAINING, now)
                elif state is NodeState.RECLAIMED or not self._serves(
                    nrow, int(self.b.image[a.bid[arow]])
                ):
                    if status == RESERVED:
                        self._end(arow, RELEASED, EndReason.NODE_RECLAIMED, now)
                    elif status == RUNNING:
                        self._notice(arow, NoticeReason.RECLAIMED, deadline, now)
                elif self.b.price[a.bid[arow]] < self.n_reserve[nrow]:
                    if status == RUNNING:
                        self._notice(arow, NoticeReason.BELOW_RESERVE, deadline, now)
                    elif status == RESERVED:
                        self._end(arow, RELEASED, EndReason.BELOW_RESERVE, now)

    def _deadlines_due(self, now: float) -> None:
        a = self.a
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, arow = heappop(heap)
            status = a.status[arow]
            if status in (NOTICED, RESERVED) and a.deadline[arow] == deadline:
                if status == NOTICED:
                    self._end(arow, PREEMPTED, EndReason.NOTICE_DEADLINE_PASSED, deadline)
                elif not self._try_promote(arow, now):  # late tick: start it if it can
                    self._end(arow, RELEASED, EndReason.RESERVATION_EXPIRED, deadline)

    def _windows_closing(self, now: float) -> None:
        a = self.a
        for window in sorted(self._window_allocs, key=self._windows.__getitem__):
            interval = self._windows[window]
            if interval.end - now > self.config.notice_seconds and interval.start <= now:
                continue
            deadline = max(interval.end, now) if interval.start <= now else now
            for arow in sorted(self._window_allocs[window], key=lambda r: a.id[r]):
                self._notice(arow, NoticeReason.WINDOW_CLOSING, deadline, now)

    def _promote(self, now: float) -> None:
        """Start every reservation that can start, by allocation id."""
        a, b = self.a, self.b
        rows = np.fromiter(self._reserved, np.int64, len(self._reserved))
        failed: dict[int, int] = {}  # gang -> promotions so far when it could not start
        for arow in rows[np.argsort(a.id[rows])].tolist():
            gang = int(b.gang[a.bid[arow]])
            if gang < 0:
                self._try_promote(arow, now)
                continue
            started = len(self._out.promotions)
            if failed.get(gang) == started:
                continue  # its check failed and nothing has started since: it fails again
            if not self._try_promote(arow, now):
                failed[gang] = started

    def _try_promote(self, arow: int, now: float) -> bool:
        """Start a reservation whose bid runs nowhere else and whose GPUs are free now."""
        brow = int(self.a.bid[arow])
        members = self._members(brow)
        if len(members) > 1:  # a gang starts whole: every member reserved and startable
            rows = [int(self.b.res[m]) for m in members]
            if min(rows) < 0 or not all(self._can_start(r, now) for r in rows):
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
        a = self.a
        brow, nrow, gpus = int(a.bid[arow]), int(a.node[arow]), int(a.gpus[arow])
        return (
            self.b.run[brow] < 0
            and self.n_running[nrow] + self.n_noticed[nrow] + gpus <= self.n_cap[nrow]
            and self.n_state[nrow] is NodeState.LIVE
            and self._serves(nrow, int(self.b.image[brow]))
            and self.b.price[brow] >= self.n_reserve[nrow]
            and self._window_open(int(self.b.window[brow]), now)  # else waits (or expires)
        )

    def _start(self, arow: int, now: float) -> None:
        """RESERVED -> RUNNING."""
        a = self.a
        brow, nrow, gpus = int(a.bid[arow]), int(a.node[arow]), int(a.gpus[arow])
        self._reserved.discard(arow)
        self.b.res[brow], self.b.run[brow] = -1, arow
        self.n_reserved[nrow] -= gpus
        if a.mig[arow]:
            self.n_res_mig[nrow] -= gpus
            a.mig[arow] = 0
        self.n_running[nrow] += gpus
        a.status[arow] = RUNNING
        a.charged[arow] = a.started[arow] = now
        a.deadline[arow] = math.nan
        a.tick[arow] = -1  # an incumbent: challengers of this tick may outbid it
        self._track_window(arow, True)
        self._out.promotions.append(int(a.id[arow]))
        self._refresh_free(nrow)
