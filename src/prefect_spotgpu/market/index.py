"""The state the parts of :class:`~prefect_spotgpu.market.engine.Market` share, declared once.

``MarketIndex`` holds every attribute of a market — interned names, pools and books, the node
lists, the bid and allocation columns, the deadline heap, the tick's output — and the small
operations that keep them consistent or read them (free GPUs of a node, a bid's row, the
allocations on a node, the fit of a bid among free GPUs). It decides nothing.

The market's parts are objects, each given this index and the parts it calls (the graph is
built once, in ``Market.__init__``; ``tests/test_market_parts.py`` builds each part alone):

- ``pricing.py`` (``Pricing(index)``): quotes and charges;
- ``allocations.py`` (``Allocations(index, pricing)``): create, notice, promote and end
  allocations; its ``gangs`` are given once the gang rules exist (the one cycle: a member's
  notice notices its gang, and the gang rules place and end through ``Allocations``);
- ``gangs.py`` (``Gangs(index, allocations)``): placing, noticing and ending gangs;
- ``bulk.py`` (``BulkAdmission(index)``): the cold tick of empty pools;
- ``clearing.py`` (``Clearing(index, allocations, gangs, bulk)``): the clearing loop;
- ``holds.py`` (``Holds(index, allocations)``) and ``runners.py`` (``Runners(index)``);
- ``incumbents.py``: functions of the index, who a bid may evict (clearing and gangs).

Every attribute and operation here is public to those parts and to nobody else (the service
uses ``Market`` and its parts, never the index). Rows are appended and never moved; a bid's
row is ``GONE`` once it has left the book, an allocation's row keeps its terminal status.
"""

from __future__ import annotations

import math

import numpy as np

from prefect_spotgpu.market.book import ROW_BITS, ROW_MASK, Book, PoolCapacity, priority_order
from prefect_spotgpu.market.policies import get_packing_policy
from prefect_spotgpu.market.serving import SERVES_ALL, SERVES_IMAGES, SERVES_PROCESS, needs_mask
from prefect_spotgpu.market.tables import (
    ACTIVE,
    GONE,
    PREEMPTED,
    WAITING,
    Columns,
    Pool,
    TickOut,
)
from prefect_spotgpu.market.types import (
    ANY_REGION,
    Bid,
    Capacity,
    Interval,
    MarketConfig,
    Node,
    NodeState,
)


