"""The clearing loop: free fits, claims on noticed GPUs, evictions
(docs/operators/architecture.md#design-3).

A part of ``Market``: reads and writes the state declared in
:mod:`prefect_spotgpu.market.index`; places and notices through ``_place`` and ``_notice``
(allocations.py). A model whose pools held nothing at the start of the tick is decided by the
bulk admission instead (:mod:`prefect_spotgpu.market.bulk`), which writes its allocation rows
at once.
"""

from __future__ import annotations

from heapq import heappop, heappush

import numpy as np

from prefect_spotgpu.market.bulk import IMAGE_AWARE_BULK_NODES as IMAGE_AWARE_BULK_NODES
from prefect_spotgpu.market.bulk import BulkAdmissionMixin
from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.tables import RUNNING, WAITING, Pool
from prefect_spotgpu.market.types import MAX_GPUS_PER_NODE, NodeState, NoticeReason


class ClearingMixin(BulkAdmissionMixin):
    """The clearing of :class:`prefect_spotgpu.market.engine.Market`, one GPU model at a time."""

    # ------------------------------------------------------------------ clearing

    def _bid_terms(self, brow: int) -> tuple[int, float, list[int | None]]:
        """A bid's GPU count, maximum price, and the pools it may use (its region's, or every
        pool of its model for an any-region bid)."""
        b = self.b
        model, region = int(b.model[brow]), int(b.region[brow])
        pools = self._model_pools[model] if region < 0 else [self._pool_index.get((model, region))]
        return int(b.gpus[brow]), float(b.price[brow]), pools

    def _clear_model(self, model: int, now: float) -> None:
        b = self.b
        open_books = [
            self._books[i]
            for i in self._model_books[model]
            if self._books[i].count > 0 and self._window_open(self._books[i].window, now)
        ]
        if not open_books:
            return
        for p in self._model_pools[model]:
            pool = self._pools[p]
            pool.evict_failed_size = MAX_GPUS_PER_NODE + 1
        if self._policy.perfect_packing:
            fresh = self._fresh_model(model)
            self._bulk_admit(model, open_books, now)
            if fresh:  # nothing to claim or evict: the loop below reduces to free fits
                self._replay_fresh(model, open_books, now)
                return
        heap: list[tuple[tuple[float, float, int], int]] = []
        peek_args = (b.status, b.epoch, b.price, b.created, b.id, WAITING)
        for book in open_books:
            head = book.peek(*peek_args)
            if head is not None:
                heap.append((head[0], book.index))
        heap.sort()
        while heap:
            _, bi = heappop(heap)
            book = self._books[bi]
            head = book.peek(*peek_args)
            if head is None:
                continue
            row = head[1]
            if b.gang[row] >= 0:  # a gang: all its members at once, or none
                if not self._place_gang(row, now):
                    continue
                book.pop(row)
                nxt = book.peek(*peek_args)
                if nxt is not None:
                    heappush(heap, (nxt[0], bi))
                continue
            nrow = self._free_fit(row)
            if nrow is not None:
                book.pop(row)
                self._place(row, nrow, PlacementKind.NEW, now)
            elif self._claim_noticed(row, now) or self._evict_for(row, now):
                book.pop(row)
            else:
                continue  # this book is done for the tick: its head is its highest loser
            nxt = book.peek(*peek_args)
            if nxt is not None:
                heappush(heap, (nxt[0], bi))

    def _incumbents(self, pool: Pool) -> tuple[np.ndarray, np.ndarray]:
        """Running allocations of the pool from before this tick, weakest first."""
        if pool.incumbents is None:
            a = self.a
            n = a.n
            rows = np.flatnonzero((a.pool[:n] == pool.index) & (a.status[:n] == RUNNING))
            eff = self.b.price[a.bid[rows]] * (1.0 + self.config.hysteresis)
            order = np.lexsort((-a.id[rows], eff))
            pool.incumbents, pool.incumbent_eff = rows[order], eff[order]
            pool.scan_from = 0
        return pool.incumbents, pool.incumbent_eff

    def _claim_noticed(self, brow: int, now: float) -> bool:
        """Reserve GPUs that noticed allocations will free and nobody has claimed yet."""
        size, price, pools = self._bid_terms(brow)
        cap, running, reserved = self.n_cap, self.n_running, self.n_reserved
        reserve = self.n_reserve
        image = int(self.b.image[brow])
        fits = [  # (room, reserve, node id, row): the tightest first
            (cap[nrow] - running[nrow] - reserved[nrow], reserve[nrow], self.n_id[nrow], nrow)
            for p in pools
            if p is not None
            for nrow in self._pools[p].claimable  # (noticed nodes with room)
            if cap[nrow] - running[nrow] - reserved[nrow] >= size
            and reserve[nrow] <= price
            and self.n_state[nrow] is NodeState.LIVE
            and self._serves(nrow, image)
        ]
        if not fits:
            return False
        self._place(
            brow,
            min(fits)[-1],
            PlacementKind.TAKEOVER,
            now,
            now + self.config.notice_seconds + self.config.reservation_grace_seconds,
        )
        return True

    def _victims_on(self, nrow: int, size: int, price: float, image: int = 0) -> list[int] | None:
        """The weakest running allocations of a node that a bid at ``price`` (with image id
        ``image``) beats by more than the hysteresis margin and whose GPUs give it ``size``, or
        None (also where the node does not serve the bid)."""
        a, b = self.a, self.b
        if not self.n_state[nrow].offers_capacity() or self.n_reserve[nrow] > price:
            return None
        if not self._serves(nrow, image):
            return None
        room = self.n_cap[nrow] - self.n_running[nrow] - self.n_reserved[nrow]
        if room + self.n_running[nrow] < size:
            return None
        if room >= size:
            return []  # (no victim needed)
        h = 1.0 + self.config.hysteresis
        victims = []  # (price, -id, row, GPUs): the weakest first, then the newest
        for r in self._node_alloc_rows(nrow):
            if a.status[r] == RUNNING and a.tick[r] != self._tick:
                beaten = float(b.price[a.bid[r]])
                if beaten * h < price:
                    victims.append((beaten, -int(a.id[r]), r, int(a.gpus[r])))
        victims.sort()
        chosen = []
        for _, _, r, gpus in victims:
            if room >= size:
                break
            chosen.append(r)
            room += gpus
        return chosen if room >= size else None

    def _evict_for(self, brow: int, now: float) -> bool:
        """Notice the weakest incumbents a challenger beats on one node, and reserve it there."""
        a = self.a
        size, price, pools = self._bid_terms(brow)
        image = int(self.b.image[brow])
        for p in pools:
            if p is None:
                continue
            pool = self._pools[p]
            if size >= pool.evict_failed_size:
                continue
            rows, eff = self._incumbents(pool)
            limit = int(np.searchsorted(eff, price, side="left"))  # eff < price
            start = pool.scan_from
            while start < limit and a.status[rows[start]] != RUNNING:
                start += 1
            pool.scan_from = start
            seen: set[int] = set()
            examined = 0
            for i in range(start, limit):
                arow = int(rows[i])
                if a.status[arow] != RUNNING or a.tick[arow] == self._tick:
                    continue
                nrow = int(a.node[arow])
                if nrow in seen:
                    continue
                seen.add(nrow)
                examined += 1
                if examined > self.config.eviction_scan_limit:
                    break
                chosen = self._victims_on(nrow, size, price, image)
                if chosen is None:
                    continue
                deadline = now + self.config.notice_seconds
                # reserve first, so a victim's migration cannot take these GPUs
                self._place(
                    brow,
                    nrow,
                    PlacementKind.TAKEOVER,
                    now,
                    deadline + self.config.reservation_grace_seconds,
                )
                for r in chosen:
                    self._notice(r, NoticeReason.OUTBID, deadline, now)
                return True
            if not pool.mixed:  # (in a mixed pool, a bid of another kind may still evict)
                pool.evict_failed_size = min(pool.evict_failed_size, size)
        return False
