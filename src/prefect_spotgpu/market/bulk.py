"""Bulk admission: the fast paths of a cold tick, where a model's pools hold nothing yet.

A part of ``Market``, given to its ``Clearing``. Both paths write their allocation rows at once
(``_record_running``) instead of through ``Allocations.place``:

- ``admit`` packs the best bids of empty pools whose bid sizes divide every node size
  perfectly, largest first (its own placement rule, documented there);
- ``replay_fresh`` then decides every other bid of a model whose pools held nothing at the
  start of the tick -- gangs among them -- exactly as the one-by-one loop of ``clearing.py``
  would (the same bids, nodes, allocation ids and order), only without its per-bid
  bookkeeping: in such a model no allocation is noticed, reserved or from an earlier tick, so
  no bid can claim noticed GPUs or evict anyone, and the loop reduces to free fits: a bid
  takes the tightest free fit (best fit), a gang its ``node_count`` tightest distinct fits in
  the first pool that has them, and a book whose head finds no fit is done for the tick.
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush

import numpy as np

from prefect_spotgpu.market.book import ROW_BITS, ROW_MASK, Book, priority_order
from prefect_spotgpu.market.checks import MAX_GPUS_PER_NODE
from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.tables import ACTIVE, KIND_CODES, RUNNING, WAITING, Pool

IMAGE_AWARE_BULK_NODES = 512
"""Fresh pools of at most this many nodes leave the bids with images to the one-by-one fit,
which prefers a node holding the image (at most a few thousand placements); larger ones are
packed in bulk whatever the images: a cold start of 10^6 bids one by one takes 5 s, not 1 s
(``benchmarks/clearing.py``). Every later tick places one by one, preferring images."""

REPLAY_SLICE = 4096
"""The fewest bids ``replay_fresh`` sorts at a time."""


def first_slice(free_gpus: int, mean_gpus: float) -> int:
    """How many of its best bids ``replay_fresh`` sorts first: twice as many as the free GPUs
    could hold, plus ``REPLAY_SLICE`` (each further slice is twice the one before)."""
    return REPLAY_SLICE + int(2 * free_gpus / max(mean_gpus, 1.0))


class BulkAdmission:
    """The bulk admission of a market's cold tick, on its index (module doc)."""

    def __init__(self, index: MarketIndex) -> None:
        self.index = index

    def admit(self, model: int, open_books: list[Book], now: float) -> None:
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
        one-by-one fit prefers a node that has it); the one-by-one loop (in a fresh model, its
        replay) takes it from there.
        Bids are packed largest first into the smallest nodes first, so whole large nodes stay
        free longest.
        """
        ix = self.index
        b = ix.b
        fresh: dict[int, tuple[Pool, list[int], float, int]] = {}
        all_fresh, any_gcd = True, 0
        for p in ix.model_pools[model]:
            pool = ix.pools[p]
            live = ix.live(pool)
            if not live:
                continue
            reserve = pool.min_reserve
            if pool.busy or pool.mixed or any(ix.n_reserve[r] != reserve for r in live):
                all_fresh = False
                continue
            gcd = 0
            for r in live:
                gcd = math.gcd(gcd, ix.n_cap[r])
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
        if stop_key is not None:  # only the bids ahead of the stop (sorting fewer)
            sp, sc, si = stop_key
            neg = -b.price[rows]
            ahead = (neg < sp) | (
                (neg == sp)
                & ((b.created[rows] < sc) | ((b.created[rows] == sc) & (b.id[rows] < si)))
            )
            rows = rows[ahead]
        rows = rows[priority_order(b.price[rows], b.created[rows], b.id[rows])]
        live_nodes = sum(len(entry[1]) for entry in fresh.values())
        if live_nodes <= IMAGE_AWARE_BULK_NODES and any(
            ix.n_images[r] for entry in fresh.values() for r in entry[1]
        ):
            wants_image = b.image[rows] > 0  # placed one by one: they prefer their image's nodes
            if wants_image.any():
                rows = rows[: int(np.argmax(wants_image))]
        if len(rows) == 0:
            return
        # the greedy admission: each pool's remaining GPUs are all that matter
        regions = sorted(fresh, key=ix.regions.__getitem__)
        remaining = {r: sum(ix.n_cap[n] for n in fresh[r][1]) for r in regions}
        reserve = {r: fresh[r][2] for r in regions}
        smallest_node = {r: min(ix.n_cap[n] for n in fresh[r][1]) for r in regions}
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
            live = sorted(live, key=lambda r: (ix.n_cap[r], ix.n_id[r]))  # small nodes first
            sel = np.flatnonzero(won_region_arr == region)
            if len(sel) == 0:
                continue
            g = gpus[sel]
            by_size = np.argsort(-g, kind="stable")
            offsets = np.cumsum(g[by_size]) - g[by_size]
            cum_cap = np.cumsum([ix.n_cap[r] for r in live])
            node_pos = np.empty(len(sel), np.int64)
            node_pos[by_size] = np.searchsorted(cum_cap, offsets, side="right")
            nrows[sel] = np.asarray(live, np.int64)[node_pos]
            pool_of[sel] = pool.index
            used = np.bincount(node_pos, weights=g, minlength=len(live)).astype(np.int64)
            for r, u in zip(live, used.tolist(), strict=True):
                if u:
                    ix.n_running[r] += u
                    ix.n_free[r] = ix.n_cap[r] - ix.n_running[r]
            taken = int(g.sum())
            pool.busy += taken
            pool.free -= taken
            ix.rebuild_capacity(pool, live)
        self._record_running(won_rows, nrows, pool_of, gpus, now, mine)

    def fresh_model(self, model: int) -> bool:
        """Whether every pool of a model that has live nodes holds no allocation at all, at one
        reserve, on nodes that hold no image (so the image preference cannot matter): the
        condition under which ``replay_fresh`` may decide the model's tick."""
        ix = self.index
        pools = [ix.pools[p] for p in ix.model_pools[model]]
        if any(pool.busy for pool in pools if ix.live(pool)):
            return False
        for pool in pools:
            reserve = pool.min_reserve
            if pool.mixed or any(ix.n_reserve[r] != reserve or ix.n_images[r] for r in pool.live):
                return False
        return True

    def replay_fresh(self, model: int, open_books: list[Book], now: float) -> None:
        """Decide the rest of a fresh model's tick (``fresh_model`` held before
        ``admit``) exactly as the one-by-one loop would (module doc).

        Every waiting bid of the open books, best first, until no GPU is free or every book
        is done; the bids are sorted a highest-priced slice at a time (a cold tick places only
        its best bids, so most are never looked at).
        """
        ix = self.index
        b = ix.b
        pools = [ix.pools[p] for p in ix.model_pools[model]]
        fits = FreeFits(ix, pools, len(open_books))
        if fits.free_gpus == 0:
            return  # nothing fits anywhere: every book's head waits
        rest = np.concatenate([bk.live_rows(b.status, b.epoch, WAITING) for bk in open_books])
        nodes_of = {bk.index: bk.nodes for bk in open_books}
        least_of = {bk.index: bk.least for bk in open_books}
        chunk = first_slice(fits.free_gpus, float(b.gpus[rest].mean()) if len(rest) else 1.0)
        while len(rest):
            if len(rest) > chunk:  # the best ``chunk`` bids and every bid at their lowest price
                price = b.price[rest]
                take = price >= np.partition(price, len(rest) - chunk)[len(rest) - chunk]
                part, rest = rest[take], rest[~take]
            else:
                part, rest = rest, rest[:0]
            part = part[priority_order(b.price[part], b.created[part], b.id[part])]
            if fits.replay(part, b, ix.gangs, nodes_of, least_of):
                break
            chunk *= 2
        if not fits.won:
            return
        brows = np.asarray(fits.won, np.int64)
        keys = np.asarray(fits.won_key, np.int64)
        nrows = keys & ROW_MASK
        gpus = b.gpus[brows].astype(np.int64)
        used = np.bincount(nrows, weights=gpus, minlength=len(ix.n_id)).astype(np.int64)
        touched = np.flatnonzero(used)
        for r, u in zip(touched.tolist(), used[touched].tolist(), strict=True):
            ix.n_running[r] += u
            ix.n_free[r] = ix.n_cap[r] - ix.n_running[r]
        pool_of = np.asarray(fits.won_pool, np.int64)
        for pool in pools:
            taken = int(gpus[pool_of == pool.index].sum())
            if taken:
                pool.busy += taken
                pool.free -= taken
                ix.rebuild_capacity(pool, pool.live)
        books = [ix.books[i] for i in np.unique(b.book[brows]).tolist()]
        self._record_running(brows, nrows, pool_of, gpus, now, books, keys >> ROW_BITS)
        b.status[np.asarray(fits.parked, np.int64)] = ACTIVE

    def _record_running(
        self,
        brows: np.ndarray,
        nrows: np.ndarray,
        pool_of: np.ndarray,
        gpus: np.ndarray,
        now: float,
        books: list[Book],
        node_ids: np.ndarray | None = None,
    ) -> None:
        """Write placements decided in bulk (the nodes' GPU counters already moved): RUNNING
        allocation rows with ids in decision order, their bids ACTIVE, ``books`` (those they
        came from) past them, the tick's output (``node_ids``: the nodes' ids, when known)."""
        ix = self.index
        b = ix.b
        k = len(brows)
        alloc_ids = np.arange(ix.next_alloc_id, ix.next_alloc_id + k, dtype=np.int64)
        ix.next_alloc_id += k
        s = ix.a.reserve(k)
        a = ix.a
        a.id[s], a.bid[s], a.node[s], a.pool[s] = alloc_ids, brows, nrows, pool_of
        a.gpus[s], a.status[s], a.price[s], a.charged[s] = gpus, RUNNING, 0.0, now
        a.started[s], a.deadline[s], a.reason[s], a.tick[s] = now, math.nan, -1, ix.tick_number
        a.carry[s], a.mig[s] = 0, 0
        b.status[brows] = ACTIVE
        b.run[brows] = np.arange(s.start, s.stop)
        ix.alloc_blocks.append((int(alloc_ids[0]), int(alloc_ids[-1]) + 1, s.start))
        ix.csr = None
        for book in books:
            rest = book.rows[book.head :]
            alive = (b.status[rest] == WAITING) & (b.epoch[rest] == book.epochs[book.head :])
            book.head += int(np.argmax(alive)) if alive.any() else len(rest)
            book.count = int(np.count_nonzero(alive)) + book.live_delta_count(
                b.status, b.epoch, WAITING
            )
        windows = b.window[brows]
        if (windows >= 0).any():
            for arow in np.arange(s.start, s.stop)[windows >= 0].tolist():
                ix.track_window(arow, True)
        ix.out.add_chunk(
            alloc_ids,
            b.id[brows],
            np.asarray(ix.n_id, np.int64)[nrows] if node_ids is None else node_ids,
            gpus,
            np.full(k, KIND_CODES[PlacementKind.NEW], np.int8),
            np.full(k, math.nan),
        )


