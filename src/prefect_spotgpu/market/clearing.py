"""The clearing loop: free fits, bulk admission, claims on noticed GPUs, evictions (DESIGN §3).

A part of ``Market``: reads and writes the state declared in
:mod:`prefect_spotgpu.market.index`; places and notices through ``_place`` and ``_notice``
(allocations.py), except the bulk admission, which writes its allocation rows at once.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush

import numpy as np

from prefect_spotgpu.market.book import Book, priority_order
from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.tables import (
    ACTIVE,
    KIND_CODES,
    RUNNING,
    WAITING,
    Pool,
)
from prefect_spotgpu.market.types import (
    MAX_GPUS_PER_NODE,
    NoticeReason,
)

IMAGE_AWARE_BULK_NODES = 512
"""Fresh pools of at most this many nodes leave the bids with images to the one-by-one fit,
which prefers a node holding the image (at most a few thousand placements); larger ones are
packed in bulk whatever the images: a cold start of 10^6 bids one by one takes 5 s, not 1 s
(``benchmarks/clearing.py``). Every later tick places one by one, preferring images."""


class ClearingMixin(MarketIndex):
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
            self._bulk_admit(model, open_books, now)
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

    def _bulk_admit(self, model: int, open_books: list[Book], now: float) -> None:
        """Place the best bids of a model's empty, divisible pools at once, packed perfectly.

        A pool qualifies when nothing is allocated on its live nodes and they share one reserve;
        a book qualifies when its GPU count is a power of two that divides every node of its
        pool (every pool of the model, for an any-region book, and then only if all the model's
        pools qualify): sizes that divide each other pack exactly, largest first. Then
        any set of bids whose GPUs add up to at most a pool's GPUs packs exactly, largest first,
        so the greedy rule needs only each pool's remaining GPUs: a region bid is admitted when
        they suffice; an any-region bid goes to the pool whose smallest node fits it most
        tightly, then with the fewest remaining GPUs, then by region name (the nearest the
        one-by-one best fit gets without tracking nodes). It stops before the first bid of a
        book that does not qualify (and, where a node of these pools holds images and they have
        at most ``IMAGE_AWARE_BULK_NODES`` nodes, before the first bid with an image: the
        one-by-one fit prefers a node that has it); the one-by-one loop takes it from there.
        Bids are packed largest first into the smallest nodes first, so whole large nodes stay
        free longest.
        """
        b = self.b
        fresh: dict[int, tuple[Pool, list[int], float, int]] = {}
        all_fresh, any_gcd = True, 0
        for p in self._model_pools[model]:
            pool = self._pools[p]
            live = self._live(pool)
            if not live:
                continue
            reserve = pool.min_reserve
            if pool.busy or any(self.n_reserve[r] != reserve for r in live):
                all_fresh = False
                continue
            gcd = 0
            for r in live:
                gcd = math.gcd(gcd, self.n_cap[r])
            fresh[pool.region] = (pool, live, reserve, gcd)
            any_gcd = math.gcd(any_gcd, gcd)
        if not fresh:
            return
        mine, stop_key = [], None
        peek_args = (b.status, b.epoch, b.price, b.created, b.id, WAITING)
        for book in open_books:
            # powers of two divide each other; gangs need distinct nodes: one by one
            chain = book.size & (book.size - 1) == 0 and book.nodes == 1
            if book.region >= 0:
                entry = fresh.get(book.region)
                if entry is None:
                    continue  # another pool's book: it cannot take these GPUs
                qualifies = chain and entry[3] % book.size == 0
            else:
                qualifies = chain and all_fresh and any_gcd % book.size == 0
            if qualifies:
                mine.append(book)
                continue
            head = book.peek(*peek_args)
            if head is not None and (stop_key is None or head[0] < stop_key):
                stop_key = head[0]
        if not mine:
            return
        rows = np.concatenate([bk.live_rows(b.status, b.epoch, WAITING) for bk in mine])
        rows = rows[priority_order(b.price[rows], b.created[rows], b.id[rows])]
        if stop_key is not None:
            sp, sc, si = stop_key
            neg = -b.price[rows]
            ahead = (neg < sp) | (
                (neg == sp)
                & ((b.created[rows] < sc) | ((b.created[rows] == sc) & (b.id[rows] < si)))
            )
            rows = rows[: int(np.argmin(ahead)) if not ahead.all() else len(rows)]
        live_nodes = sum(len(entry[1]) for entry in fresh.values())
        if live_nodes <= IMAGE_AWARE_BULK_NODES and any(
            self.n_images[r] for entry in fresh.values() for r in entry[1]
        ):
            wants_image = b.image[rows] > 0  # placed one by one: they prefer their image's nodes
            if wants_image.any():
                rows = rows[: int(np.argmax(wants_image))]
        if len(rows) == 0:
            return
        # the greedy admission: each pool's remaining GPUs are all that matter
        regions = sorted(fresh, key=self._regions.__getitem__)
        remaining = {r: sum(self.n_cap[n] for n in fresh[r][1]) for r in regions}
        reserve = {r: fresh[r][2] for r in regions}
        smallest_node = {r: min(self.n_cap[n] for n in fresh[r][1]) for r in regions}
        left = sum(remaining.values())
        smallest = min(bk.size for bk in mine)
        won: list[int] = []
        won_region: list[int] = []
        for i, (region, size, price) in enumerate(
            zip(b.region[rows].tolist(), b.gpus[rows].tolist(), b.price[rows].tolist(), strict=True)
        ):
            if region >= 0:
                if remaining[region] >= size and price >= reserve[region]:
                    remaining[region] -= size
                else:
                    continue
            else:
                best, best_key = -1, None
                for r in regions:
                    room = remaining[r]
                    if room >= size and price >= reserve[r]:
                        key = (smallest_node[r] if smallest_node[r] >= size else 99, room)
                        if best_key is None or key < best_key:
                            best, best_key = r, key
                if best < 0:
                    continue
                remaining[best] -= size
                region = best
            won.append(i)
            won_region.append(region)
            left -= size
            if left < smallest:
                break
        if not won:
            return
        won_rows = rows[np.asarray(won, np.int64)]
        won_region_arr = np.asarray(won_region, np.int64)
        k = len(won_rows)
        gpus = b.gpus[won_rows].astype(np.int64)
        nrows = np.empty(k, np.int64)
        pool_of = np.empty(k, np.int64)
        for region in regions:
            pool, live, _, _ = fresh[region]
            live = sorted(live, key=lambda r: (self.n_cap[r], self.n_id[r]))  # small nodes first
            sel = np.flatnonzero(won_region_arr == region)
            if len(sel) == 0:
                continue
            g = gpus[sel]
            by_size = np.argsort(-g, kind="stable")
            offsets = np.cumsum(g[by_size]) - g[by_size]
            cum_cap = np.cumsum([self.n_cap[r] for r in live])
            node_pos = np.empty(len(sel), np.int64)
            node_pos[by_size] = np.searchsorted(cum_cap, offsets, side="right")
            nrows[sel] = np.asarray(live, np.int64)[node_pos]
            pool_of[sel] = pool.index
            used = np.bincount(node_pos, weights=g, minlength=len(live)).astype(np.int64)
            for r, u in zip(live, used.tolist(), strict=True):
                if u:
                    self.n_running[r] += u
                    self.n_free[r] = self.n_cap[r] - self.n_running[r]
            taken = int(g.sum())
            pool.busy += taken
            pool.free -= taken
            self._rebuild_capacity(pool, live)
        # record allocations (ids in priority order)
        alloc_ids = np.arange(self._next_alloc_id, self._next_alloc_id + k, dtype=np.int64)
        self._next_alloc_id += k
        s = self.a.reserve(k)
        a = self.a
        a.id[s], a.bid[s], a.node[s], a.pool[s] = alloc_ids, won_rows, nrows, pool_of
        a.gpus[s], a.status[s], a.price[s], a.charged[s] = gpus, RUNNING, 0.0, now
        a.started[s], a.deadline[s], a.reason[s], a.tick[s] = now, math.nan, -1, self._tick
        b.status[won_rows] = ACTIVE
        b.run[won_rows] = np.arange(s.start, s.stop)
        self._alloc_blocks.append((int(alloc_ids[0]), int(alloc_ids[-1]) + 1, s.start))
        self._csr = None
        for book in mine:
            rest = book.rows[book.head :]
            alive = (b.status[rest] == WAITING) & (b.epoch[rest] == book.epochs[book.head :])
            book.head += int(np.argmax(alive)) if alive.any() else len(rest)
            book.count = int(np.count_nonzero(alive)) + sum(
                1 for *_, r, e in book.delta if b.status[r] == WAITING and b.epoch[r] == e
            )
        windows = b.window[won_rows]
        if (windows >= 0).any():
            for arow in np.arange(s.start, s.stop)[windows >= 0].tolist():
                self._track_window(arow, True)
        self._out.add_chunk(
            alloc_ids,
            b.id[won_rows],
            np.asarray(self.n_id, np.int64)[nrows],
            gpus,
            np.full(k, KIND_CODES[PlacementKind.NEW], np.int8),
            np.full(k, math.nan),
        )

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
        best = None
        for p in pools:
            if p is None:
                continue
            for nrow in self._pools[p].noticed_nodes:
                if not self.n_state[nrow].offers_capacity() or self.n_reserve[nrow] > price:
                    continue
                room = self.n_cap[nrow] - self.n_running[nrow] - self.n_reserved[nrow]
                if room >= size:
                    key = (room, self.n_reserve[nrow], self.n_id[nrow])
                    if best is None or key < best[0]:
                        best = (key, nrow)
        if best is None:
            return False
        self._place(
            brow,
            best[1],
            PlacementKind.TAKEOVER,
            now,
            now + self.config.notice_seconds + self.config.reservation_grace_seconds,
        )
        return True

    def _victims_on(self, nrow: int, size: int, price: float) -> list[int] | None:
        """The weakest running allocations of a node that a bid at ``price`` beats by more
        than the hysteresis margin and whose GPUs give it ``size``, or None."""
        a, b = self.a, self.b
        if not self.n_state[nrow].offers_capacity() or self.n_reserve[nrow] > price:
            return None
        room = self.n_cap[nrow] - self.n_running[nrow] - self.n_reserved[nrow]
        if room + self.n_running[nrow] < size:
            return None
        h = 1.0 + self.config.hysteresis
        victims = sorted(
            (
                r
                for r in self._node_allocs(nrow)
                if a.status[r] == RUNNING
                and a.tick[r] != self._tick
                and b.price[a.bid[r]] * h < price
            ),
            key=lambda r: (float(b.price[a.bid[r]]), -int(a.id[r])),
        )
        chosen = []
        for r in victims:
            if room >= size:
                break
            chosen.append(r)
            room += int(a.gpus[r])
        return chosen if room >= size else None

    def _evict_for(self, brow: int, now: float) -> bool:
        """Notice the weakest incumbents a challenger beats on one node, and reserve it there."""
        a = self.a
        size, price, pools = self._bid_terms(brow)
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
                chosen = self._victims_on(nrow, size, price)
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
            pool.evict_failed_size = min(pool.evict_failed_size, size)
        return False
