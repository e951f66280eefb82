"""The clearing engine: one uniform-price auction per pool, every tick (DESIGN §3).

Invariants (each property-tested in ``tests/test_market_properties.py``):

- no node ever has more GPUs in use (running + noticed) or promised (running + reserved) than
  it has; so no GPU is held by two allocations;
- a running allocation pays ``min(max(pool clearing price, its node's reserve), its max price)``
  per GPU-second: never above its own maximum, never below its node's reserve;
- the same inputs give the same decision: ``Market`` carries its book between ticks, and its
  decision equals that of a market rebuilt cold from ``snapshot()``;
- a waiting bid that outbids a running one in its pool by more than the hysteresis margin, and
  would fit on that one's node once it left, is never left waiting while the other runs.

The rule, per tick and per GPU model (pools of a model share its "any region" bids):

1. notices for allocations on reclaimed nodes, over a raised reserve or whose window closes;
   endings for lost nodes, passed notice deadlines and expired reservations; reservations whose
   GPUs are free start (RESERVED -> RUNNING);
2. waiting bids, best first (price, then age), each take the tightest free fit on a node whose
   reserve they meet; with no free fit, the weakest running incumbents they beat by more than the
   hysteresis margin on one node get a notice and the challenger reserves their GPUs; a bid that
   can do neither ends its book's turn (every bid behind it in that book is lower and fails too);
   a noticed bid gets a migration reservation on free GPUs of its pool at once, when there are any;
3. the clearing price of a pool is the highest losing eligible bid, at least the lowest reserve;
4. every running or noticed allocation is charged for the seconds since its last charge at the
   price that was in force, and takes the new price.

``Market`` is the only mutable object in ``market/``: an in-memory index changed only through
its methods; it reads no clock and does no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from prefect_spotgpu.market.book import (
    MAX_NODES,
    ROW_BITS,
    ROW_MASK,
    Book,
    PoolCapacity,
    priority_order,
)
from prefect_spotgpu.market.decision import (
    Charges,
    Decision,
    Ending,
    Notice,
    PlacementKind,
    Placements,
    PoolQuote,
)
from prefect_spotgpu.market.gpus import DEFAULT_CATALOG
from prefect_spotgpu.market.policies import get_packing_policy
from prefect_spotgpu.market.types import (
    ANY_REGION,
    MAX_GPUS_PER_NODE,
    Allocation,
    AllocationStatus,
    Bid,
    Interval,
    MarketConfig,
    MarketState,
    Node,
    NodeState,
    NoticeReason,
    check_price,
    check_region,
    check_time,
)

# Bid row status.
GONE, WAITING, ACTIVE = 0, 1, 2
# Allocation row status codes, in AllocationStatus order.
_STATUSES = tuple(AllocationStatus)
RESERVED, RUNNING, NOTICED, PREEMPTED, FINISHED, RELEASED = range(6)
_REASONS = tuple(NoticeReason)
_KIND = {k: i for i, k in enumerate(PlacementKind)}
_SECONDS_PER_HOUR = 3600.0


class _Columns:
    """Growable numpy columns (rows are appended, never moved)."""

    def __init__(self, **dtypes: object) -> None:
        self.n = 0
        self._dtypes = dtypes
        for name, dtype in dtypes.items():
            setattr(self, name, np.zeros(16, dtype))

    def reserve(self, extra: int) -> slice:
        need = self.n + extra
        cap = len(getattr(self, next(iter(self._dtypes))))
        if need > cap:
            new_cap = max(need, cap * 2)
            for name, dtype in self._dtypes.items():
                old = getattr(self, name)
                new = np.zeros(new_cap, dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        s = slice(self.n, need)
        self.n = need
        return s


@dataclass(slots=True)
class _Pool:
    index: int
    model: int
    region: int
    nodes: list[int] = field(default_factory=list)  # node rows, kept sorted by node id
    capacity: PoolCapacity = field(default_factory=PoolCapacity)
    incumbents: np.ndarray | None = None  # alloc rows RUNNING at tick start, weakest first
    incumbent_eff: np.ndarray | None = None
    scan_from: int = 0  # incumbents before this index are no longer running
    noticed_nodes: set[int] = field(default_factory=set)  # nodes with noticed GPUs
    evict_failed_size: int = MAX_GPUS_PER_NODE + 1
    busy: int = 0  # GPUs running, noticed or reserved on its nodes
    free: int = 0  # sum of free GPUs of its live nodes
    live: list[int] | None = None  # live node rows (None: recompute)
    max_cap: int = 0
    total: int = 0
    min_reserve: float | None = None


@dataclass(slots=True)
class _TickOut:
    """What a tick (or an external change) decided so far, as plain lists."""

    p_alloc: list[int] = field(default_factory=list)
    p_bid: list[int] = field(default_factory=list)
    p_node: list[int] = field(default_factory=list)
    p_gpus: list[int] = field(default_factory=list)
    p_kind: list[int] = field(default_factory=list)
    p_expires: list[float] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    endings: list[Ending] = field(default_factory=list)
    promotions: list[int] = field(default_factory=list)
    final_charges: list[tuple[int, int, int, int, float, float]] = field(default_factory=list)
    chunks: list[tuple[np.ndarray, ...]] = field(default_factory=list)

    def add_chunk(self, *columns: np.ndarray) -> None:
        """Append placements decided in bulk, after those decided one by one so far."""
        self.flush()
        self.chunks.append(columns)

    def flush(self) -> None:
        if self.p_alloc:
            self.chunks.append((
                np.asarray(self.p_alloc, np.int64), np.asarray(self.p_bid, np.int64),
                np.asarray(self.p_node, np.int64), np.asarray(self.p_gpus, np.int64),
                np.asarray(self.p_kind, np.int8), np.asarray(self.p_expires, np.float64),
            ))
            for column in (self.p_alloc, self.p_bid, self.p_node, self.p_gpus, self.p_kind,
                           self.p_expires):
                column.clear()

    def placements(self) -> Placements:
        self.flush()
        if not self.chunks:
            return Placements(*(np.zeros(0, t) for t in (np.int64, np.int64, np.int64, np.int64,
                                                         np.int8, np.float64)))
        return Placements(*(np.concatenate(c) for c in zip(*self.chunks)))


@dataclass(frozen=True, slots=True)
class Settlement:
    """What an external change (cancel, ack, job end) ended and charged."""

    endings: tuple[Ending, ...]
    charges: Charges


class Market:
    """The market's order book and allocations, cleared by :meth:`tick`.

    >>> m = Market()
    >>> m.upsert_node(Node(1, "A100-80G", "eu-west", 8, reserve_price=0.9))
    >>> m.add_bid(Bid(1, "a100 80g", 4, 1.2, region="eu-west"))
    >>> d = m.tick(now=100.0)
    >>> [(p.bid_id, p.node_id, p.status.value) for p in d.placements]
    [(1, 1, 'running')]
    >>> d.quote("A100-80G", "eu-west").clearing_price
    0.9
    """

    def __init__(self, config: MarketConfig | None = None, *, next_allocation_id: int = 1) -> None:
        self.config = config or MarketConfig()
        self._policy = get_packing_policy(self.config.packing)
        self._next_alloc_id = next_allocation_id
        self._now = -math.inf
        self._tick = 0
        self._out = _TickOut()
        # interning
        self._models: list[str] = []
        self._model_index: dict[str, int] = {}
        self._regions: list[str] = []
        self._region_index: dict[str, int] = {}
        self._windows: list[Interval] = []
        self._window_index: dict[Interval, int] = {}
        self._pools: list[_Pool] = []
        self._pool_index: dict[tuple[int, int], int] = {}
        self._model_pools: dict[int, list[int]] = {}  # sorted by region name
        self._books: list[Book] = []
        self._book_index: dict[tuple[int, int, int, int], int] = {}
        self._model_books: dict[int, list[int]] = {}
        # nodes (python lists: scalar access in the hot loop)
        self._node_row: dict[int, int] = {}
        self.n_id: list[int] = []
        self.n_pool: list[int] = []
        self.n_cap: list[int] = []
        self.n_reserve: list[float] = []
        self.n_state: list[NodeState] = []
        self.n_running: list[int] = []
        self.n_noticed: list[int] = []
        self.n_reserved: list[int] = []
        self.n_free: list[int] = []
        self._csr: tuple[np.ndarray, np.ndarray] | None = None  # node -> alloc rows index
        self._node_extra: dict[int, list[int]] = {}  # alloc rows added since the index
        self._extra_count = 0
        self._n_reserve_np: np.ndarray | None = None
        self._suspect_nodes: set[int] = set()
        # bids
        self.b = _Columns(id=np.int64, model=np.int32, region=np.int32, gpus=np.int32,
                          price=np.float64, created=np.float64, window=np.int32,
                          deadline=np.float64, tenant=np.int64, status=np.int8,
                          epoch=np.int64, book=np.int32, run=np.int64, res=np.int64)
        self._bid_row: dict[int, int] = {}
        # allocations
        self.a = _Columns(id=np.int64, bid=np.int64, node=np.int64, pool=np.int32,
                          gpus=np.int32, status=np.int8, price=np.float64,
                          charged=np.float64, started=np.float64, deadline=np.float64,
                          reason=np.int8, tick=np.int64)
        self._alloc_row: dict[int, int] = {}
        self._alloc_blocks: list[tuple[int, int, int]] = []  # (first id, end id, first row)
        self._deadlines: list[tuple[float, int, int]] = []
        self._reserved: set[int] = set()
        self._window_allocs: dict[int, set[int]] = {}
        self._noticed_outbid: set[int] = set()

    # ------------------------------------------------------------------ building

    @classmethod
    def from_state(cls, state: MarketState) -> Market:
        """A market holding exactly ``state`` (as if it had been built by ticks)."""
        market = cls(state.config, next_allocation_id=state.next_allocation_id)
        for node in sorted(state.nodes, key=lambda n: n.id):
            market.upsert_node(node)
        for bid in sorted(state.bids, key=lambda b: b.id):
            market.add_bid(bid)
        for alloc in sorted(state.allocations, key=lambda a: a.id):
            market._load_allocation(alloc)
        market._compact_books(force=True)
        return market

    def _intern_model(self, name: str) -> int:
        i = self._model_index.get(name)
        if i is None:
            i = self._model_index[name] = len(self._models)
            self._models.append(name)
            self._model_pools[i] = []
            self._model_books[i] = []
        return i

    def _intern_region(self, name: str) -> int:
        i = self._region_index.get(name)
        if i is None:
            i = self._region_index[name] = len(self._regions)
            self._regions.append(name)
        return i

    def _pool_for(self, model: int, region: int) -> _Pool:
        i = self._pool_index.get((model, region))
        if i is None:
            i = self._pool_index[(model, region)] = len(self._pools)
            self._pools.append(_Pool(i, model, region))
            pools = self._model_pools[model]
            pools.append(i)
            pools.sort(key=lambda p: self._regions[self._pools[p].region])
        return self._pools[i]

    def _known_region(self, region: str) -> bool:
        if self.config.regions is not None:
            return region in self.config.regions
        return region in self._region_index

    # ------------------------------------------------------------------ nodes

    def upsert_node(self, node: Node) -> None:
        """Register a node, or change its state or reserve price (model, region, size are fixed)."""
        row = self._node_row.get(node.id)
        if row is None:
            if len(self.n_id) >= MAX_NODES:
                raise ValueError(f"a market holds at most {MAX_NODES} nodes")
            model = self._intern_model(node.gpu_model)
            region = self._intern_region(node.region)
            pool = self._pool_for(model, region)
            row = self._node_row[node.id] = len(self.n_id)
            self.n_id.append(node.id)
            self.n_pool.append(pool.index)
            self.n_cap.append(node.gpu_count)
            self.n_reserve.append(node.reserve_price)
            self.n_state.append(node.state)
            self.n_running.append(0)
            self.n_noticed.append(0)
            self.n_reserved.append(0)
            self.n_free.append(-1)
            self._n_reserve_np = None
            pool.nodes.append(row)
            pool.live = None
            if len(pool.nodes) > 1 and self.n_id[pool.nodes[-2]] > node.id:
                pool.nodes.sort(key=self.n_id.__getitem__)
            self._refresh_free(row)
            return
        pool = self._pools[self.n_pool[row]]
        if (
            self._models[pool.model] != node.gpu_model
            or self._regions[pool.region] != node.region
            or self.n_cap[row] != node.gpu_count
        ):
            raise ValueError(
                f"node {node.id}: gpu_model, region and gpu_count cannot change "
                "(register the host as a new node)"
            )
        if self.n_state[row] is NodeState.LOST and node.state is not NodeState.LOST:
            pass  # a lost node that comes back starts empty: its allocations already ended
        self.n_state[row] = node.state
        self.n_reserve[row] = node.reserve_price
        self._n_reserve_np = None
        pool.live = None
        self._suspect_nodes.add(row)
        self._refresh_free(row, force=True)

    def _refresh_free(self, row: int, force: bool = False) -> None:
        if self.n_state[row].offers_capacity():
            free = self.n_cap[row] - self.n_running[row] - max(self.n_noticed[row],
                                                               self.n_reserved[row])
        else:
            free = -1
        old = self.n_free[row]
        if free != old or force:
            self.n_free[row] = free
            self._pools[self.n_pool[row]].free += max(free, 0) - max(old, 0)
            if free > 0:
                self._pools[self.n_pool[row]].capacity.push(
                    (self.n_id[row] << ROW_BITS) | row, self.n_reserve[row], free
                )

    # ------------------------------------------------------------------ bids

    def _book_for(self, model: int, region: int, size: int, window: int) -> Book:
        key = (model, region, size, window)
        i = self._book_index.get(key)
        if i is None:
            i = self._book_index[key] = len(self._books)
            self._books.append(Book(i, model, region, size, window))
            self._model_books[model].append(i)
        return self._books[i]

    def add_bid(self, bid: Bid) -> None:
        """Add an open bid to the book (it waits until a tick places it)."""
        if bid.id in self._bid_row:
            raise ValueError(f"bid.id {bid.id} is already in the book")
        if bid.region != ANY_REGION and not self._known_region(bid.region):
            raise ValueError(
                f"region {bid.region!r} is not a known region; known regions: "
                f"{', '.join(sorted(self.config.regions or self._regions)) or 'none'}"
            )
        model = self._intern_model(bid.gpu_model)
        region = -1 if bid.region == ANY_REGION else self._intern_region(bid.region)
        window = -1
        if bid.window is not None:
            window = self._window_index.get(bid.window, -1)
            if window < 0:
                window = self._window_index[bid.window] = len(self._windows)
                self._windows.append(bid.window)
        book = self._book_for(model, region, bid.gpu_count, window)
        s = self.b.reserve(1)
        row = s.start
        b = self.b
        b.id[row], b.model[row], b.region[row], b.gpus[row] = bid.id, model, region, bid.gpu_count
        b.price[row], b.created[row], b.window[row] = bid.max_price, bid.created_at, window
        b.deadline[row] = math.nan if bid.deadline is None else bid.deadline
        b.tenant[row], b.status[row], b.epoch[row], b.book[row] = bid.tenant_id, WAITING, 0, book.index
        b.run[row] = b.res[row] = -1
        self._bid_row[bid.id] = row
        book.insert((-bid.max_price, bid.created_at, bid.id), row, 0)

    def add_bid_arrays(self, *, gpu_model: str, region: str, ids: np.ndarray,
                       gpu_counts: np.ndarray, max_prices: np.ndarray, created_at: np.ndarray,
                       tenant_ids: np.ndarray | None = None) -> None:
        """Bulk-load bids of one model and region (no window), validated as a whole.

        The fast path for loading a large book; each array holds one value per bid.
        """
        gpu_model = DEFAULT_CATALOG.normalize(gpu_model)
        region = check_region("region", region, allow_any=True)
        if region != ANY_REGION and not self._known_region(region):
            raise ValueError(f"region {region!r} is not a known region")
        ids = np.asarray(ids, np.int64)
        n = len(ids)
        gpus = np.asarray(gpu_counts, np.int64)
        prices = np.asarray(max_prices, np.float64)
        created = np.asarray(created_at, np.float64)
        tenants = np.zeros(n, np.int64) if tenant_ids is None else np.asarray(tenant_ids, np.int64)
        for name, arr in (("gpu_counts", gpus), ("max_prices", prices), ("created_at", created),
                          ("tenant_ids", tenants)):
            if len(arr) != n:
                raise ValueError(f"{name} has {len(arr)} values, ids has {n}")
        if n and (ids.min() < 0):
            raise ValueError("bid ids must be non-negative")
        bad = ~(np.isfinite(prices) & (prices > 0))
        if bad.any():
            raise ValueError(f"max_price must be a positive finite price, got {prices[bad][0]!r}")
        bad = (gpus < 1) | (gpus > MAX_GPUS_PER_NODE)
        if bad.any():
            raise ValueError(
                f"gpu_count must be between 1 and {MAX_GPUS_PER_NODE}, got {gpus[bad][0]!r}"
            )
        if not np.isfinite(created).all():
            raise ValueError("created_at must be finite")
        if len(np.unique(ids)) != n or any(i in self._bid_row for i in ids[:1].tolist()) or (
            self._bid_row and not self._bid_row.keys().isdisjoint(ids.tolist())
        ):
            raise ValueError("bid ids must be unique and not already in the book")
        model = self._intern_model(gpu_model)
        reg = -1 if region == ANY_REGION else self._intern_region(region)
        s = self.b.reserve(n)
        b = self.b
        b.id[s], b.model[s], b.region[s], b.gpus[s] = ids, model, reg, gpus
        b.price[s], b.created[s], b.window[s], b.deadline[s] = prices, created, -1, math.nan
        b.tenant[s], b.status[s], b.epoch[s] = tenants, WAITING, 0
        b.run[s] = b.res[s] = -1
        rows = np.arange(s.start, s.stop, dtype=np.int64)
        self._bid_row.update(zip(ids.tolist(), range(s.start, s.stop)))
        for size in np.unique(gpus).tolist():
            book = self._book_for(model, reg, int(size), -1)
            sel = rows[gpus == size]
            b.book[sel] = book.index
            merged = np.concatenate([book.live_rows(b.status, b.epoch, WAITING), sel])
            order = priority_order(b.price[merged], b.created[merged], b.id[merged])
            book.reset(merged[order], b.epoch[merged[order]])

    def _bid_row_of(self, bid_id: int) -> int:
        row = self._bid_row.get(bid_id)
        if row is None or self.b.status[row] == GONE:
            raise KeyError(f"bid {bid_id} is not open in the market")
        return row

    def reprice_bid(self, bid_id: int, max_price: float) -> None:
        """Change a bid's maximum price; it keeps its age (and its GPUs, if it runs)."""
        price = check_price("max_price", max_price)
        row = self._bid_row_of(bid_id)
        b = self.b
        b.price[row] = price
        if b.status[row] == WAITING:
            b.epoch[row] += 1
            book = self._books[b.book[row]]
            book.count -= 1
            book.insert((-price, float(b.created[row]), int(b.id[row])), row, int(b.epoch[row]))
        else:
            for arow in (b.run[row], b.res[row]):  # below a reserve now?
                if arow >= 0:
                    self._suspect_nodes.add(int(self.a.node[arow]))

    def cancel_bid(self, bid_id: int, at: float) -> Settlement:
        """Close a bid: it leaves the book; its allocations end FINISHED (reservations RELEASED)."""
        at = check_time("at", at)
        row = self._bid_row_of(bid_id)
        out, self._out = self._out, _TickOut()
        try:
            for arow in self._bid_alloc_rows(row):
                status = RELEASED if self.a.status[arow] == RESERVED else FINISHED
                self._end(arow, status, "bid cancelled", max(at, float(self.a.charged[arow])))
            self._close_bid(row)
            return self._settlement()
        finally:
            self._out = out

    def end_allocation(self, allocation_id: int, status: AllocationStatus | str,
                       at: float) -> Settlement:
        """End an allocation from outside the tick.

        ``PREEMPTED``: a noticed job acked its final save (its bid waits again, or starts on its
        migration reservation). ``FINISHED``: the job completed; its bid closes.
        ``RELEASED``: a reservation given up.
        """
        at = check_time("at", at)
        status = AllocationStatus(status)
        if not status.is_terminal():
            raise ValueError(f"status must be a terminal status, got {status.value!r}")
        arow = self._alloc_row_of(allocation_id)
        if arow is None or _STATUSES[self.a.status[arow]].is_terminal():
            raise KeyError(f"allocation {allocation_id} is not active")
        current = self.a.status[arow]
        if (status is AllocationStatus.RELEASED) != (current == RESERVED):
            raise ValueError(
                f"allocation {allocation_id} is {_STATUSES[current].value}: "
                f"it cannot end as {status.value}"
            )
        out, self._out = self._out, _TickOut()
        try:
            self._end(arow, _STATUSES.index(status), f"ended: {status.value}",
                      max(at, float(self.a.charged[arow])))
            if status is AllocationStatus.FINISHED:
                bid_row = int(self.a.bid[arow])
                for other in self._bid_alloc_rows(bid_row):
                    self._end(other, RELEASED if self.a.status[other] == RESERVED else FINISHED,
                              "bid finished", max(at, float(self.a.charged[other])))
                self._close_bid(bid_row)
            return self._settlement()
        finally:
            self._out = out

    def _settlement(self) -> Settlement:
        return Settlement(tuple(self._out.endings), self._final_charges())

    def _close_bid(self, row: int) -> None:
        b = self.b
        if b.status[row] == WAITING:
            self._books[b.book[row]].count -= 1
        b.status[row] = GONE
        del self._bid_row[int(b.id[row])]

    def _to_waiting(self, row: int) -> None:
        b = self.b
        b.status[row] = WAITING
        b.epoch[row] += 1
        self._books[b.book[row]].insert(
            (-float(b.price[row]), float(b.created[row]), int(b.id[row])), row, int(b.epoch[row])
        )

    # ------------------------------------------------------------------ allocations

    def _load_allocation(self, alloc: Allocation) -> None:
        brow = self._bid_row_of(alloc.bid_id)
        nrow = self._node_row[alloc.node_id]
        status = _STATUSES.index(alloc.status)
        self._new_alloc(alloc.id, brow, nrow, alloc.gpu_count, status, alloc.started_at,
                        alloc.deadline, alloc.notice_reason)
        arow = self._alloc_row_of(alloc.id)
        self.a.price[arow] = alloc.price
        self.a.charged[arow] = alloc.charged_until
        self.a.tick[arow] = -1
        self._suspect_nodes.add(nrow)

    def _new_alloc(self, alloc_id: int, brow: int, nrow: int, gpus: int, status: int,
                   now: float, deadline: float | None, reason: NoticeReason | None) -> int:
        s = self.a.reserve(1)
        arow = s.start
        a = self.a
        a.id[arow], a.bid[arow], a.node[arow] = alloc_id, brow, nrow
        a.pool[arow], a.gpus[arow], a.status[arow] = self.n_pool[nrow], gpus, status
        a.price[arow], a.charged[arow], a.started[arow] = 0.0, now, now
        a.deadline[arow] = math.nan if deadline is None else deadline
        a.reason[arow] = -1 if reason is None else _REASONS.index(reason)
        a.tick[arow] = self._tick
        self._alloc_row[alloc_id] = arow
        self._pools[self.n_pool[nrow]].busy += gpus
        if self._csr is not None:
            self._node_extra.setdefault(nrow, []).append(arow)
            self._extra_count += 1
        b = self.b
        if status == RESERVED:
            b.res[brow] = arow
        else:
            b.run[brow] = arow
        if b.status[brow] == WAITING:
            self._books[b.book[brow]].count -= 1
        b.status[brow] = ACTIVE
        if status == RUNNING:
            self.n_running[nrow] += gpus
            self._track_window(arow, True)
        elif status == NOTICED:
            self.n_noticed[nrow] += gpus
            self._pools[self.n_pool[nrow]].noticed_nodes.add(nrow)
            heappush(self._deadlines, (deadline, alloc_id, arow))
            if reason is NoticeReason.OUTBID:
                self._noticed_outbid.add(arow)
        else:
            self.n_reserved[nrow] += gpus
            self._reserved.add(arow)
            heappush(self._deadlines, (deadline, alloc_id, arow))
        self._refresh_free(nrow)
        return arow

    def _alloc_row_of(self, alloc_id: int) -> int | None:
        row = self._alloc_row.get(alloc_id)
        if row is None:
            for first, end, first_row in self._alloc_blocks:
                if first <= alloc_id < end:
                    return first_row + alloc_id - first
        return row

    def _bid_alloc_rows(self, brow: int) -> list[int]:
        """Active allocation rows of a bid, by allocation id."""
        rows = [int(r) for r in (self.b.run[brow], self.b.res[brow]) if r >= 0]
        return sorted(rows, key=lambda r: int(self.a.id[r]))

    def _node_allocs(self, nrow: int) -> list[int]:
        """Active allocation rows on a node, by allocation id."""
        a = self.a
        if self._csr is None or self._extra_count > 65536:
            n = a.n
            active = np.flatnonzero(a.status[:n] < PREEMPTED)
            rows = active[np.argsort(a.node[active], kind="stable")]
            starts = np.searchsorted(a.node[rows], np.arange(len(self.n_id) + 1))
            self._csr, self._node_extra, self._extra_count = (rows, starts), {}, 0
        rows, starts = self._csr
        found = rows[starts[nrow]:starts[nrow + 1]].tolist() if nrow + 1 < len(starts) else []
        found.extend(self._node_extra.get(nrow, ()))
        return sorted((r for r in found if a.status[r] < PREEMPTED), key=lambda r: int(a.id[r]))

    def _track_window(self, arow: int, running: bool) -> None:
        window = int(self.b.window[self.a.bid[arow]])
        if window >= 0:
            allocs = self._window_allocs.setdefault(window, set())
            if running:
                allocs.add(arow)
            else:
                allocs.discard(arow)

    def _place(self, brow: int, nrow: int, kind: PlacementKind, now: float,
               expires: float | None = None) -> int:
        alloc_id = self._next_alloc_id
        self._next_alloc_id += 1
        gpus = int(self.b.gpus[brow])
        status = RUNNING if kind is PlacementKind.NEW else RESERVED
        arow = self._new_alloc(alloc_id, brow, nrow, gpus, status, now, expires, None)
        out = self._out
        out.p_alloc.append(alloc_id)
        out.p_bid.append(int(self.b.id[brow]))
        out.p_node.append(self.n_id[nrow])
        out.p_gpus.append(gpus)
        out.p_kind.append(_KIND[kind])
        out.p_expires.append(math.nan if expires is None else expires)
        return arow

    def _notice(self, arow: int, reason: NoticeReason, deadline: float, now: float) -> None:
        a = self.a
        nrow, gpus = int(a.node[arow]), int(a.gpus[arow])
        a.status[arow] = NOTICED
        a.deadline[arow] = deadline
        a.reason[arow] = _REASONS.index(reason)
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
        if reason in (NoticeReason.RECLAIMED, NoticeReason.OUTBID, NoticeReason.BELOW_RESERVE):
            self._migrate(brow, deadline, now)

    def _migrate(self, brow: int, deadline: float, now: float) -> None:
        """Reserve free GPUs of the bid's pool at once for a noticed bid (DESIGN §3)."""
        if self.b.res[brow] >= 0:
            return
        nrow = self._free_fit(brow)
        if nrow is not None:
            self._place(brow, nrow, PlacementKind.MIGRATION, now,
                        deadline + self.config.reservation_grace_seconds)

    def _end(self, arow: int, status: int, reason: str, at: float) -> None:
        a = self.a
        old = int(a.status[arow])
        nrow, gpus, brow = int(a.node[arow]), int(a.gpus[arow]), int(a.bid[arow])
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
            Ending(int(a.id[arow]), int(self.b.id[brow]), self.n_id[nrow], _STATUSES[status],
                   reason, at)
        )
        self._refresh_free(nrow)

    def _final_charge(self, arow: int, at: float) -> None:
        a = self.a
        seconds = at - float(a.charged[arow])
        if seconds > 0:
            brow = int(a.bid[arow])
            price, gpus = float(a.price[arow]), int(a.gpus[arow])
            self._out.final_charges.append(
                (int(a.id[arow]), int(self.b.id[brow]), int(self.b.tenant[brow]), gpus, price,
                 seconds)
            )
        a.charged[arow] = max(at, float(a.charged[arow]))

    def _final_charges(self) -> Charges:
        rows = self._out.final_charges
        if not rows:
            return Charges.empty()
        ids, bids, tenants, gpus, price, seconds = (np.asarray(c) for c in zip(*rows))
        price = price.astype(np.float64)
        seconds = seconds.astype(np.float64)
        amount = price * gpus * seconds / _SECONDS_PER_HOUR
        return Charges(ids.astype(np.int64), bids.astype(np.int64), tenants.astype(np.int64),
                       gpus.astype(np.int64), price, seconds, amount)

    # ------------------------------------------------------------------ the tick

    def tick(self, now: float) -> Decision:
        """Clear every pool at time ``now`` and return what changed (DESIGN §3)."""
        now = check_time("now", now)
        if now < self._now:
            raise ValueError(f"now must not go backwards: {now!r} < {self._now!r}")
        self._now = now
        self._tick += 1
        self._out = _TickOut()
        self._compact_books()
        for pool in self._pools:
            pool.incumbents = None
        self._node_conditions(now)
        self._deadlines_due(now)
        self._windows_closing(now)
        self._promote(now)
        for model in sorted(range(len(self._models)), key=self._models.__getitem__):
            self._clear_model(model, now)
        quotes, clearing = self._quotes(now)
        charges = Charges.concat([self._final_charges(), self._charge_running(now, clearing)])
        out = self._out
        placements = out.placements()
        self._out = _TickOut()
        return Decision(now, placements, tuple(out.notices), tuple(out.endings),
                        tuple(out.promotions), charges, quotes)

    def _compact_books(self, force: bool = False) -> None:
        b = self.b
        for book in self._books:
            if force or book.needs_compaction():
                rows = book.live_rows(b.status, b.epoch, WAITING)
                order = priority_order(b.price[rows], b.created[rows], b.id[rows])
                book.reset(rows[order], b.epoch[rows[order]])
        for pool in self._pools:
            if pool.capacity.entries > 4 * len(pool.nodes) + 64:
                live = [r for r in pool.nodes if self.n_free[r] > 0]
                pool.capacity.rebuild([(self.n_id[r] << ROW_BITS) | r for r in live],
                                      [self.n_reserve[r] for r in live],
                                      [self.n_free[r] for r in live])

    def _node_conditions(self, now: float) -> None:
        """Notices or endings for allocations on reclaimed, lost or re-priced nodes."""
        suspects = sorted(self._suspect_nodes, key=self.n_id.__getitem__)
        self._suspect_nodes = set()
        a = self.a
        deadline = now + self.config.notice_seconds
        for nrow in suspects:
            state = self.n_state[nrow]
            for arow in self._node_allocs(nrow):
                status = a.status[arow]
                if state is NodeState.LOST:
                    self._end(arow, RELEASED if status == RESERVED else PREEMPTED,
                              "node lost", now)
                elif state is NodeState.RECLAIMED:
                    if status == RESERVED:
                        self._end(arow, RELEASED, "node reclaimed", now)
                    elif status == RUNNING:
                        self._notice(arow, NoticeReason.RECLAIMED, deadline, now)
                elif self.b.price[a.bid[arow]] < self.n_reserve[nrow]:
                    if status == RUNNING:
                        self._notice(arow, NoticeReason.BELOW_RESERVE, deadline, now)
                    elif status == RESERVED:
                        self._end(arow, RELEASED, "below reserve", now)

    def _deadlines_due(self, now: float) -> None:
        a = self.a
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, arow = heappop(heap)
            status = a.status[arow]
            if status in (NOTICED, RESERVED) and a.deadline[arow] == deadline:
                if status == NOTICED:
                    self._end(arow, PREEMPTED, "notice deadline passed", deadline)
                elif not self._try_promote(arow, now):  # late tick: start it if it can
                    self._end(arow, RELEASED, "reservation expired", deadline)

    def _windows_closing(self, now: float) -> None:
        a = self.a
        for window in sorted(self._window_allocs, key=self._windows.__getitem__):
            interval = self._windows[window]
            if interval.end - now > self.config.notice_seconds and interval.start <= now:
                continue
            deadline = max(interval.end, now) if interval.start <= now else now
            for arow in sorted(self._window_allocs[window], key=lambda r: a.id[r]):
                self._notice(arow, NoticeReason.WINDOW_CLOSING, deadline, now)

    def _window_open(self, window: int, now: float) -> bool:
        """Whether a bid with this window may start now (not within a notice of its close)."""
        if window < 0:
            return True
        interval = self._windows[window]
        return interval.start <= now and interval.end - now > self.config.notice_seconds

    def _promote(self, now: float) -> None:
        for arow in sorted(self._reserved, key=lambda r: self.a.id[r]):
            self._try_promote(arow, now)

    def _try_promote(self, arow: int, now: float) -> bool:
        """Start a reservation whose bid runs nowhere else and whose GPUs are free now."""
        a = self.a
        brow, nrow, gpus = int(a.bid[arow]), int(a.node[arow]), int(a.gpus[arow])
        if self.b.run[brow] >= 0:
            return False
        if self.n_running[nrow] + self.n_noticed[nrow] + gpus > self.n_cap[nrow]:
            return False
        if self.n_state[nrow] not in (NodeState.LIVE, NodeState.DRAINING):
            return False
        if self.b.price[brow] < self.n_reserve[nrow]:
            return False
        self._reserved.discard(arow)
        self.b.res[brow], self.b.run[brow] = -1, arow
        self.n_reserved[nrow] -= gpus
        self.n_running[nrow] += gpus
        a.status[arow] = RUNNING
        a.charged[arow] = a.started[arow] = now
        a.deadline[arow] = math.nan
        a.tick[arow] = -1  # an incumbent: challengers of this tick may outbid it
        self._track_window(arow, True)
        self._out.promotions.append(int(a.id[arow]))
        self._refresh_free(nrow)
        return True

    # ------------------------------------------------------------------ clearing

    def _free_fit(self, brow: int) -> int | None:
        """The node row a bid would take among free GPUs now, or None."""
        b = self.b
        size, price, model, region = int(b.gpus[brow]), float(b.price[brow]), int(b.model[brow]), \
            int(b.region[brow])
        if region >= 0:
            p = self._pool_index.get((model, region))
            if p is None:
                return None
            found = self._fit(self._pools[p].capacity, size, price)
            return None if found is None else found[-1] & ROW_MASK
        best = None
        for p in self._model_pools[model]:
            found = self._fit(self._pools[p].capacity, size, price)
            if found is not None and (best is None or found < best):
                best = found
        return None if best is None else best[-1] & ROW_MASK

    def _fit(self, capacity: PoolCapacity, size: int, price: float):
        if self._policy.name == "best-fit":
            return capacity.best_fit(size, price, self.n_free, self.n_reserve)
        return capacity.first_fit(size, price, self.n_free, self.n_reserve)

    def _clear_model(self, model: int, now: float) -> None:
        b = self.b
        open_books = [
            self._books[i] for i in self._model_books[model]
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
        a book qualifies when its GPU count divides every node of its pool (every pool of the
        model, for an any-region book, and then only if all the model's pools qualify). Then
        any set of bids whose GPUs add up to at most a pool's GPUs packs exactly, largest first,
        so the greedy rule needs only each pool's remaining GPUs: a region bid is admitted when
        they suffice, an any-region bid goes to the pool with the fewest remaining GPUs that
        suffice (best fit between pools; ties: region name). It stops before the first bid of a
        book that does not qualify; the one-by-one loop takes it from there. Bids are packed
        largest first into the smallest nodes first, so whole large nodes stay free longest.
        """
        b = self.b
        fresh: dict[int, tuple[_Pool, list[int], float, int]] = {}
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
            if book.region >= 0:
                entry = fresh.get(book.region)
                if entry is None:
                    continue  # another pool's book: it cannot take these GPUs
                qualifies = entry[3] % book.size == 0
            else:
                qualifies = all_fresh and any_gcd % book.size == 0
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
            ahead = (neg < sp) | ((neg == sp) & (
                (b.created[rows] < sc) | ((b.created[rows] == sc) & (b.id[rows] < si))))
            rows = rows[: int(np.argmin(ahead)) if not ahead.all() else len(rows)]
        if len(rows) == 0:
            return
        # the greedy admission: each pool's remaining GPUs are all that matter
        regions = sorted(fresh, key=self._regions.__getitem__)
        remaining = {r: sum(self.n_cap[n] for n in fresh[r][1]) for r in regions}
        reserve = {r: fresh[r][2] for r in regions}
        left = sum(remaining.values())
        smallest = min(bk.size for bk in mine)
        won: list[int] = []
        won_region: list[int] = []
        for i, (region, size, price) in enumerate(zip(
                b.region[rows].tolist(), b.gpus[rows].tolist(), b.price[rows].tolist(),
                strict=True)):
            if region >= 0:
                if remaining[region] >= size and price >= reserve[region]:
                    remaining[region] -= size
                else:
                    continue
            else:
                best = -1
                for r in regions:
                    room = remaining[r]
                    if room >= size and price >= reserve[r] and (
                            best < 0 or room < remaining[best]):
                        best = r
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
            pool.capacity.rebuild([(self.n_id[r] << ROW_BITS) | r for r in live],
                                  [self.n_reserve[r] for r in live],
                                  [self.n_free[r] for r in live])
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
            rest = book.rows[book.head:]
            alive = (b.status[rest] == WAITING) & (b.epoch[rest] == book.epochs[book.head:])
            book.head += int(np.argmax(alive)) if alive.any() else len(rest)
            book.count = int(np.count_nonzero(alive)) + sum(
                1 for *_, r, e in book.delta if b.status[r] == WAITING and b.epoch[r] == e)
        windows = b.window[won_rows]
        if (windows >= 0).any():
            for arow in np.arange(s.start, s.stop)[windows >= 0].tolist():
                self._track_window(arow, True)
        self._out.add_chunk(
            alloc_ids, b.id[won_rows], np.asarray(self.n_id, np.int64)[nrows], gpus,
            np.full(k, _KIND[PlacementKind.NEW], np.int8), np.full(k, math.nan),
        )

    def _incumbents(self, pool: _Pool) -> tuple[np.ndarray, np.ndarray]:
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
        b = self.b
        size, price, model, region = int(b.gpus[brow]), float(b.price[brow]), int(b.model[brow]), \
            int(b.region[brow])
        pools = self._model_pools[model] if region < 0 else [self._pool_index.get((model, region))]
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
        self._place(brow, best[1], PlacementKind.TAKEOVER, now,
                    now + self.config.notice_seconds + self.config.reservation_grace_seconds)
        return True

    def _evict_for(self, brow: int, now: float) -> bool:
        """Notice the weakest incumbents a challenger beats on one node, and reserve it there."""
        b, a = self.b, self.a
        size, price, model, region = int(b.gpus[brow]), float(b.price[brow]), int(b.model[brow]), \
            int(b.region[brow])
        pools = self._model_pools[model] if region < 0 else [self._pool_index.get((model, region))]
        h = 1.0 + self.config.hysteresis
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
                if not self.n_state[nrow].offers_capacity() or self.n_reserve[nrow] > price:
                    continue
                room = self.n_cap[nrow] - self.n_running[nrow] - self.n_reserved[nrow]
                if room + self.n_running[nrow] < size:
                    continue
                victims = sorted(
                    (r for r in self._node_allocs(nrow) if a.status[r] == RUNNING
                     and a.tick[r] != self._tick and b.price[a.bid[r]] * h < price),
                    key=lambda r: (float(b.price[a.bid[r]]), -int(a.id[r])),
                )
                chosen = []
                for r in victims:
                    if room >= size:
                        break
                    chosen.append(r)
                    room += int(a.gpus[r])
                if room < size:
                    continue
                deadline = now + self.config.notice_seconds
                # reserve first, so a victim's migration cannot take these GPUs
                self._place(brow, nrow, PlacementKind.TAKEOVER, now,
                            deadline + self.config.reservation_grace_seconds)
                for r in chosen:
                    self._notice(r, NoticeReason.OUTBID, deadline, now)
                return True
            pool.evict_failed_size = min(pool.evict_failed_size, size)
        return False

    # ------------------------------------------------------------------ prices and charges

    def _live(self, pool: _Pool) -> list[int]:
        if pool.live is None:
            live = pool.live = [r for r in pool.nodes if self.n_state[r].offers_capacity()]
            pool.max_cap = max((self.n_cap[r] for r in live), default=0)
            pool.total = sum(self.n_cap[r] for r in live)
            pool.min_reserve = min((self.n_reserve[r] for r in live), default=None)
        return pool.live

    def _quotes(self, now: float) -> tuple[tuple[PoolQuote, ...], np.ndarray]:
        b, a = self.b, self.a
        n_pools = len(self._pools)
        losing = np.full(n_pools, -math.inf)
        waiting = np.zeros(n_pools, np.int64)
        for pool in self._pools:
            self._live(pool)
        max_cap = [pool.max_cap for pool in self._pools]
        peek_args = (b.status, b.epoch, b.price, b.created, b.id, WAITING)
        for book in self._books:
            if book.count <= 0 or not self._window_open(book.window, now):
                continue
            head = book.peek(*peek_args)
            pools = self._model_pools[book.model] if book.region < 0 else \
                [self._pool_index.get((book.model, book.region))]
            for p in pools:
                if p is None or max_cap[p] < book.size:
                    continue
                waiting[p] += book.count
                if head is not None:
                    losing[p] = max(losing[p], -head[0][0])
        for arow in self._noticed_outbid:
            if a.status[arow] != NOTICED:
                continue
            brow = int(a.bid[arow])
            if b.res[brow] >= 0:
                continue
            if self._window_open(int(b.window[brow]), now):
                p = int(a.pool[arow])
                losing[p] = max(losing[p], float(b.price[brow]))
        n = a.n
        busy = np.flatnonzero((a.status[:n] == RUNNING) | (a.status[:n] == NOTICED))
        running = np.bincount(a.pool[busy], weights=a.gpus[busy], minlength=n_pools)
        clearing = np.full(n_pools, np.nan)
        quotes = []
        for pool in sorted(self._pools, key=lambda q: (self._models[q.model],
                                                       self._regions[q.region])):
            reserve = pool.min_reserve
            lose = float(losing[pool.index]) if losing[pool.index] > -math.inf else None
            price = None
            if reserve is not None:
                price = max(reserve, lose) if lose is not None else reserve
                clearing[pool.index] = price
            quotes.append(PoolQuote(
                gpu_model=self._models[pool.model],
                region=self._regions[pool.region],
                clearing_price=price,
                reserve_price=reserve,
                highest_losing_bid=lose,
                gpus_total=pool.total,
                gpus_free=pool.free,
                gpus_running=int(running[pool.index]),
                waiting_bids=int(waiting[pool.index]),
            ))
        return tuple(quotes), clearing

    def _charge_running(self, now: float, clearing: np.ndarray) -> Charges:
        a, b = self.a, self.b
        n = a.n
        status = a.status[:n]
        rows = np.flatnonzero((status == RUNNING) | (status == NOTICED))
        if len(rows) == 0:
            return Charges.empty()
        seconds = now - a.charged[rows]
        gpus = a.gpus[rows].astype(np.int64)
        price = a.price[rows]
        bill = seconds > 0
        brows = a.bid[rows]
        charged = rows[bill]
        order = np.argsort(a.id[charged], kind="stable")
        charged = charged[order]
        c_price, c_seconds = price[bill][order], seconds[bill][order]
        c_gpus = gpus[bill][order]
        charges = Charges(
            a.id[charged].copy(), b.id[a.bid[charged]], b.tenant[a.bid[charged]], c_gpus,
            c_price.copy(), c_seconds, c_price * c_gpus * c_seconds / _SECONDS_PER_HOUR,
        )
        # the price in force from now on
        if self._n_reserve_np is None:
            self._n_reserve_np = np.asarray(self.n_reserve, np.float64)
        node_reserve = self._n_reserve_np[a.node[rows]]
        pool_price = clearing[a.pool[rows]]
        pool_price = np.where(np.isnan(pool_price), node_reserve, pool_price)
        a.price[rows] = np.minimum(np.maximum(pool_price, node_reserve), b.price[brows])
        a.charged[rows] = now
        return charges

    # ------------------------------------------------------------------ views

    def snapshot(self) -> MarketState:
        """The market's current contents as frozen values (``from_state`` rebuilds it)."""
        b, a = self.b, self.a
        nodes = tuple(
            Node(self.n_id[r], self._models[self._pools[self.n_pool[r]].model],
                 self._regions[self._pools[self.n_pool[r]].region], self.n_cap[r],
                 self.n_reserve[r], self.n_state[r])
            for r in range(len(self.n_id))
        )
        bids = []
        for row in range(b.n):
            if b.status[row] == GONE:
                continue
            window = int(b.window[row])
            deadline = float(b.deadline[row])
            bids.append(Bid(
                id=int(b.id[row]), gpu_model=self._models[b.model[row]],
                gpu_count=int(b.gpus[row]), max_price=float(b.price[row]),
                region=ANY_REGION if b.region[row] < 0 else self._regions[b.region[row]],
                created_at=float(b.created[row]),
                window=None if window < 0 else self._windows[window],
                deadline=None if math.isnan(deadline) else deadline,
                tenant_id=int(b.tenant[row]),
            ))
        allocs = []
        for arow in range(a.n):
            status = _STATUSES[a.status[arow]]
            if status.is_terminal():
                continue
            deadline = float(a.deadline[arow])
            reason = int(a.reason[arow])
            allocs.append(Allocation(
                id=int(a.id[arow]), bid_id=int(b.id[a.bid[arow]]),
                node_id=self.n_id[a.node[arow]], gpu_count=int(a.gpus[arow]), status=status,
                started_at=float(a.started[arow]), charged_until=float(a.charged[arow]),
                price=float(a.price[arow]), deadline=None if math.isnan(deadline) else deadline,
                notice_reason=None if reason < 0 else _REASONS[reason],
            ))
        return MarketState(nodes, tuple(bids), tuple(allocs), self.config, self._next_alloc_id)

    @property
    def now(self) -> float:
        return self._now

    def node_load(self, node_id: int) -> tuple[int, int, int, int]:
        """``(gpu_count, running, noticed, reserved)`` GPUs of a node."""
        r = self._node_row[node_id]
        return self.n_cap[r], self.n_running[r], self.n_noticed[r], self.n_reserved[r]


def clear(state: MarketState, now: float) -> Decision:
    """Clear ``state`` at ``now``: the pure form of :meth:`Market.tick`."""
    return Market.from_state(state).tick(now)


