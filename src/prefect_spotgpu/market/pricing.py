"""Pool quotes (the uniform clearing price) and per-second charges (a part of ``Market``).

Reads the state declared in :mod:`prefect_spotgpu.market.index`; writes only the allocations'
price in force, charged-until time, carry and notice fee still owed (each charge counts towards
it), and the tick's final charges.
"""

from __future__ import annotations

import math

import numpy as np

from prefect_spotgpu.market.decision import (
    Charges,
    PoolQuote,
)
from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.money import charge, elapsed_ms
from prefect_spotgpu.market.money import charges as owed
from prefect_spotgpu.market.serving import SERVES_IMAGES, SERVES_PROCESS, needs_mask
from prefect_spotgpu.market.tables import NOTICED, RUNNING, WAITING


class Pricing:
    """The prices and charges of a market, on its index."""

    def __init__(self, index: MarketIndex) -> None:
        self.index = index

    # ------------------------------------------------------------------ prices and charges

    def quotes(self, now: float) -> tuple[tuple[PoolQuote, ...], np.ndarray]:
        """Every pool's quote, and the clearing prices as an array ``[pool, need]`` (need: a
        bid's ``SERVES_*`` bit). In a uniform pool both needs pay the one clearing price; in a
        mixed pool (``types.Runner``) each kind of bid is priced by the losers of its own kind:
        a bid that waits for a Docker node does not raise what process jobs pay."""
        ix = self.index
        b, a = ix.b, ix.a
        n_pools = len(ix.pools)
        losing = np.full((n_pools, SERVES_IMAGES + 1), -math.inf)  # [pool, need]
        waiting = np.zeros(n_pools, np.int64)
        for pool in ix.pools:
            ix.live(pool)
        max_cap = [pool.max_cap for pool in ix.pools]
        serves = [pool.serves for pool in ix.pools]
        peek_args = (b.status, b.epoch, b.price, b.created, b.id, WAITING)
        for book in ix.books:
            if book.count <= 0 or not ix.window_open(book.window, now):
                continue
            head = book.peek(*peek_args)
            pools = (
                ix.model_pools[book.model]
                if book.region < 0
                else [ix.pool_index.get((book.model, book.region))]
            )
            need = needs_mask(book.image)
            for p in pools:
                if p is None or max_cap[p] < book.size or not serves[p] & need:
                    continue  # (no node of the pool could run it: it prices nothing there)
                waiting[p] += book.count
                if head is not None:
                    losing[p, need] = max(losing[p, need], -head[0][0])
        for arow in ix.noticed_outbid:
            if a.status[arow] != NOTICED:
                continue
            brow = int(a.bid[arow])
            if b.res[brow] >= 0:
                continue
            if ix.window_open(int(b.window[brow]), now):
                p, need = int(a.pool[arow]), needs_mask(b.image[brow])
                losing[p, need] = max(losing[p, need], float(b.price[brow]))
        n = a.n
        busy = np.flatnonzero((a.status[:n] == RUNNING) | (a.status[:n] == NOTICED))
        running = np.bincount(a.pool[busy], weights=a.gpus[busy], minlength=n_pools)
        clearing = np.full((n_pools, SERVES_IMAGES + 1), np.nan)
        quotes = []
        for pool in sorted(
            ix.pools,
            key=lambda q: (
                ix.models[q.model],
                ix.regions[q.region],
                ix.model_capacity[q.model],
            ),
        ):
            reserve = pool.min_reserve
            top = float(losing[pool.index].max())
            lose = top if top > -math.inf else None
            price = kind_prices = None
            if reserve is not None:
                price = max(reserve, lose) if lose is not None else reserve
                clearing[pool.index] = price
                if pool.mixed:  # each kind by its own losers
                    kind_prices = tuple(
                        max(reserve, float(losing[pool.index, need]))
                        for need in (SERVES_PROCESS, SERVES_IMAGES)
                    )
                    clearing[pool.index, SERVES_PROCESS] = kind_prices[0]
                    clearing[pool.index, SERVES_IMAGES] = kind_prices[1]
            quotes.append(
                PoolQuote(
                    gpu_model=ix.models[pool.model],
                    region=ix.regions[pool.region],
                    capacity=ix.model_capacity[pool.model],
                    clearing_price=price,
                    reserve_price=reserve,
                    highest_losing_bid=lose,
                    gpus_total=pool.total,
                    gpus_free=pool.free,
                    gpus_running=int(running[pool.index]),
                    waiting_bids=int(waiting[pool.index]),
                    kind_prices=kind_prices,
                )
            )
        return tuple(quotes), clearing

    def charge_running(self, now: float, clearing: np.ndarray) -> Charges:
        ix = self.index
        a, b = ix.a, ix.b
        n = a.n
        status = a.status[:n]
        rows = np.flatnonzero((status == RUNNING) | (status == NOTICED))
        if len(rows) == 0:
            return Charges.empty()
        ms = elapsed_ms(a.charged[rows], now)
        brows = a.bid[rows]
        billed = np.flatnonzero(ms > 0)
        billed = billed[np.argsort(a.id[rows[billed]], kind="stable")]  # by allocation id
        charged, c_brows = rows[billed], brows[billed]
        c_price, c_ms = a.price[charged], ms[billed]
        c_gpus = a.gpus[charged].astype(np.int64)
        c_seconds = c_ms / 1000
        amount, a.carry[charged] = owed(c_price, c_gpus, c_ms, a.carry[charged])
        fee = a.fee_owed[charged]
        if fee.any():  # what it pays counts towards its notice fee (notice_fee.py)
            a.fee_owed[charged] = np.maximum(0, fee - amount)
        charges = Charges(
            a.id[charged],
            b.id[c_brows],
            b.tenant[c_brows],
            c_gpus,
            c_price,
            c_seconds,
            amount,
        )
        # the price in force from now on: the pool's, at least the node's reserve (the reserve
        # alone where the pool has no price), at most the bid's maximum (engine.py's rule)
        if ix.n_reserve_np is None:
            ix.n_reserve_np = np.asarray(ix.n_reserve, np.float64)
        node_reserve = ix.n_reserve_np[a.node[rows]]
        bid_max = b.price[brows]
        need = np.where(b.image[brows] > 0, SERVES_IMAGES, SERVES_PROCESS)
        price = np.minimum(np.fmax(clearing[a.pool[rows], need], node_reserve), bid_max)
        # a noticed one keeps the price in force at its notice, lowered only by its maximum and
        # never below the reserve by its own release (a maximum lowered under the reserve)
        before = np.where(a.price[rows] > 0, a.price[rows], price)
        held = np.minimum(before, np.fmax(bid_max, node_reserve))
        a.price[rows] = np.where(status[rows] == NOTICED, held, price)
        a.charged[charged] += c_seconds  # whole milliseconds billed: the rest bills next
        return charges

    def final_charge(self, arow: int, at: float) -> None:
        """The last charge of an allocation that ends at ``at``: up to ``at``, and whatever
        carry is left rounds up to one micro (an ended allocation owes nothing later)."""
        ix = self.index
        a = ix.a
        ms = int(elapsed_ms(float(a.charged[arow]), at))
        carry = int(a.carry[arow])
        if ms > 0 or carry > 0:
            brow = int(a.bid[arow])
            price, gpus = float(a.price[arow]), int(a.gpus[arow])
            if a.fee_owed[arow] > 0:  # counts towards its notice fee, as final_charges bills it
                amount, left = charge(price=price, gpus=gpus, milliseconds=ms, carry=carry)
                a.fee_owed[arow] = max(0, int(a.fee_owed[arow]) - amount - (left > 0))
            ix.out.final_charges.append(
                (
                    int(a.id[arow]),
                    int(ix.b.id[brow]),
                    int(ix.b.tenant[brow]),
                    gpus,
                    price,
                    ms,
                    carry,
                )
            )
        a.carry[arow] = 0
        a.charged[arow] = max(at, float(a.charged[arow]))

    def final_charges(self) -> Charges:
        rows = self.index.out.final_charges
        if not rows:
            return Charges.empty()
        ids, bids, tenants, gpus, price, ms, carry = (
            np.asarray(c) for c in zip(*rows, strict=False)
        )
        price = price.astype(np.float64)
        ms = ms.astype(np.int64)
        amount, left = owed(price, gpus.astype(np.int64), ms, carry.astype(np.int64))
        return Charges(
            ids.astype(np.int64),
            bids.astype(np.int64),
            tenants.astype(np.int64),
            gpus.astype(np.int64),
            price,
            ms / 1000,
            amount + (left > 0),
        )
