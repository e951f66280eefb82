"""The clearing loop: free fits, claims on noticed GPUs, evictions
(docs/operators/architecture.md#design-3).

A part of ``Market``: reads and writes the state declared in
:mod:`prefect_spotgpu.market.index`; places and notices through the ``Allocations`` it is given
(allocations.py). A model whose pools held nothing at the start of the tick is decided by the
bulk admission instead (:mod:`prefect_spotgpu.market.bulk`), which writes its allocation rows
at once.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING

import numpy as np

from prefect_spotgpu.market.checks import MAX_GPUS_PER_NODE
from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.incumbents import bid_terms, incumbents, victims_on
from prefect_spotgpu.market.tables import RUNNING, WAITING
from prefect_spotgpu.market.types import NodeState

if TYPE_CHECKING:
    from prefect_spotgpu.market.allocations import Allocations
    from prefect_spotgpu.market.bulk import BulkAdmission
    from prefect_spotgpu.market.gangs import Gangs
    from prefect_spotgpu.market.index import MarketIndex


class Clearing:
    """The clearing of a market, one GPU model at a time: on its index, placing and noticing
    through its ``Allocations`` and ``Gangs``, a cold model through its ``BulkAdmission``."""

    def __init__(
        self, index: MarketIndex, allocations: Allocations, gangs: Gangs, bulk: BulkAdmission
    ) -> None:
        self.index = index
        self.allocations = allocations
        self.gangs = gangs
        self.bulk = bulk

    # ------------------------------------------------------------------ clearing

    def clear_model(self, model: int, now: float) -> None:
        ix = self.index
        b = ix.b
        open_books = [
            ix.books[i]
            for i in ix.model_books[model]
            if ix.books[i].count > 0 and ix.window_open(ix.books[i].window, now)
        ]
        if not open_books:
            return
        for p in ix.model_pools[model]:
            pool = ix.pools[p]
            pool.evict_failed_size = MAX_GPUS_PER_NODE + 1
        if ix.policy.perfect_packing:
            fresh = self.bulk.fresh_model(model)
            self.bulk.admit(model, open_books, now)
            if fresh:  # nothing to claim or evict: the loop below reduces to free fits
                self.bulk.replay_fresh(model, open_books, now)
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
            book = ix.books[bi]
            head = book.peek(*peek_args)
            if head is None:
                continue
            row = head[1]
            if b.gang[row] >= 0:  # a gang: all its members at once, or none
                if not self.gangs.place(row, now):
                    continue
                book.pop(row)
                nxt = book.peek(*peek_args)
                if nxt is not None:
                    heappush(heap, (nxt[0], bi))
                continue
            nrow = ix.free_fit(row)
            if nrow is not None:
                book.pop(row)
                self.allocations.place(row, nrow, PlacementKind.NEW, now)
            elif self._claim_noticed(row, now) or self._evict_for(row, now):
                book.pop(row)
            else:
                continue  # this book is done for the tick: its head is its highest loser
            nxt = book.peek(*peek_args)
            if nxt is not None:
                heappush(heap, (nxt[0], bi))

    def _claim_noticed(self, brow: int, now: float) -> bool:
        """Reserve GPUs that noticed allocations will free and nobody has claimed yet."""
        ix = self.index
        size, price, pools = bid_terms(ix, brow)
        cap, running, reserved = ix.n_cap, ix.n_running, ix.n_reserved
        reserve = ix.n_reserve
        image = int(ix.b.image[brow])
        fits = [  # (room, reserve, node id, row): the tightest first
            (cap[nrow] - running[nrow] - reserved[nrow], reserve[nrow], ix.n_id[nrow], nrow)
            for p in pools
            if p is not None
            for nrow in ix.pools[p].claimable  # (noticed nodes with room)
            if cap[nrow] - running[nrow] - reserved[nrow] >= size
            and reserve[nrow] <= price
            and ix.n_state[nrow] is NodeState.LIVE
            and ix.serves(nrow, image)
        ]
        if not fits:
            return False
        self.allocations.place(
            brow,
            min(fits)[-1],
            PlacementKind.TAKEOVER,
            now,
            now + ix.config.notice_seconds + ix.config.reservation_grace_seconds,
        )
        return True

    def _evict_for(self, brow: int, now: float) -> bool:
        """Notice the weakest incumbents a challenger beats on one node, and reserve it there."""
        ix = self.index
        a = ix.a
        size, price, pools = bid_terms(ix, brow)
        image = int(ix.b.image[brow])
        for p in pools:
            if p is None:
                continue
            pool = ix.pools[p]
            if size >= pool.evict_failed_size:
                continue
            rows, eff = incumbents(ix, pool)
            limit = int(np.searchsorted(eff, price, side="left"))  # eff < price
            start = pool.scan_from
            while start < limit and a.status[rows[start]] != RUNNING:
                start += 1
            pool.scan_from = start
            seen: set[int] = set()
            examined = 0
            for i in range(start, limit):
                arow = int(rows[i])
                if a.status[arow] != RUNNING or a.tick[arow] == ix.tick_number:
                    continue
                nrow = int(a.node[arow])
                if nrow in seen:
                    continue
                seen.add(nrow)
                examined += 1
                if examined > ix.config.eviction_scan_limit:
                    break
                chosen = victims_on(ix, nrow, size, price, image)
                if chosen is None:
                    continue
                deadline = now + ix.config.notice_seconds
                # reserve first, so a victim's migration cannot take these GPUs
                takeover = self.allocations.place(
                    brow,
                    nrow,
                    PlacementKind.TAKEOVER,
                    now,
                    deadline + ix.config.reservation_grace_seconds,
                )
                self.allocations.outbid(takeover, chosen, deadline, now)  # (and its fee)
                return True
            if not pool.mixed:  # (in a mixed pool, a bid of another kind may still evict)
                pool.evict_failed_size = min(pool.evict_failed_size, size)
        return False
