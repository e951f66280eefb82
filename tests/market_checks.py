"""Independent checks of the market's invariants (docs/operators/architecture.md#design-3),
computed from plain data.

These re-derive every rule from a ``MarketState`` snapshot and a ``Decision`` without using the
engine's internal indexes, so a bug in those indexes cannot hide itself.
"""

from __future__ import annotations

from collections import defaultdict

from prefect_spotgpu.market import (
    ANY_REGION,
    AllocationStatus,
    Decision,
    MarketState,
    NodeState,
)
from prefect_spotgpu.market.serving import SERVES_GANGS, needs_mask

RUNNING, NOTICED, RESERVED = (
    AllocationStatus.RUNNING,
    AllocationStatus.NOTICED,
    AllocationStatus.RESERVED,
)


def bid_fits_pool(bid, node, served: bool = True) -> bool:
    """Whether the bid may run on the node: its pool, and (``served``) a runner that serves
    it."""
    return (
        bid.gpu_model == node.gpu_model
        and bid.capacity == node.capacity
        and bid.region in (ANY_REGION, node.region)
        and (not served or bool(node.serves & needs_mask(bid.image)))
        and (not served or bid.node_count == 1 or bool(node.serves & SERVES_GANGS))
    )


def window_allows_start(bid, now: float, notice_seconds: float) -> bool:
    w = bid.window
    return w is None or (w.start <= now and w.end - now > notice_seconds)


def check_capacity(state: MarketState) -> None:
    """No GPU held twice: in use and promised GPUs of each node fit the node."""
    in_use: dict[int, int] = defaultdict(int)
    promised: dict[int, int] = defaultdict(int)
    for a in state.allocations:
        if a.status in (RUNNING, NOTICED):
            in_use[a.node_id] += a.gpu_count
        if a.status in (RUNNING, RESERVED):
            promised[a.node_id] += a.gpu_count
    for node in state.nodes:
        assert in_use[node.id] <= node.gpu_count, f"node {node.id} over-committed now"
        assert promised[node.id] <= node.gpu_count, f"node {node.id} over-promised"


def check_allocations(state: MarketState) -> None:
    bids = {b.id: b for b in state.bids}
    nodes = {n.id: n for n in state.nodes}
    per_bid: dict[int, list] = defaultdict(list)
    for a in state.allocations:
        bid, node = bids[a.bid_id], nodes[a.node_id]
        per_bid[a.bid_id].append(a)
        # a noticed job may sit on a node whose runner changed under it: its notice says so
        served = a.status is not NOTICED
        assert bid_fits_pool(bid, node, served), f"allocation {a.id} outside its bid's pool"
        assert a.gpu_count == bid.gpu_count
        if a.status is RUNNING:
            assert node.state in (NodeState.LIVE, NodeState.DRAINING), (
                f"allocation {a.id} runs on a {node.state} node without notice"
            )
            assert bid.max_price >= node.reserve_price, (
                f"bid {bid.id} at {bid.max_price} runs below reserve {node.reserve_price}"
            )
        if a.status is RUNNING:
            assert a.price <= bid.max_price + 1e-12, f"allocation {a.id} pays above its max"
            if a.price > 0:
                assert a.price >= node.reserve_price - 1e-12, f"{a.id} pays below reserve"
        if a.status is NOTICED:  # a release (its maximum under the reserve) pays the reserve
            top = max(bid.max_price, node.reserve_price)
            assert a.price <= top + 1e-12, f"noticed allocation {a.id} pays above {top}"
    for bid_id, allocs in per_bid.items():
        assert sum(a.status in (RUNNING, NOTICED) for a in allocs) <= 1, bid_id
        assert sum(a.status is RESERVED for a in allocs) <= 1, bid_id


def node_load(state: MarketState) -> tuple[dict, dict, dict]:
    """GPUs per node: busy (running, and migration reservations: they sit on free GPUs),
    noticed, and held by takeover reservations (on GPUs noticed allocations free)."""
    busy, noticed, takeovers = defaultdict(int), defaultdict(int), defaultdict(int)
    for a in state.allocations:
        if a.status is RUNNING or (a.status is RESERVED and a.kind == "migration"):
            busy[a.node_id] += a.gpu_count
        elif a.status is NOTICED:
            noticed[a.node_id] += a.gpu_count
        else:
            takeovers[a.node_id] += a.gpu_count
    return busy, noticed, takeovers


def waiting_bids(state: MarketState) -> list:
    """One-node bids with no allocation (gangs have checks of their own)."""
    active = {a.bid_id for a in state.allocations}
    return [b for b in state.bids if b.id not in active and b.node_count == 1]


def gangs(state: MarketState) -> dict[int, list]:
    """Gang id -> its member bids (ranks in id order)."""
    found: dict[int, list] = defaultdict(list)
    for bid in sorted(state.bids, key=lambda b: b.id):
        if bid.gang_id is not None:
            found[bid.gang_id].append(bid)
    return found