class MarketIndex:
    """A market's in-memory state (see the module docstring for who changes what)."""

    def __init__(self, config: MarketConfig | None = None, *, next_allocation_id: int = 1) -> None:
        self.config = config or MarketConfig()
        self.policy = get_packing_policy(self.config.packing)
        self.next_alloc_id = next_allocation_id  # ids are never reused
        self.now = -math.inf  # the last tick's time: ticks never go backwards
        self.tick_number = 0  # the tick's number: allocations placed in it are no incumbents yet
        self.out = TickOut()  # what this tick (or this cancel, this ack) decided so far
        # interning: names become small ints; pools are (model, region), books are (model,
        # region or -1 for any, GPU count, window or -1) of waiting bids
        self.models: list[str] = []  # a model id is one (gpu model, capacity) pair
        self.model_capacity: list[Capacity] = []
        self.model_index: dict[tuple[str, Capacity], int] = {}
        self.regions: list[str] = []
        self.region_index: dict[str, int] = {}
        self.images: list[str] = [""]  # image ids: 0 is none
        self.image_index: dict[str, int] = {}
        self.windows: list[Interval] = []
        self.window_index: dict[Interval, int] = {}
        self.pools: list[Pool] = []
        self.pool_index: dict[tuple[int, int], int] = {}
        self.model_pools: dict[int, list[int]] = {}  # sorted by region name
        self.books: list[Book] = []
        self.book_index: dict[tuple[int, int, int, int, int, bool], int] = {}
        self.model_books: dict[int, list[int]] = {}
        # nodes, one row each by registration order (python lists: scalar access in the hot
        # loop); GPU counters are kept by the allocation changes, n_free by refresh_free
        self.node_row: dict[int, int] = {}  # node id -> row
        self.n_id: list[int] = []
        self.n_pool: list[int] = []
        self.n_cap: list[int] = []
        self.n_reserve: list[float] = []
        self.n_state: list[NodeState] = []
        self.n_running: list[int] = []
        self.n_noticed: list[int] = []
        self.n_reserved: list[int] = []
        self.n_res_mig: list[int] = []  # of n_reserved: migration reservations (on free GPUs)
        self.n_free: list[int] = []  # -1: offers no capacity (not live)
        self.n_images: list[frozenset[int]] = []  # the image ids the node holds
        self.n_serves: list[int] = []  # what it serves: SERVES_* bits (types.serves_mask)
        self.csr: tuple[list[int], list[int]] | None = None  # node -> alloc rows index
        self.node_extra: dict[int, list[int]] = {}  # alloc rows added since the index
        self.extra_count = 0
        self.n_reserve_np: np.ndarray | None = None  # n_reserve as an array (None: stale)
        self.suspect_nodes: set[int] = set()  # rows to re-check next tick (state, reserve)
        # bids, one row each (status GONE / WAITING / ACTIVE, from tables.py); epoch counts
        # the bid's book entries (an older entry is stale); run and res: its allocation rows
        self.b = Columns(
            id=np.int64,
            model=np.int32,
            region=np.int32,
            gpus=np.int32,
            price=np.float64,
            created=np.float64,
            window=np.int32,
            image=np.int32,  # its job's image id (0: none)
            deadline=np.float64,
            tenant=np.int64,
            status=np.int8,
            epoch=np.int64,
            book=np.int32,
            run=np.int64,
            res=np.int64,
            gang=np.int64,  # a gang member: its first member's row (-1: a one-node bid)
        )
        # gangs: first member's row -> member rows in rank order. Only the first member has a
        # book entry; the members leave and rejoin the book together (all WAITING, or none)
        self.gangs: dict[int, list[int]] = {}
        self.gang_ending = False  # a whole gang is being ended: its members do not cascade
        # bids held for credit (their first member's row): they leave the market once idle
        self.held: set[int] = set()
        self.bid_row: dict[int, int] = {}  # id -> row of an open bid
        # allocations, one row each (status: an AllocationStatus code, from tables.py); reason:
        # the notice reason; mig: a migration reservation; tick: the tick that placed it;
        # fee_owed: a takeover's notice fee still owed (market/notice_fee.py)
        self.a = Columns(
            id=np.int64,
            bid=np.int64,
            node=np.int64,
            pool=np.int32,
            gpus=np.int32,
            status=np.int8,
            price=np.float64,
            charged=np.float64,
            carry=np.int64,  # below one micro, owed into the next charge (market/money.py)
            started=np.float64,
            deadline=np.float64,
            reason=np.int8,
            mig=np.int8,
            tick=np.int64,
            fee_owed=np.int64,  # micros of its notice fee its charges have not covered yet
        )
        self.alloc_row: dict[int, int] = {}  # id -> row, except those placed in bulk:
        self.alloc_blocks: list[tuple[int, int, int]] = []  # (first id, end id, first row)
        self.deadlines: list[tuple[float, int, int]] = []  # heap of (deadline, id, row)
        self.reserved: set[int] = set()  # rows of RESERVED allocations
        self.window_allocs: dict[int, set[int]] = {}  # window -> rows running in it
        self.noticed_outbid: set[int] = set()  # rows NOTICED as outbid (they bid in quotes)

    # ------------------------------------------------------------------ interning

    def intern_model(self, name: str, capacity: Capacity = Capacity.SPOT) -> int:
        """The model id of ``name`` sold as ``capacity``: spot and on-demand GPUs of one model
        are different models to the clearing, so neither kind is ever placed on the other."""
        i = self.model_index.get((name, capacity))
        if i is None:
            i = self.model_index[(name, capacity)] = len(self.models)
            self.models.append(name)
            self.model_capacity.append(capacity)
            self.model_pools[i] = []
            self.model_books[i] = []
        return i

    def intern_image(self, name: str | None) -> int:
        if not name:
            return 0
        image = self.image_index.get(name)
        if image is None:
            image = self.image_index[name] = len(self.images)
            self.images.append(name)
        return image

    def intern_region(self, name: str) -> int:
        i = self.region_index.get(name)
        if i is None:
            i = self.region_index[name] = len(self.regions)
            self.regions.append(name)
        return i

    def pool_for(self, model: int, region: int) -> Pool:
        i = self.pool_index.get((model, region))
        if i is None:
            i = self.pool_index[(model, region)] = len(self.pools)
            self.pools.append(Pool(i, model, region))
            pools = self.model_pools[model]
            pools.append(i)
            pools.sort(key=lambda p: self.regions[self.pools[p].region])
        return self.pools[i]

    def known_region(self, region: str) -> bool:
        if self.config.open_regions:
            return True
        if self.config.regions is not None:
            return region in self.config.regions
        return region in self.region_index

    def book_for(
        self,
        model: int,
        region: int,
        size: int,
        window: int,
        nodes: int = 1,
        image: bool = False,
        least: int | None = None,
    ) -> Book:
        """The book of waiting bids of these terms; bids with an image apart from those without
        (in a mixed pool one kind can wait while the other is placed)."""
        least = nodes if least is None else least
        key = (model, region, size, window, nodes, image, least)
        i = self.book_index.get(key)
        if i is None:
            i = self.book_index[key] = len(self.books)
            self.books.append(Book(i, model, region, size, window, nodes, image, least))
            self.model_books[model].append(i)
        return self.books[i]

    # ------------------------------------------------------------------ nodes and capacity

    def add_node_row(self, node: Node) -> None:
        """Register a new node: a row in every node list, in its pool (kept by node id)."""
        model = self.intern_model(node.gpu_model, node.capacity)
        region = self.intern_region(node.region)
        pool = self.pool_for(model, region)
        row = self.node_row[node.id] = len(self.n_id)
        self.n_id.append(node.id)
        self.n_pool.append(pool.index)
        self.n_cap.append(node.gpu_count)
        self.n_reserve.append(node.reserve_price)
        self.n_state.append(node.state)
        self.n_running.append(0)
        self.n_noticed.append(0)
        self.n_reserved.append(0)
        self.n_res_mig.append(0)
        self.n_free.append(-1)
        self.n_images.append(frozenset(self.intern_image(i) for i in node.images))
        self.n_serves.append(node.serves)
        self.n_reserve_np = None
        pool.nodes.append(row)
        pool.live = None
        if len(pool.nodes) > 1 and self.n_id[pool.nodes[-2]] > node.id:
            pool.nodes.sort(key=self.n_id.__getitem__)
        self.refresh_free(row)
        if node.serves != SERVES_ALL and not pool.mixed:
            self.remix(pool)

    def remix(self, pool: Pool) -> None:
        """After a node of the pool changed what it serves: the pool is mixed while any of its
        nodes serves not every bid (its fits then look at the nodes that serve a bid's kind),
        and its free-capacity buckets are rebuilt either way (none may offer a node to a kind
        it no longer serves)."""
        pool.mixed = any(self.n_serves[r] != SERVES_ALL for r in pool.nodes)
        if not pool.mixed:
            pool.kind_capacity = {}
        self.rebuild_capacity(pool, [r for r in pool.nodes if self.n_free[r] > 0])

    def refresh_free(self, row: int, force: bool = False) -> None:
        """Recompute a node's free GPUs: not running, not noticed, not promised.

        Migration reservations sit on GPUs that were free; takeover reservations on GPUs that
        noticed allocations will free (plus free ones when those are not enough), hence
        ``cap - running - migrations - max(noticed, takeovers)``. Every change to a node's
        counters ends here, so it also keeps the pool's ``claimable`` nodes.
        """
        pool = self.pools[self.n_pool[row]]
        unclaimed = self.n_cap[row] - self.n_running[row] - self.n_reserved[row]
        if unclaimed > 0 and row in pool.noticed_nodes:
            pool.claimable.add(row)
        else:
            pool.claimable.discard(row)
        if self.n_state[row].offers_capacity():
            migrating = self.n_res_mig[row]
            free = (
                self.n_cap[row]
                - self.n_running[row]
                - migrating
                - max(self.n_noticed[row], self.n_reserved[row] - migrating)
            )
        else:
            free = -1
        old = self.n_free[row]
        if free != old or force:
            self.n_free[row] = free
            pool.free += max(free, 0) - max(old, 0)
            if free > 0:
                key = (self.n_id[row] << ROW_BITS) | row
                pool.capacity.push(key, self.n_reserve[row], free)
                if pool.mixed:
                    serves = self.n_serves[row]
                    for kind, holders in pool.kind_capacity.items():
                        if serves & kind:
                            holders.push(key, self.n_reserve[row], free)
                for image in self.n_images[row]:
                    holders = pool.image_capacity.get(image)
                    if holders is None:
                        holders = pool.image_capacity[image] = PoolCapacity()
                    holders.push(key, self.n_reserve[row], free)

    def live(self, pool: Pool) -> list[int]:
        """A pool's live node rows, and its largest node, GPUs and lowest reserve among them
        (kept until a node of the pool changes)."""
        if pool.live is None:
            live = pool.live = [r for r in pool.nodes if self.n_state[r].offers_capacity()]
            pool.max_cap = max((self.n_cap[r] for r in live), default=0)
            pool.total = sum(self.n_cap[r] for r in live)
            pool.min_reserve = min((self.n_reserve[r] for r in live), default=None)
            pool.serves = 0
            for r in live:
                pool.serves |= self.n_serves[r]
        return pool.live

    def free_fit(self, brow: int) -> int | None:
        """The node row a bid would take among free GPUs now, or None."""
        b = self.b
        size, price, model, region, image = (
            int(b.gpus[brow]),
            float(b.price[brow]),
            int(b.model[brow]),
            int(b.region[brow]),
            int(b.image[brow]),
        )
        if region >= 0:
            p = self.pool_index.get((model, region))
            if p is None:
                return None
            found = self.fit(self.pools[p], size, price, image)
            return None if found is None else found[-1] & ROW_MASK
        best = None
        for p in self.model_pools[model]:
            found = self.fit(self.pools[p], size, price, image)
            if found is not None and (best is None or found < best):
                best = found
        return None if best is None else best[-1] & ROW_MASK

    def fit(
        self, pool: Pool, size: int, price: float, image: int = 0, exclude: set[int] | None = None
    ):
        """The fit of a bid in a pool, as a key that orders fits (its last item the node's
        key), on a node not in ``exclude``. Best fit: ``(free, reserve, misses its image,
        key)`` -- among equal fits, a node that holds the bid's image comes first."""
        capacity = self.capacity_for(pool, image)
        if self.policy.name != "best-fit":
            return capacity.first_fit(size, price, self.n_free, self.n_reserve, exclude)
        found = capacity.best_fit(size, price, self.n_free, self.n_reserve, exclude)
        if found is None or not image:
            return None if found is None else (found[0], found[1], 0, found[2])
        free, reserve, key = found
        holders = pool.image_capacity.get(image)
        if holders is not None:
            n_images, n_serves = self.n_images, self.n_serves
            held = holders.lowest_at(
                free,
                reserve,
                self.n_free,
                self.n_reserve,
                lambda r: image in n_images[r] and n_serves[r] & SERVES_IMAGES,
                exclude,
            )
            if held is not None:
                return (free, reserve, 0, held)
        return (free, reserve, 1, key)

    def capacity_for(self, pool: Pool, image: int) -> PoolCapacity:
        """The free capacity a bid (with image id ``image``, 0: none) may take in a pool: all
        of it, or in a mixed pool only the nodes that serve the bid (``types.Runner``)."""
        return pool.kind_capacity[needs_mask(image)] if pool.mixed else pool.capacity

    def serves(self, nrow: int, image: int) -> bool:
        """Whether node row ``nrow`` serves a bid with image id ``image``."""
        return bool(self.n_serves[nrow] & needs_mask(image))

    def rebuild_capacity(self, pool: Pool, rows: list[int]) -> None:
        """Rebuild a pool's free-GPU buckets (and its image holders' and, in a mixed pool, its
        kinds') from its node ``rows``."""
        keys = [(self.n_id[r] << ROW_BITS) | r for r in rows]
        reserves, frees = [self.n_reserve[r] for r in rows], [self.n_free[r] for r in rows]
        pool.capacity.rebuild(keys, reserves, frees)
        if pool.mixed:
            for kind in (SERVES_PROCESS, SERVES_IMAGES):
                mine = [i for i, r in enumerate(rows) if self.n_serves[r] & kind]
                holders = pool.kind_capacity.setdefault(kind, PoolCapacity())
                holders.rebuild(
                    [keys[i] for i in mine], [reserves[i] for i in mine], [frees[i] for i in mine]
                )
        for image, holders in pool.image_capacity.items():
            held = [i for i, r in enumerate(rows) if image in self.n_images[r]]
            holders.rebuild(
                [keys[i] for i in held], [reserves[i] for i in held], [frees[i] for i in held]
            )

    # ------------------------------------------------------------------ bid and allocation rows

    def bid_value(self, row: int) -> Bid:
        """The open bid of a row, as a frozen value."""
        b = self.b
        window = int(b.window[row])
        deadline = float(b.deadline[row])
        leader, book = int(b.gang[row]), self.books[b.book[row]]
        return Bid(
            id=int(b.id[row]),
            gpu_model=self.models[b.model[row]],
            gpu_count=int(b.gpus[row]),
            max_price=float(b.price[row]),
            region=ANY_REGION if b.region[row] < 0 else self.regions[b.region[row]],
            created_at=float(b.created[row]),
            window=None if window < 0 else self.windows[window],
            deadline=None if math.isnan(deadline) else deadline,
            tenant_id=int(b.tenant[row]),
            capacity=self.model_capacity[b.model[row]],
            image=self.images[b.image[row]] or None,
            node_count=1 if leader < 0 else book.nodes,
            gang_id=None if leader < 0 else int(b.id[leader]),
            min_node_count=None if leader < 0 or book.least == book.nodes else book.least,
        )

    def bid_row_of(self, bid_id: int) -> int:
        row = self.bid_row.get(bid_id)
        if row is None or self.b.status[row] == GONE:
            raise KeyError(f"bid {bid_id} is not open in the market")
        return row

    def close_bid(self, row: int) -> None:
        b = self.b
        if b.status[row] == WAITING and b.gang[row] in (-1, row):  # it has a book entry
            self.books[b.book[row]].count -= 1
        b.status[row] = GONE
        del self.bid_row[int(b.id[row])]

    def members(self, row: int) -> list[int]:
        """The rows of a bid's gang in rank order (``[row]`` for a one-node bid)."""
        leader = int(self.b.gang[row])
        return [row] if leader < 0 else self.gangs[leader]

    def idle(self, row: int) -> bool:
        return self.b.run[row] < 0 and self.b.res[row] < 0

    def close_held(self, members: list[int]) -> None:
        """A bid held for credit that holds nothing leaves the market (every gang member)."""
        leader = members[0]
        for m in members:
            self.close_bid(m)
        if len(members) > 1:
            del self.gangs[leader]
        self.held.discard(leader)

    def to_waiting(self, row: int) -> None:
        """A bid with no allocation left waits again; a gang member only once every member
        has none (then the gang's first member rejoins its book)."""
        b = self.b
        members = self.members(row)
        if len(members) > 1 and not all(self.idle(m) for m in members):
            return  # parked (ACTIVE with no allocation) until the rest of the gang ends
        if members[0] in self.held:  # held for credit: it leaves instead (market/holds.py)
            self.close_held(members)
            return
        for m in members:
            b.status[m] = WAITING
            b.epoch[m] += 1
        first = members[0]
        self.books[b.book[first]].insert(
            (-float(b.price[first]), float(b.created[first]), int(b.id[first])),
            first,
            int(b.epoch[first]),
        )

    def leave_book(self, row: int) -> None:
        """A bid (every member of its gang) stops waiting: it has an allocation now."""
        b = self.b
        members = self.members(row)
        if b.status[members[0]] == WAITING:
            self.books[b.book[members[0]]].count -= 1
        for m in members:
            b.status[m] = ACTIVE

    def alloc_row_of(self, alloc_id: int) -> int | None:
        row = self.alloc_row.get(alloc_id)
        if row is None:
            for first, end, first_row in self.alloc_blocks:
                if first <= alloc_id < end:
                    return first_row + alloc_id - first
        return row

    def bid_alloc_rows(self, brow: int) -> list[int]:
        """Active allocation rows of a bid, by allocation id."""
        rows = [int(r) for r in (self.b.run[brow], self.b.res[brow]) if r >= 0]
        return sorted(rows, key=lambda r: int(self.a.id[r]))

    def node_allocs(self, nrow: int) -> list[int]:
        """Active allocation rows on a node, by allocation id."""
        return sorted(self.node_alloc_rows(nrow), key=lambda r: int(self.a.id[r]))

    def node_alloc_rows(self, nrow: int) -> list[int]:
        """Active allocation rows on a node, in no particular order."""
        a = self.a
        if self.csr is None or self.extra_count > 65536:
            n = a.n
            active = np.flatnonzero(a.status[:n] < PREEMPTED)
            rows = active[np.argsort(a.node[active], kind="stable")]
            starts = np.searchsorted(a.node[rows], np.arange(len(self.n_id) + 1))
            self.csr = (rows.tolist(), starts.tolist())  # lists: sliced one node at a time
            self.node_extra, self.extra_count = {}, 0
        rows, starts = self.csr
        found = rows[starts[nrow] : starts[nrow + 1]] if nrow + 1 < len(starts) else []
        found.extend(self.node_extra.get(nrow, ()))
        return [r for r in found if a.status[r] < PREEMPTED]

    def track_window(self, arow: int, running: bool) -> None:
        window = int(self.b.window[self.a.bid[arow]])
        if window >= 0:
            allocs = self.window_allocs.setdefault(window, set())
            if running:
                allocs.add(arow)
            else:
                allocs.discard(arow)

    def window_open(self, window: int, now: float) -> bool:
        """Whether a bid with this window may start now (not within a notice of its close)."""
        if window < 0:
            return True
        interval = self.windows[window]
        return interval.start <= now and interval.end - now > self.config.notice_seconds

    # ------------------------------------------------------------------ books

    def compact_books(self, force: bool = False) -> None:
        b = self.b
        for book in self.books:
            if force or book.needs_compaction():
                rows = book.live_rows(b.status, b.epoch, WAITING)
                order = priority_order(b.price[rows], b.created[rows], b.id[rows])
                book.reset(rows[order], b.epoch[rows[order]])
        for pool in self.pools:
            bound = 4 * len(pool.nodes) + 64
            if pool.capacity.entries > bound or any(
                h.entries > bound
                for h in (*pool.image_capacity.values(), *pool.kind_capacity.values())
            ):
                self.rebuild_capacity(pool, [r for r in pool.nodes if self.n_free[r] > 0])
