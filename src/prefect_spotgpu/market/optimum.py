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
from itertools import combinations

from prefect_spotgpu.market.types import ANY_REGION, Bid, Node


def optimal_welfare(nodes: Sequence[Node], bids: Sequence[Bid]) -> float:
    """The largest welfare any feasible placement of ``bids`` on ``nodes`` reaches.

    A bid may go to a live node of its model and capacity, in its region (or any, for
    ``"any"``), whose reserve it meets and that has room for all its GPUs. A gang (the member
    bids of one ``gang_id``) is placed whole, each member on its own node, all in one region,
    or not at all.
    """
    live = [n for n in nodes if n.state.offers_capacity()]
    if len(bids) > 16 or len(live) > 6:
        raise ValueError("optimal_welfare is exhaustive: use at most 16 bids and 6 nodes")
    items: dict[int, list[Bid]] = {}
    for b in bids:
        items.setdefault(b.id if b.gang_id is None else b.gang_id, []).append(b)
    groups = list(items.values())
    options = [
        tuple(
            j
            for j, n in enumerate(live)
            if n.gpu_model == g[0].gpu_model
            and n.capacity == g[0].capacity
            and g[0].region in (ANY_REGION, n.region)
            and n.reserve_price <= g[0].max_price
            and n.gpu_count >= g[0].gpu_count
        )
        for g in groups
    ]
    values = [sum(b.max_price * b.gpu_count for b in g) for g in groups]
    sizes = [g[0].gpu_count for g in groups]
    counts = [len(g) for g in groups]
    # most valuable first: better bounds earlier
    order = sorted(range(len(groups)), key=lambda i: -values[i])
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
        fits = [j for j in options[i] if free[j] >= sizes[i]]
        for chosen in combinations(fits, counts[i]):
            if len({live[j].region for j in chosen}) > 1:
                continue  # a gang lives in one region
            rest = list(free)
            for j in chosen:
                rest[j] -= sizes[i]
            result = max(result, values[i] + best(k + 1, tuple(rest)))
        return result

    return best(0, tuple(n.gpu_count for n in live))


def welfare(bids_by_id: dict[int, Bid], placed_bid_ids) -> float:
    """Welfare of a set of placed bids."""
    return sum(bids_by_id[i].max_price * bids_by_id[i].gpu_count for i in placed_bid_ids)
