"""The welfare-optimal allocation of a small market, by exhaustive search.

Welfare is what the winners said the GPUs are worth to them: the sum of ``max_price * gpu_count``
over the bids placed. The clearing rule is greedy (priority order, best fit) because it must be
fast, truthful and stable; this exact reference measures what that costs. It is exponential in
the worst case: keep instances small (the tests and ``benchmarks/clearing.py`` use at most 12
bids and 4 nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from prefect_spotgpu.market.types import ANY_REGION, Bid, Node


def optimal_welfare(nodes: Sequence[Node], bids: Sequence[Bid]) -> float:
    """The largest welfare any feasible placement of ``bids`` on ``nodes`` reaches.

    A bid may go to a live node of its model and capacity, in its region (or any, for
    ``"any"``), whose reserve it meets and that has room for all its GPUs.
    """
    live = [n for n in nodes if n.state.offers_capacity()]
    if len(bids) > 16 or len(live) > 6:
        raise ValueError("optimal_welfare is exhaustive: use at most 16 bids and 6 nodes")
    options = [
        tuple(
            j
            for j, n in enumerate(live)
            if n.gpu_model == b.gpu_model
            and n.capacity == b.capacity
            and b.region in (ANY_REGION, n.region)
            and n.reserve_price <= b.max_price
            and n.gpu_count >= b.gpu_count
        )
        for b in bids
    ]
    values = [b.max_price * b.gpu_count for b in bids]
    sizes = [b.gpu_count for b in bids]
    # most valuable first: better bounds earlier
    order = sorted(range(len(bids)), key=lambda i: -values[i])
    suffix = [0.0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + values[order[k]]

    @cache
    def best(k: int, free: tuple[int, ...]) -> float:
        if k == len(order):
            return 0.0
        i = order[k]
        result = best(k + 1, free)
        if result >= suffix[k]:
            return result
        for j in options[i]:
            if free[j] >= sizes[i]:
                rest = list(free)
                rest[j] -= sizes[i]
                result = max(result, values[i] + best(k + 1, tuple(rest)))
        return result

    return best(0, tuple(n.gpu_count for n in live))


def welfare(bids_by_id: dict[int, Bid], placed_bid_ids) -> float:
    """Welfare of a set of placed bids."""
    return sum(bids_by_id[i].max_price * bids_by_id[i].gpu_count for i in placed_bid_ids)