def check_gangs(state: MarketState, now: float) -> None:
    """A gang never runs or is reserved on fewer nodes than its ``least_nodes`` (all of them,
    unless it may go on smaller); its members are on distinct nodes of one pool; a gang with
    every member waiting never waits while free GPUs could hold it (at its fewest)."""
    nodes = {n.id: n for n in state.nodes}
    by_bid: dict[int, list] = defaultdict(list)
    for a in state.allocations:
        by_bid[a.bid_id].append(a)
    busy, noticed, takeovers = node_load(state)
    for gang_id, members in gangs(state).items():
        n, least = members[0].node_count, members[0].least_nodes
        for status in (RUNNING, RESERVED):
            held = [a for m in members for a in by_bid[m.id] if a.status is status]
            assert not held or least <= len(held) <= n, (
                f"gang {gang_id}: {len(held)} of {n} members {status} (at least {least})"
            )
            if held:
                assert len(members) == n, f"gang {gang_id} incomplete"
                first_ranks = {m.id for m in members[: len(held)]}
                assert {a.bid_id for a in held} == first_ranks, f"gang {gang_id}: not its first"
                assert len({a.node_id for a in held}) == len(held), f"gang {gang_id} shares a node"
                pools = {(nodes[a.node_id].gpu_model, nodes[a.node_id].region) for a in held}
                assert len(pools) == 1, f"gang {gang_id} spans pools {pools}"
                unfit = [a.node_id for a in held if not nodes[a.node_id].serves & SERVES_GANGS]
                assert not unfit, f"gang {gang_id} on nodes {unfit}, which run no gang member"
        holding = [a for m in members for a in by_bid[m.id] if a.status.holds_gpus()]
        assert len({a.node_id for a in holding}) == len(holding), f"gang {gang_id} doubles"
        first = members[0]
        if len(members) < n or any(by_bid[m.id] for m in members):
            continue
        if not window_allows_start(first, now, state.config.notice_seconds):
            continue
        fits = defaultdict(int)
        for node in state.nodes:
            free = node.gpu_count - busy[node.id] - max(noticed[node.id], takeovers[node.id])
            if (
                node.state is NodeState.LIVE
                and bid_fits_pool(first, node)
                and node.reserve_price <= first.max_price
                and free >= first.gpu_count
            ):
                fits[node.region] += 1
        assert max(fits.values(), default=0) < least, f"gang {gang_id} waits beside free {fits}"


def check_outbid_rule(state: MarketState, now: float) -> None:
    """A waiting bid that beats a running one by more than the hysteresis margin, and would
    fit on its node once it left, is never left waiting."""
    cfg = state.config
    nodes = {n.id: n for n in state.nodes}
    bids = {b.id: b for b in state.bids}
    running = defaultdict(int)
    reserved = defaultdict(int)
    for a in state.allocations:
        if a.status is RUNNING:
            running[a.node_id] += a.gpu_count
        elif a.status is RESERVED:
            reserved[a.node_id] += a.gpu_count
    for c in waiting_bids(state):
        if not window_allows_start(c, now, cfg.notice_seconds):
            continue
        for a in state.allocations:
            if a.status is not RUNNING:
                continue
            node = nodes[a.node_id]
            inc = bids[a.bid_id]
            if node.state is not NodeState.LIVE or not bid_fits_pool(c, node):
                continue
            if node.reserve_price > c.max_price:
                continue
            room = node.gpu_count - running[node.id] - reserved[node.id] + a.gpu_count
            if c.max_price > inc.max_price * (1 + cfg.hysteresis) and c.gpu_count <= room:
                raise AssertionError(
                    f"bid {c.id} at {c.max_price} waits while bid {inc.id} at "
                    f"{inc.max_price} runs on node {node.id} where it would fit"
                )


def check_free_fit_used(state: MarketState, now: float) -> None:
    """A waiting bid never waits while free GPUs it could use sit idle."""
    cfg = state.config
    busy, noticed, reserved = node_load(state)
    for c in waiting_bids(state):
        if not window_allows_start(c, now, cfg.notice_seconds):
            continue
        for node in state.nodes:
            if node.state is not NodeState.LIVE or not bid_fits_pool(c, node):
                continue
            free = node.gpu_count - busy[node.id] - max(noticed[node.id], reserved[node.id])
            if node.reserve_price <= c.max_price and free >= c.gpu_count:
                raise AssertionError(f"bid {c.id} waits though node {node.id} has {free} free")


def expected_prices(
    state: MarketState, decision: Decision, before: dict[int, float] | None = None
) -> dict[int, float]:
    """The price each charged allocation should be paying from now on (per GPU-hour); a
    noticed one keeps ``before``'s (the price in force at its notice), lowered only by its
    maximum, and never below its node's reserve by a release (engine.py's rule)."""
    before = before or {}
    nodes = {n.id: n for n in state.nodes}
    bids = {b.id: b for b in state.bids}
    quotes = {(q.gpu_model, q.region, q.capacity): q for q in decision.quotes}
    prices = {}
    for a in state.allocations:
        if not a.status.is_charged():
            continue
        node = nodes[a.node_id]
        quote = quotes[(node.gpu_model, node.region, node.capacity)]
        pool_price = quote.clearing_price if quote.clearing_price is not None else 0.0
        if quote.kind_prices is not None:  # a mixed pool: each kind by its own losers
            pool_price = quote.kind_prices[bids[a.bid_id].image is not None]
        bid_max = bids[a.bid_id].max_price
        price = min(max(pool_price, node.reserve_price), bid_max)
        if a.status is AllocationStatus.NOTICED:
            price = min(before.get(a.id) or price, max(bid_max, node.reserve_price))
        prices[a.id] = price
    return prices
