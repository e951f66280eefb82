"""In-memory indexes the engine keeps between ticks: the sorted order book and free capacity.

Both are plain data structures (no I/O, no clock). They exist so that a tick over a million open
bids does not re-sort the book or rescan every node: a steady tick touches only what changed.

*Books.* Waiting bids are split into books by (model, region or any, GPU count, window), each
sorted by priority ``(-max_price, created_at, bid id)``. A book is a sorted numpy array (``main``)
plus a small sorted list (``delta``) of bids added since the last compaction; stale entries
(a bid that won, was cancelled or repriced) are skipped lazily by comparing an epoch.

*Capacity.* A pool's live nodes sit in heaps bucketed by free GPUs and reserve tier; the key
``node_id << 20 | row`` makes the lowest node id win ties. Entries are never removed eagerly: an
entry whose bucket no longer matches the node's free count is dropped when it reaches the top.
"""

from __future__ import annotations

import bisect
from heapq import heapify, heappop, heappush

import numpy as np

from prefect_spotgpu.market.checks import MAX_GPUS_PER_NODE

ROW_BITS = 20
ROW_MASK = (1 << ROW_BITS) - 1
MAX_NODES = 1 << ROW_BITS


class Book:
    """Waiting bids of one (model, region-or-any, size, window, nodes, fewest nodes, image or
    not), best first."""

    __slots__ = (
        "count",
        "delta",
        "epochs",
        "head",
        "image",
        "index",
        "least",
        "model",
        "nodes",
        "region",
        "rows",
        "size",
        "window",
    )

    def __init__(
        self,
        index: int,
        model: int,
        region: int,
        size: int,
        window: int,
        nodes: int = 1,
        image: bool = False,
        least: int | None = None,
    ) -> None:
        self.index = index
        self.image = image  # its bids name an image (types.Runner: only nodes that run images)
        self.model = model
        self.region = region  # -1: any region of the model
        self.size = size  # GPUs per node
        self.nodes = nodes  # > 1: a book of gangs (one entry per gang: its first member)
        self.least = nodes if least is None else least  # the fewest nodes its gangs run on
        self.window = window  # -1: no window
        self.rows = np.zeros(0, np.int64)
        self.epochs = np.zeros(0, np.int64)
        self.head = 0
        self.delta: list[tuple[float, float, int, int, int]] = []
        self.count = 0  # live entries

    def insert(self, key: tuple[float, float, int], row: int, epoch: int) -> None:
        bisect.insort(self.delta, (key[0], key[1], key[2], row, epoch))
        self.count += 1

    def peek(
        self,
        status: np.ndarray,
        epoch: np.ndarray,
        price: np.ndarray,
        created: np.ndarray,
        ids: np.ndarray,
        waiting: int,
    ):
        """The best live entry as ``(key, row)``, or ``None``; drops stale entries on the way."""
        rows, epochs, head = self.rows, self.epochs, self.head
        n = len(rows)
        main = None
        while head < n:
            r = int(rows[head])
            if status[r] == waiting and epoch[r] == epochs[head]:
                main = ((-float(price[r]), float(created[r]), int(ids[r])), r)
                break
            head += 1
        self.head = head
        delta = self.delta
        while delta:
            k0, k1, k2, r, e = delta[0]
            if status[r] == waiting and epoch[r] == e:
                d = ((k0, k1, k2), r)
                if main is None or d[0] < main[0]:
                    return d
                return main
            delta.pop(0)
        return main

    def pop(self, row: int) -> None:
        """Remove the entry for ``row`` just returned by :meth:`peek`."""
        if self.delta and self.delta[0][3] == row:
            self.delta.pop(0)
        else:
            self.head += 1

    def live_rows(self, status: np.ndarray, epoch: np.ndarray, waiting: int) -> np.ndarray:
        """All live entries (main after head, then delta), in no particular order."""
        rows = self.rows[self.head :]
        live = rows[(status[rows] == waiting) & (epoch[rows] == self.epochs[self.head :])]
        if self.delta:
            extra, epochs = self._delta_columns()
            extra = extra[(status[extra] == waiting) & (epoch[extra] == epochs)]
            live = np.concatenate([live, extra])
        return live

    def live_delta_count(self, status: np.ndarray, epoch: np.ndarray, waiting: int) -> int:
        """How many entries of the delta are live."""
        if not self.delta:
            return 0
        rows, epochs = self._delta_columns()
        return int(np.count_nonzero((status[rows] == waiting) & (epoch[rows] == epochs)))

    def _delta_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The delta's rows and epochs, as arrays."""
        _, _, _, rows, epochs = zip(*self.delta, strict=True)
        return np.asarray(rows, np.int64), np.asarray(epochs, np.int64)

    def needs_compaction(self) -> bool:
        return len(self.delta) > 256 or (self.head > 4096 and self.head * 2 > len(self.rows))

    def reset(self, rows: np.ndarray, epochs: np.ndarray) -> None:
        """Replace the book by ``rows`` (already in priority order)."""
        self.rows, self.epochs, self.head, self.delta = rows, epochs, 0, []
        self.count = len(rows)