class FreeFits:
    """The free GPUs of a fresh model's pools, node by node, as the one-by-one best fit sees
    them, and the bids the replay placed on them (``BulkAdmission.replay_fresh``).

    Per pool (in region-name order): its reserve, heaps of node keys (``id << ROW_BITS | row``)
    by free GPUs, and a bit mask of the free counts some node has. A free fit is the node with
    the fewest free GPUs that suffice, then the lowest reserve, then the lowest node id (over
    every pool of the model for an any-region bid); a gang, once all its members are in the
    book, takes the ``node_count`` first such nodes of the first pool that has that many, its
    members in rank order (a gang that may go on smaller, failing that: as many as there are
    of the first pool with at least its ``min_node_count``, its first ranks).
    """

    __slots__ = (
        "books_left",
        "buckets",
        "done",
        "free_gpus",
        "masks",
        "parked",
        "pool_index",
        "position",
        "reserves",
        "won",
        "won_key",
        "won_pool",
    )

    def __init__(self, index: MarketIndex, pools: list[Pool], books: int) -> None:
        self.position = {pool.region: i for i, pool in enumerate(pools)}
        self.pool_index = [pool.index for pool in pools]
        self.reserves: list[float] = []
        self.buckets: list[list[list[int]]] = []
        self.masks: list[int] = []
        self.free_gpus = 0
        for pool in pools:
            by_free: list[list[int]] = [[] for _ in range(MAX_GPUS_PER_NODE + 1)]
            mask = 0
            for r in pool.live:
                f = index.n_free[r]
                if f > 0:
                    by_free[f].append((index.n_id[r] << ROW_BITS) | r)
                    mask |= 1 << f
                    self.free_gpus += f
            for heap in by_free:
                heapify(heap)
            self.reserves.append(math.inf if pool.min_reserve is None else pool.min_reserve)
            self.buckets.append(by_free)
            self.masks.append(mask)
        self.done = bytearray(len(index.books))  # books whose head found no fit
        self.books_left = books  # open books not done
        self.won: list[int] = []  # bid rows, in the order they were placed
        self.won_key: list[int] = []  # the node key each took
        self.won_pool: list[int] = []
        self.parked: list[int] = []  # members of gangs placed smaller: ACTIVE, no allocation

    def replay(self, rows: np.ndarray, b, gangs: dict[int, list[int]], nodes_of, least_of) -> bool:
        """Place ``rows`` (waiting bids of the open books, best first) one by one; True once
        nothing more can be placed (no GPU free, or every open book done)."""
        done, masks, buckets, reserves = self.done, self.masks, self.buckets, self.reserves
        position, everywhere = self.position, range(len(masks))
        won, won_key, won_pool, pool_index = self.won, self.won_key, self.won_pool, self.pool_index
        for row, book, size, price, region in zip(
            rows.tolist(),
            b.book[rows].tolist(),
            b.gpus[rows].tolist(),
            b.price[rows].tolist(),
            b.region[rows].tolist(),
            strict=True,
        ):
            if done[book]:
                continue
            where = everywhere if region < 0 else (position[region],) if region in position else ()
            count = nodes_of[book]
            if count > 1:  # a gang (its first member's row)
                members = gangs[row]
                least = least_of[book]
                placed = len(members) == count and (
                    self._take_gang(where, size, price, count, count)
                    or (least < count and self._take_gang(where, size, price, count, least))
                )
                if placed:
                    i, keys = placed
                    won.extend(members[: len(keys)])
                    self.parked.extend(members[len(keys) :])  # (a gang gone on smaller)
                    won_key.extend(keys)
                    won_pool.extend([pool_index[i]] * len(keys))
                    self.free_gpus -= size * len(keys)
            else:
                best = None
                for i in where:
                    m = masks[i] >> size
                    if m and reserves[i] <= price:
                        f = size + (m & -m).bit_length() - 1
                        fit = (f, reserves[i], buckets[i][f][0], i)
                        if best is None or fit < best:
                            best = fit
                placed = best is not None
                if placed:
                    f, _, key, i = best
                    heap = buckets[i][f]
                    heappop(heap)
                    if not heap:
                        masks[i] &= ~(1 << f)
                    if f > size:
                        heappush(buckets[i][f - size], key)
                        masks[i] |= 1 << (f - size)
                    won.append(row)
                    won_key.append(key)
                    won_pool.append(pool_index[i])
                    self.free_gpus -= size
            if not placed:
                done[book] = 1
                self.books_left -= 1
                if self.books_left == 0:
                    return True
            elif self.free_gpus == 0:
                return True  # every later bid finds no fit
        return False

    def _take_gang(self, where, size: int, price: float, count: int, least: int):
        """``(pool position, node keys)`` of a gang's ``count`` tightest distinct free fits (at
        least ``least``) in the first pool of ``where`` that has them, taken; or None, changing
        nothing."""
        for i in where:
            if self.reserves[i] > price or not self.masks[i] >> size:
                continue
            by_free = self.buckets[i]
            taken: list[tuple[int, int]] = []
            for f in range(size, MAX_GPUS_PER_NODE + 1):
                heap = by_free[f]
                while heap and len(taken) < count:
                    taken.append((f, heappop(heap)))
                if len(taken) == count:
                    break
            if len(taken) < least:
                for f, key in taken:  # too few here: put them back
                    heappush(by_free[f], key)
                continue
            mask = self.masks[i]
            for f, key in taken:
                if not by_free[f]:
                    mask &= ~(1 << f)
                if f > size:
                    heappush(by_free[f - size], key)
                    mask |= 1 << (f - size)
            self.masks[i] = mask
            return i, [key for _, key in taken]
        return None
