"""The clearing engine: one uniform-price auction per pool, every tick
(docs/operators/architecture.md#design-3).

Invariants (each property-tested in ``tests/test_market_properties.py``):

- no node ever has more GPUs in use (running + noticed) or promised (running + reserved) than
  it has; so no GPU is held by two allocations;
- a running allocation pays ``min(max(pool clearing price, its node's reserve), its max price)``
  per GPU-second: never above its own maximum, never below its node's reserve. A maximum
  changed while it runs is in force from the next tick (the seconds before are billed at the
  terms they ran under). A noticed allocation pays at most the price in force at its notice
  and at most its maximum, but never below its node's reserve because of its own bid: a
  *release* (a maximum lowered below the reserve, which notices the job) pays the reserve
  until it ends, so a tenant cannot buy its notice's minutes for nothing;
- the same inputs give the same decision: ``Market`` carries its book between ticks, and its
  decision equals that of a market rebuilt cold from ``snapshot()``;
- a waiting bid that outbids a running one in its pool by more than the hysteresis margin, and
  would fit on that one's node once it left, is never left waiting while the other runs.

The rule, per tick and per GPU model (pools of a model share its "any region" bids):

1. the holds of bids out of credit (``holds.py``); notices for allocations on reclaimed nodes,
   over a raised reserve or whose window closes;
   endings for lost nodes, passed notice deadlines and expired reservations; reservations whose
   GPUs are free start (RESERVED -> RUNNING);
2. waiting bids, best first (price, then age), each take the tightest free fit on a node whose
   reserve they meet; with no free fit, the weakest running incumbents they beat by more than the
   hysteresis margin on one node get a notice and the challenger reserves their GPUs; a bid that
   can do neither ends its book's turn (every bid behind it in that book is lower and fails too);
   a noticed bid gets a migration reservation on free GPUs of its pool at once, when there are any;
3. the clearing price of a pool is the highest losing eligible bid, at least the lowest reserve;
4. every running or noticed allocation is charged for the seconds since its last charge at the
   price that was in force, and takes the new price (a takeover that noticed someone pays at
   least their notice's fee in all: ``notice_fee.py``).

``Market`` is the only mutable object in ``market/``: an in-memory index changed only through
its methods; it reads no clock and does no I/O. Its state is declared in ``index.py``
(``MarketIndex``); the rules above live in its parts, ``allocations.py`` (step 1 and every
allocation change), ``clearing.py`` (step 2) and ``pricing.py`` (steps 3 and 4). This module
holds its public methods: building, nodes, bids, external endings, the tick and the views.
"""

from __future__ import annotations

import math

import numpy as np

from prefect_spotgpu.market.allocations import Allocations
from prefect_spotgpu.market.book import MAX_NODES, priority_order
from prefect_spotgpu.market.bulk import BulkAdmission
from prefect_spotgpu.market.checks import ANY_REGION, MAX_GPUS_PER_NODE, MAX_ID
from prefect_spotgpu.market.clearing import Clearing
from prefect_spotgpu.market.decision import Charges, Decision, PlacementKind, Settlement
from prefect_spotgpu.market.gangs import Gangs
from prefect_spotgpu.market.gpus import DEFAULT_CATALOG
from prefect_spotgpu.market.holds import Holds
from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.pricing import Pricing
from prefect_spotgpu.market.runners import Runners
from prefect_spotgpu.market.tables import (
    FINISHED,
    GONE,
    NOTICED,
    REASONS,
    RELEASED,
    RESERVED,
    RUNNING,
    STATUSES,
    WAITING,
    TickOut,
)
from prefect_spotgpu.market.types import (
    Allocation,
    AllocationStatus,
    Bid,
    EndReason,
    MarketConfig,
    MarketState,
    Node,
    check_price,
    check_region,
    check_time,
)

_ENDED_AS = {  # why an allocation ended from outside the tick, by the status it ends in
    AllocationStatus.PREEMPTED: EndReason.ENDED_PREEMPTED,
    AllocationStatus.FINISHED: EndReason.ENDED_FINISHED,
    AllocationStatus.RELEASED: EndReason.ENDED_RELEASED,
}