def priority_order(price: np.ndarray, created: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Indices that sort bids best first: higher price, then older, then lower id."""
    return np.lexsort((ids, created, -price))


class PoolCapacity:
    """Live nodes of one pool bucketed by free GPUs, per reserve tier."""

    __slots__ = ("entries", "reserves", "tiers")

    def __init__(self) -> None:
        self.tiers: dict[float, list[list[int]]] = {}
        self.reserves: list[float] = []
        self.entries = 0

    def _tier(self, reserve: float) -> list[list[int]]:
        tier = self.tiers.get(reserve)
        if tier is None:
            tier = self.tiers[reserve] = [[] for _ in range(MAX_GPUS_PER_NODE + 1)]
            bisect.insort(self.reserves, reserve)
        return tier

    def push(self, key: int, reserve: float, free: int) -> None:
        if free > 0:
            heappush(self._tier(reserve)[free], key)
            self.entries += 1

    def rebuild(self, keys: list[int], reserves: list[float], frees: list[int]) -> None:
        self.tiers, self.reserves, self.entries = {}, [], 0
        for key, reserve, free in zip(keys, reserves, frees, strict=True):
            if free > 0:
                self._tier(reserve)[free].append(key)
                self.entries += 1
        for tier in self.tiers.values():
            for bucket in tier:
                heapify(bucket)

    def _top(self, bucket: list[int], ok, exclude: set[int] | None) -> int | None:
        """The lowest live key of a bucket whose row is not in ``exclude`` (rows taken by
        the members of a gang being placed); stale entries are dropped on the way,
        excluded ones put back."""
        held = []
        found = None
        while bucket:
            key = bucket[0]
            row = key & ROW_MASK
            if ok(row):
                if exclude is None or row not in exclude:
                    found = key
                    break
                held.append(heappop(bucket))
                continue
            heappop(bucket)
            self.entries -= 1
        for key in held:
            heappush(bucket, key)
        return found

    def best_fit(
        self,
        size: int,
        max_price: float,
        free_now: list[int],
        reserve: list[float],
        exclude: set[int] | None = None,
    ) -> tuple[int, float, int] | None:
        """``(free, reserve, key)`` of the tightest live node with ``size`` free GPUs and
        reserve <= ``max_price``, not one of the rows in ``exclude``; the row is
        ``key & ROW_MASK``."""
        for f in range(size, MAX_GPUS_PER_NODE + 1):
            for r in self.reserves:
                if r > max_price:
                    break
                bucket = self.tiers[r][f]
                while bucket:
                    row = bucket[0] & ROW_MASK
                    if free_now[row] == f and reserve[row] == r:
                        if exclude is None or row not in exclude:
                            return (f, r, bucket[0])
                        key = self._top(  # the slow path: only while placing a gang
                            bucket,
                            lambda row, f=f, r=r: free_now[row] == f and reserve[row] == r,
                            exclude,
                        )
                        if key is not None:
                            return (f, r, key)
                        break
                    heappop(bucket)
                    self.entries -= 1
        return None

    def best_fits(
        self,
        size: int,
        max_price: float,
        free_now: list[int],
        reserve: list[float],
        count: int,
        exclude: set[int],
    ) -> list[int]:
        """Up to ``count`` keys of distinct live nodes, none in ``exclude``, in the order
        successive :meth:`best_fit` calls would return them (each excluding those before);
        stale entries are dropped on the way."""
        found: list[int] = []
        rows: set[int] = set()
        for f in range(size, MAX_GPUS_PER_NODE + 1):
            for r in self.reserves:
                if r > max_price:
                    break
                bucket = self.tiers[r][f]
                held = []
                while bucket and len(found) < count:
                    key = heappop(bucket)
                    row = key & ROW_MASK
                    if free_now[row] != f or reserve[row] != r:
                        self.entries -= 1  # stale
                        continue
                    held.append(key)
                    if row not in exclude and row not in rows:
                        found.append(key)
                        rows.add(row)
                for key in held:
                    heappush(bucket, key)
                if len(found) == count:
                    return found
        return found

    def lowest_at(
        self,
        free: int,
        reserve: float,
        free_now: list[int],
        reserves: list[float],
        holds,
        exclude: set[int] | None = None,
    ) -> int | None:
        """The lowest key of a live node with exactly ``free`` GPUs free at ``reserve`` for
        which ``holds(row)`` is true (a node that kept an image), not in ``exclude``, or
        None; stale entries are dropped on the way."""
        tier = self.tiers.get(reserve)
        if tier is None:
            return None
        return self._top(
            tier[free],
            lambda row: free_now[row] == free and reserves[row] == reserve and holds(row),
            exclude,
        )

    def first_fit(
        self,
        size: int,
        max_price: float,
        free_now: list[int],
        reserve: list[float],
        exclude: set[int] | None = None,
    ) -> tuple[int] | None:
        """``(key,)`` of the lowest-id live node with ``size`` free GPUs and reserve <=
        ``max_price``, not in ``exclude``."""
        best = None
        for r in self.reserves:
            if r > max_price:
                break
            tier = self.tiers[r]
            for f in range(size, MAX_GPUS_PER_NODE + 1):
                key = self._top(
                    tier[f],
                    lambda row, f=f, r=r: free_now[row] == f and reserve[row] == r,
                    exclude,
                )
                if key is not None and (best is None or key < best):
                    best = key
        return None if best is None else (best,)
