"""Who a bid may take GPUs from: its terms, a pool's incumbents, the victims on a node.

Reads of the market's index (:class:`~prefect_spotgpu.market.index.MarketIndex`), shared by
the clearing loop (``clearing.py``) and the gang rules (``gangs.py``); they change nothing but
a pool's cached incumbent order (``Pool.incumbents``, reset by every allocation change).
"""

from __future__ import annotations

import numpy as np

from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.tables import RUNNING, Pool


def bid_terms(ix: MarketIndex, brow: int) -> tuple[int, float, list[int | None]]:
    """A bid's GPU count, maximum price, and the pools it may use (its region's, or every
    pool of its model for an any-region bid)."""
    b = ix.b
    model, region = int(b.model[brow]), int(b.region[brow])
    pools = ix.model_pools[model] if region < 0 else [ix.pool_index.get((model, region))]
    return int(b.gpus[brow]), float(b.price[brow]), pools


def incumbents(ix: MarketIndex, pool: Pool) -> tuple[np.ndarray, np.ndarray]:
    """Running allocations of the pool from before this tick, weakest first."""
    if pool.incumbents is None:
        a = ix.a
        n = a.n
        rows = np.flatnonzero((a.pool[:n] == pool.index) & (a.status[:n] == RUNNING))
        eff = ix.b.price[a.bid[rows]] * (1.0 + ix.config.hysteresis)
        order = np.lexsort((-a.id[rows], eff))
        pool.incumbents, pool.incumbent_eff = rows[order], eff[order]
        pool.scan_from = 0
    return pool.incumbents, pool.incumbent_eff


def victims_on(
    ix: MarketIndex, nrow: int, size: int, price: float, image: int = 0
) -> list[int] | None:
    """The weakest running allocations of a node that a bid at ``price`` (with image id
    ``image``) beats by more than the hysteresis margin and whose GPUs give it ``size``, or
    None (also where the node does not serve the bid)."""
    a, b = ix.a, ix.b
    if not ix.n_state[nrow].offers_capacity() or ix.n_reserve[nrow] > price:
        return None
    if not ix.serves(nrow, image):
        return None
    room = ix.n_cap[nrow] - ix.n_running[nrow] - ix.n_reserved[nrow]
    if room + ix.n_running[nrow] < size:
        return None
    if room >= size:
        return []  # (no victim needed)
    h = 1.0 + ix.config.hysteresis
    victims = []  # (price, -id, row, GPUs): the weakest first, then the newest
    for r in ix.node_alloc_rows(nrow):
        if a.status[r] == RUNNING and a.tick[r] != ix.tick_number:
            beaten = float(b.price[a.bid[r]])
            if beaten * h < price:
                victims.append((beaten, -int(a.id[r]), r, int(a.gpus[r])))
    victims.sort()
    chosen = []
    for _, _, r, gpus in victims:
        if room >= size:
            break
        chosen.append(r)
        room += gpus
    return chosen if room >= size else None