class Market:
    """The market's order book and allocations, cleared by :meth:`tick`.

    ``Market(config, next_allocation_id=1)`` is an empty market; :meth:`from_state` fills one.
    Its state is one :class:`~prefect_spotgpu.market.index.MarketIndex` (``index``), which
    its parts are given: ``pricing``, ``allocations``, ``gangs``, ``bulk``, ``clearing``,
    ``holds`` and ``runners``, each an object that uses only the index and the parts it is
    given (each testable alone on an index, ``tests/test_market_parts.py``).

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
        self.index = index = MarketIndex(config, next_allocation_id=next_allocation_id)
        self.pricing = Pricing(index)
        self.allocations = Allocations(index, self.pricing)
        self.gangs = Gangs(index, self.allocations)
        self.allocations.gangs = self.gangs  # (the one cycle: Allocations' docstring)
        self.bulk = BulkAdmission(index)
        self.clearing = Clearing(index, self.allocations, self.gangs, self.bulk)
        self.holds = Holds(index, self.allocations)
        self.runners = Runners(index)

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
            market.load_allocation(alloc)
        market.compact()
        return market

    def load_allocation(self, alloc: Allocation) -> None:
        """Restore an active allocation (rebuilding a market from storage).

        Its bid and node must be loaded first. Unlike ``from_state``, this does not check the
        whole state at once: the caller vouches that it came from a consistent store.
        """
        self.allocations.load(alloc)

    def compact(self) -> None:
        """Re-sort every book (after a bulk rebuild; ticks compact as they go)."""
        self.index.compact_books(force=True)

    # ------------------------------------------------------------------ nodes

    def upsert_node(self, node: Node) -> None:
        """Register a node, or change its state or reserve price (model, region, size are fixed)."""
        ix = self.index
        row = ix.node_row.get(node.id)
        if row is None:
            if len(ix.n_id) >= MAX_NODES:
                raise ValueError(f"a market holds at most {MAX_NODES} nodes")
            ix.add_node_row(node)
            return
        pool = ix.pools[ix.n_pool[row]]
        if (
            ix.models[pool.model] != node.gpu_model
            or ix.model_capacity[pool.model] != node.capacity
            or ix.regions[pool.region] != node.region
            or ix.n_cap[row] != node.gpu_count
        ):
            raise ValueError(
                f"node {node.id}: gpu_model, region, gpu_count and capacity cannot change "
                "(register the host as a new node)"
            )
        ix.n_state[row] = node.state
        ix.n_reserve[row] = node.reserve_price
        ix.n_images[row] = frozenset(ix.intern_image(i) for i in node.images)
        served, ix.n_serves[row] = ix.n_serves[row], node.serves
        ix.n_reserve_np = None
        pool.live = None
        ix.suspect_nodes.add(row)
        ix.refresh_free(row, force=True)
        if node.serves != served:
            ix.remix(pool)  # (its jobs it no longer serves: _node_conditions, next tick)

    # ------------------------------------------------------------------ bids

    def add_bid(self, bid: Bid) -> None:
        """Add an open bid to the book (it waits until a tick places it)."""
        ix = self.index
        if bid.id in ix.bid_row:
            raise ValueError(f"bid.id {bid.id} is already in the book")
        if bid.region != ANY_REGION and not ix.known_region(bid.region):
            known = ix.regions if ix.config.regions is None else ix.config.regions
            raise ValueError(
                f"region {bid.region!r} is not a known region; known regions: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        leader = self.gangs.leader_for(bid)
        model = ix.intern_model(bid.gpu_model, bid.capacity)
        region = -1 if bid.region == ANY_REGION else ix.intern_region(bid.region)
        window = -1
        if bid.window is not None:
            window = ix.window_index.get(bid.window, -1)
            if window < 0:
                window = ix.window_index[bid.window] = len(ix.windows)
                ix.windows.append(bid.window)
        nodes, image = (bid.node_count, bid.least_nodes), bid.image is not None
        book = ix.book_for(model, region, bid.gpu_count, window, nodes[0], image, nodes[1])
        s = ix.b.reserve(1)
        row = s.start
        b = ix.b
        b.id[row], b.model[row], b.region[row], b.gpus[row] = bid.id, model, region, bid.gpu_count
        b.price[row], b.created[row], b.window[row] = bid.max_price, bid.created_at, window
        b.image[row] = ix.intern_image(bid.image)
        b.deadline[row] = math.nan if bid.deadline is None else bid.deadline
        b.tenant[row], b.status[row], b.epoch[row] = bid.tenant_id, WAITING, 0
        b.book[row] = book.index
        b.run[row] = b.res[row] = -1
        ix.bid_row[bid.id] = row
        if bid.node_count == 1:
            b.gang[row] = -1
        elif leader < 0:  # the gang's first member: the gang's entry in its book
            b.gang[row] = row
            ix.gangs[row] = [row]
        else:
            b.gang[row] = leader
            ix.gangs[leader].append(row)
            return
        book.insert((-bid.max_price, bid.created_at, bid.id), row, 0)

    def add_bid_arrays(
        self,
        *,
        gpu_model: str,
        region: str,
        ids: np.ndarray,
        gpu_counts: np.ndarray,
        max_prices: np.ndarray,
        created_at: np.ndarray,
        tenant_ids: np.ndarray | None = None,
        images: list[str | None] | None = None,
    ) -> None:
        """Bulk-load bids of one model and region (no window), validated as a whole.

        The fast path for loading a large book; each array holds one value per bid
        (``images``: each bid's image reference, or None).
        """
        ix = self.index
        gpu_model = DEFAULT_CATALOG.normalize(gpu_model)
        region = check_region("region", region, allow_any=True)
        if region != ANY_REGION and not ix.known_region(region):
            raise ValueError(f"region {region!r} is not a known region")
        for name, values in (("ids", ids), ("gpu_counts", gpu_counts), ("tenant_ids", tenant_ids)):
            if values is not None and not np.issubdtype(np.asarray(values).dtype, np.integer):
                raise ValueError(f"{name} must be integers, got {np.asarray(values).dtype}")
        ids = np.asarray(ids, np.int64)
        n = len(ids)
        gpus = np.asarray(gpu_counts, np.int64)
        prices = np.asarray(max_prices, np.float64)
        created = np.asarray(created_at, np.float64)
        tenants = np.zeros(n, np.int64) if tenant_ids is None else np.asarray(tenant_ids, np.int64)
        if images is not None and len(images) != n:
            raise ValueError(f"images has {len(images)} values, ids has {n}")
        if images is not None and not all(i is None or (isinstance(i, str) and i) for i in images):
            raise ValueError("images must be non-empty strings or None")
        for name, arr in (
            ("gpu_counts", gpus),
            ("max_prices", prices),
            ("created_at", created),
            ("tenant_ids", tenants),
        ):
            if len(arr) != n:
                raise ValueError(f"{name} has {len(arr)} values, ids has {n}")
        if n and (ids.min() < 0 or ids.max() >= MAX_ID):
            raise ValueError("bid ids must be integers in [0, 2**62)")
        if n and (tenants.min() < 0 or tenants.max() >= MAX_ID):
            raise ValueError("tenant_ids must be integers in [0, 2**62)")
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
        id_list = ids.tolist()
        if not ix.bid_row.keys().isdisjoint(id_list):
            raise ValueError("bid ids must be unique and not already in the book")
        before = len(ix.bid_row)
        ix.bid_row.update(zip(id_list, range(ix.b.n, ix.b.n + n), strict=True))
        if len(ix.bid_row) != before + n:  # duplicates within ids: undo, write nothing
            for i in id_list:
                ix.bid_row.pop(i, None)
            raise ValueError("bid ids must be unique and not already in the book")
        model = ix.intern_model(gpu_model)
        reg = -1 if region == ANY_REGION else ix.intern_region(region)
        s = ix.b.reserve(n)
        b = ix.b
        b.id[s], b.model[s], b.region[s], b.gpus[s] = ids, model, reg, gpus
        b.price[s], b.created[s], b.window[s], b.deadline[s] = prices, created, -1, math.nan
        b.image[s] = 0 if images is None else [ix.intern_image(i) for i in images]
        b.tenant[s], b.status[s], b.epoch[s] = tenants, WAITING, 0
        b.run[s] = b.res[s] = b.gang[s] = -1
        rows = np.arange(s.start, s.stop, dtype=np.int64)
        imaged = b.image[s] > 0
        sizes = np.flatnonzero(np.bincount(gpus, minlength=MAX_GPUS_PER_NODE + 1)).tolist()
        for size, image in ((size, image) for size in sizes for image in (False, True)):
            sel = rows[(gpus == size) & (imaged == image)]
            if len(sel) == 0:
                continue
            book = ix.book_for(model, reg, int(size), -1, 1, image)
            b.book[sel] = book.index
            merged = np.concatenate([book.live_rows(b.status, b.epoch, WAITING), sel])
            order = priority_order(b.price[merged], b.created[merged], b.id[merged])
            book.reset(merged[order], b.epoch[merged[order]])

    def reprice_bid(self, bid_id: int, max_price: float) -> None:
        """Change a bid's maximum price; it keeps its age (and its GPUs, if it runs). A running
        allocation is billed at the new maximum from the next tick on; lowered below its node's
        reserve (a release: the tick notices it), it pays that reserve until it ends."""
        ix = self.index
        price = check_price("max_price", max_price)
        for row in ix.members(ix.bid_row_of(bid_id)):  # a gang's members share it
            self._reprice_row(row, price)

    def _reprice_row(self, row: int, price: float) -> None:
        ix = self.index
        b = ix.b
        b.price[row] = price
        if b.status[row] == WAITING and b.gang[row] in (-1, row):
            b.epoch[row] += 1
            book = ix.books[b.book[row]]
            book.count -= 1
            book.insert((-price, float(b.created[row]), int(b.id[row])), row, int(b.epoch[row]))
        else:
            for arow in (b.run[row], b.res[row]):  # below a reserve now?
                if arow >= 0:
                    ix.suspect_nodes.add(int(ix.a.node[arow]))
            # a running allocation takes the new maximum at the next tick (pricing.py)

    def cancel_bid(self, bid_id: int, at: float) -> Settlement:
        """Close a bid: it leaves the book; its allocations end FINISHED (reservations RELEASED)."""
        ix = self.index
        at = check_time("at", at)
        members = ix.members(ix.bid_row_of(bid_id))
        out, ix.out = ix.out, TickOut()
        try:
            self._close_gang(members, EndReason.BID_CANCELLED, at)
            return self._settlement()
        finally:
            ix.out = out

    def end_allocation(
        self, allocation_id: int, status: AllocationStatus | str, at: float
    ) -> Settlement:
        """End an allocation from outside the tick.

        ``PREEMPTED``: a noticed job acked its final save (its bid waits again, or starts on its
        migration reservation). ``FINISHED``: the job completed; its bid closes.
        ``RELEASED``: a reservation given up.
        """
        ix = self.index
        at = check_time("at", at)
        status = AllocationStatus(status)
        if not status.is_terminal():
            raise ValueError(f"status must be a terminal status, got {status.value!r}")
        arow = ix.alloc_row_of(allocation_id)
        if arow is None or STATUSES[ix.a.status[arow]].is_terminal():
            raise KeyError(f"allocation {allocation_id} is not active")
        current = ix.a.status[arow]
        if (status is AllocationStatus.RELEASED) != (current == RESERVED):
            raise ValueError(
                f"allocation {allocation_id} is {STATUSES[current].value}: "
                f"it cannot end as {status.value}"
            )
        out, ix.out = ix.out, TickOut()
        try:
            self.allocations.end(
                arow,
                STATUSES.index(status),
                _ENDED_AS[status],
                max(at, float(ix.a.charged[arow])),
            )
            if status is AllocationStatus.FINISHED:  # the job is done: on every member
                self._close_gang(ix.members(int(ix.a.bid[arow])), EndReason.BID_FINISHED, at)
            return self._settlement()
        finally:
            ix.out = out

    def _close_gang(self, members: list[int], reason: EndReason, at: float) -> None:
        """End every allocation of a bid (of each member of its gang) and close it."""
        ix = self.index
        ix.gang_ending = True  # the gang ends whole: no cascades while its members end
        try:
            for row in members:
                for arow in ix.bid_alloc_rows(row):
                    status = RELEASED if ix.a.status[arow] == RESERVED else FINISHED
                    self.allocations.end(arow, status, reason, max(at, float(ix.a.charged[arow])))
            for row in members:
                ix.close_bid(row)
            if len(members) > 1:
                del ix.gangs[members[0]]
            ix.held.discard(members[0])
        finally:
            ix.gang_ending = False

    def _settlement(self) -> Settlement:
        out = self.index.out
        return Settlement(tuple(out.endings), self.pricing.final_charges(), tuple(out.fees))

    # ------------------------------------------------------------------ the tick

    def tick(self, now: float) -> Decision:
        """Clear every pool at time ``now`` and return what changed
        (docs/operators/architecture.md#design-3)."""
        ix = self.index
        now = check_time("now", now)
        if now < ix.now:
            raise ValueError(f"now must not go backwards: {now!r} < {ix.now!r}")
        ix.now = now
        ix.tick_number += 1
        ix.out = TickOut()
        ix.compact_books()
        for pool in ix.pools:
            pool.incumbents = None
        self.holds.due(now)
        self.allocations.node_conditions(now)
        self.allocations.deadlines_due(now)
        self.allocations.windows_closing(now)
        self.allocations.promote(now)
        for model in sorted(range(len(ix.models)), key=ix.models.__getitem__):
            self.clearing.clear_model(model, now)
        quotes, clearing = self.pricing.quotes(now)
        charges = Charges.concat(
            [self.pricing.final_charges(), self.pricing.charge_running(now, clearing)]
        )
        out = ix.out
        placements = out.placements()
        ix.out = TickOut()
        return Decision(
            now,
            placements,
            tuple(out.notices),
            tuple(out.endings),
            tuple(out.promotions),
            charges,
            quotes,
            tuple(out.fees),
        )

    # ------------------------------------------------------------------ views

    def snapshot(self) -> MarketState:
        """The market's current contents as frozen values (``from_state`` rebuilds it)."""
        ix = self.index
        b, a = ix.b, ix.a
        nodes = tuple(self.runners.node_value(r) for r in range(len(ix.n_id)))
        bids = [self.index.bid_value(row) for row in range(b.n) if b.status[row] != GONE]
        allocs = []
        for arow in range(a.n):
            status = STATUSES[a.status[arow]]
            if status.is_terminal():
                continue
            deadline = float(a.deadline[arow])
            reason = int(a.reason[arow])
            allocs.append(
                Allocation(
                    id=int(a.id[arow]),
                    bid_id=int(b.id[a.bid[arow]]),
                    node_id=ix.n_id[a.node[arow]],
                    gpu_count=int(a.gpus[arow]),
                    status=status,
                    started_at=float(a.started[arow]),
                    charged_until=float(a.charged[arow]),
                    price=float(a.price[arow]),
                    charge_carry=int(a.carry[arow]),
                    notice_fee_owed=int(a.fee_owed[arow]),
                    deadline=None if math.isnan(deadline) else deadline,
                    notice_reason=None if reason < 0 else REASONS[reason],
                    kind=(PlacementKind.MIGRATION if a.mig[arow] else PlacementKind.TAKEOVER)
                    if status is AllocationStatus.RESERVED
                    else PlacementKind.NEW,
                )
            )
        return MarketState(nodes, tuple(bids), tuple(allocs), ix.config, ix.next_alloc_id)

    def charge_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(allocation ids, price in force, charged until, charge carry)`` of every charged
        allocation."""
        a = self.index.a
        rows = np.flatnonzero((a.status[: a.n] == RUNNING) | (a.status[: a.n] == NOTICED))
        return a.id[rows].copy(), a.price[rows].copy(), a.charged[rows].copy(), a.carry[rows].copy()

    def price_in_force(self, alloc_id: int) -> float:
        """The price per GPU-hour an allocation pays from now on (0 while only reserved)."""
        ix = self.index
        return float(ix.a.price[ix.alloc_row_of(alloc_id)])

    def notice_fee_owed(self, alloc_id: int) -> int:
        """Micros of its notice fee an allocation still owes (``notice_fee.py``)."""
        return int(self.index.a.fee_owed[self.index.alloc_row_of(alloc_id)])

    def bid_tenant(self, bid_id: int) -> int:
        ix = self.index
        return int(ix.b.tenant[ix.bid_row_of(bid_id)])

    def has_bid(self, bid_id: int) -> bool:
        ix = self.index
        row = ix.bid_row.get(bid_id)
        return row is not None and ix.b.status[row] != GONE

    def bid_price(self, bid_id: int) -> float:
        ix = self.index
        return float(ix.b.price[ix.bid_row_of(bid_id)])

    def allocation_status(self, allocation_id: int) -> AllocationStatus | None:
        ix = self.index
        row = ix.alloc_row_of(allocation_id)
        return None if row is None else STATUSES[ix.a.status[row]]

    @property
    def now(self) -> float:
        return self.index.now

    def node_load(self, node_id: int) -> tuple[int, int, int, int]:
        """``(gpu_count, running, noticed, reserved)`` GPUs of a node."""
        ix = self.index
        r = ix.node_row[node_id]
        return ix.n_cap[r], ix.n_running[r], ix.n_noticed[r], ix.n_reserved[r]


def clear(state: MarketState, now: float) -> Decision:
    """Clear ``state`` at ``now``: the pure form of :meth:`Market.tick`."""
    return Market.from_state(state).tick(now)
