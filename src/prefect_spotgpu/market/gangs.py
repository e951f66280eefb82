"""Gangs: one job on ``node_count`` nodes, placed, noticed and resumed as one
(docs/operators/architecture.md#design-3).

A part of ``Market``. A gang is ``node_count`` member bids (ranks 0..n-1, by bid id) that share
every term; each member holds ``gpu_count`` GPUs on its own node, all in one pool. The rules:

- **All or nothing.** The gang's first member stands for it in its book; when it comes up, the
  gang takes ``node_count`` distinct nodes of one pool or none. With free fits for all, every
  member runs at once; when some members need GPUs that noticed allocations will free (a claim
  or an eviction, by the same price and hysteresis rule as any bid), every member is reserved
  instead, and the gang starts when every reservation can (``Allocations.promote``).
- **One notice.** A notice to any member is a notice to every running member, with the same
  reason and deadline. After a reclaim, an outbid or a raised reserve, the market reserves a
  replacement (free GPUs on a node the gang does not use, in the same pool) for the noticed
  member and each other member's own GPUs, so the gang resumes on its surviving nodes plus the
  replacement -- or, with no replacement, reserves nothing and waits whole.
- **Never partial.** A running member that ends without notice (its node was lost) ends every
  member (``GANG_MEMBER_ENDED``); a released reservation releases every member's
  (``GANG_RESERVATION_RELEASED``). A member with no allocation left is parked (ACTIVE, not in
  the book) until the whole gang has none; then the gang waits again.
- **Smaller, when it says it may** (``Bid.min_node_count``, the book's ``least``). Where the
  whole gang finds neither free fits nor takeovers, it runs on the free fits of the first pool
  with at least ``least``; where a notice finds too few replacements, it resumes on its
  survivors and those there are, if at least ``least``. Either way it holds its *first* ranks
  (rank 0 runs the flow; the rest are parked), it starts only once no member runs, and it
  grows back at its next notice, when replacements are free. Its flow reshards its checkpoint
  (``checkpoint.DistributedCheckpointer``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from prefect_spotgpu.market.book import ROW_MASK
from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.incumbents import bid_terms, incumbents, victims_on
from prefect_spotgpu.market.serving import SERVES_GANGS
from prefect_spotgpu.market.tables import (
    GONE,
    MIGRATING_REASONS,
    NOTICED,
    PREEMPTED,
    RELEASED,
    RESERVED,
    RUNNING,
    WAITING,
    Pool,
)
from prefect_spotgpu.market.types import (
    ANY_REGION,
    Bid,
    EndReason,
    NodeState,
    NoticeReason,
    gang_terms,
)

if TYPE_CHECKING:
    from prefect_spotgpu.market.allocations import Allocations
    from prefect_spotgpu.market.index import MarketIndex


class Gangs:
    """The gang rules of a market, on its index; places, notices and ends members through
    its ``Allocations``."""

    def __init__(self, index: MarketIndex, allocations: Allocations) -> None:
        self.index = index
        self.allocations = allocations

    def terms_of(self, first: int) -> tuple:
        """``types.gang_terms`` of a waiting gang's first member, read from its row (what a
        member added later must share)."""
        ix = self.index
        b = ix.b
        window, deadline, model = int(b.window[first]), float(b.deadline[first]), b.model[first]
        return (
            ix.models[model],
            int(b.gpus[first]),
            float(b.price[first]),
            ANY_REGION if b.region[first] < 0 else ix.regions[b.region[first]],
            float(b.created[first]),
            None if window < 0 else ix.windows[window],
            None if math.isnan(deadline) else deadline,
            int(b.tenant[first]),
            ix.model_capacity[model],
            ix.images[b.image[first]] or None,
            ix.books[b.book[first]].nodes,
            ix.books[b.book[first]].least,
        )

    def leader_for(self, bid: Bid) -> int:
        """The row of the first member of the gang a new bid joins (-1: it joins none, or it is
        the first); ``ValueError`` when the gang cannot take it."""
        ix = self.index
        if bid.gang_id is None or bid.gang_id == bid.id:
            return -1
        leader = ix.bid_row.get(bid.gang_id, -1)
        if leader < 0 or ix.b.status[leader] == GONE:
            raise ValueError(
                f"gang_id {bid.gang_id} of bid {bid.id}: add the gang's first member first"
            )
        if len(ix.gangs[leader]) >= bid.node_count:
            raise ValueError(f"gang {bid.gang_id} already has its {bid.node_count} members")
        if ix.b.status[leader] != WAITING:
            raise ValueError(f"gang {bid.gang_id} is already placed: it takes no members")
        if self.terms_of(leader) != gang_terms(bid):
            raise ValueError(f"bid {bid.id} must share every term of gang {bid.gang_id}")
        return leader

    def _distinct_fits(
        self, pool: Pool, size: int, price: float, image: int, count: int, exclude: set[int]
    ) -> list[int]:
        """Up to ``count`` node rows of a pool, each with a free fit, none twice and none in
        ``exclude`` (the gang's nodes so far), tightest first."""
        ix = self.index
        exclude = exclude | without_gangs(ix, pool)
        if not image and ix.policy.name == "best-fit":  # (the same, in one pass)
            capacity = ix.capacity_for(pool, image)
            keys = capacity.best_fits(size, price, ix.n_free, ix.n_reserve, count, exclude)
            return [key & ROW_MASK for key in keys]
        taken = set(exclude)
        rows = []
        while len(rows) < count:
            found = ix.fit(pool, size, price, image, taken)
            if found is None:
                break
            row = found[-1] & ROW_MASK
            rows.append(row)
            taken.add(row)
        return rows

    def place(self, first: int, now: float) -> bool:
        """Place a waiting gang whole (True), or leave it waiting and change nothing."""
        ix = self.index
        members = ix.gangs[first]
        b = ix.b
        count, least = ix.books[b.book[first]].nodes, ix.books[b.book[first]].least
        if len(members) < count:
            return False  # not all its members are in the book yet
        size, price, pools = bid_terms(ix, first)
        image = int(b.image[first])
        partial = []
        for p in pools:
            if p is None:
                continue
            pool = ix.pools[p]
            rows = self._distinct_fits(pool, size, price, image, count, set())
            if len(rows) == count:
                for member, nrow in zip(members, rows, strict=True):
                    self.allocations.place(member, nrow, PlacementKind.NEW, now)
                return True
            partial.append((pool, rows))
        for pool, rows in partial:  # free fits for some members, takeovers for the rest
            takeovers = self._takeovers(pool, count - len(rows), size, price, set(rows), image)
            if takeovers is None:
                continue
            deadline = now + ix.config.notice_seconds
            expires = deadline + ix.config.reservation_grace_seconds
            # reserve every member first, so a victim's migration cannot take these GPUs
            for member, nrow in zip(members, rows, strict=False):
                self.allocations.place(member, nrow, PlacementKind.MIGRATION, now, expires)
            reserved = [
                self.allocations.place(member, nrow, PlacementKind.TAKEOVER, now, expires)
                for member, (nrow, _) in zip(members[len(rows) :], takeovers, strict=True)
            ]
            for takeover, (_, victims) in zip(reserved, takeovers, strict=True):
                self.allocations.outbid(takeover, victims, deadline, now)  # (and its fee)
            return True
        for _, rows in partial:  # a gang that may go on smaller: the first ranks on the fits
            if len(rows) >= least:
                for member, nrow in zip(members, rows, strict=False):
                    self.allocations.place(member, nrow, PlacementKind.NEW, now)
                return True
        return False

    def _takeovers(
        self, pool, count: int, size: int, price: float, taken: set[int], image: int = 0
    ) -> list[tuple[int, list[int]]] | None:
        """``count`` nodes of a pool, none in ``taken``, where a gang member can reserve GPUs
        that noticed allocations will free (no victims) or that weaker incumbents it beats
        by the hysteresis margin hold (their rows); None when there are not enough."""
        ix = self.index
        cap, running, reserved, state = ix.n_cap, ix.n_running, ix.n_reserved, ix.n_state
        claimable = [  # noticed GPUs nobody has claimed yet, lowest node id first
            nrow
            for nrow in pool.claimable  # (noticed nodes with room)
            if cap[nrow] - running[nrow] - reserved[nrow] >= size
            and ix.n_reserve[nrow] <= price
            and nrow not in taken
            and state[nrow] is NodeState.LIVE
            and serves_member(ix, nrow, image)
        ]
        claimable.sort(key=ix.n_id.__getitem__)
        found: list[tuple[int, list[int]]] = [(nrow, []) for nrow in claimable[:count]]
        if len(found) == count:
            return found
        taken = taken | set(claimable)
        a = ix.a
        rows, eff = incumbents(ix, pool)
        limit = int(np.searchsorted(eff, price, side="left"))  # those it beats: eff < price
        start = pool.scan_from  # (those before it run no more)
        while start < limit and a.status[rows[start]] != RUNNING:
            start += 1
        pool.scan_from = start
        examined, step = 0, 32
        while start < limit:  # weakest first, a slice at a time (nothing changes meanwhile)
            part = rows[start : min(limit, start + step)]
            statuses, nodes = a.status[part].tolist(), a.node[part].tolist()
            for status, nrow in zip(statuses, nodes, strict=True):
                if status != RUNNING or nrow in taken:
                    continue
                taken.add(nrow)
                examined += 1
                if examined > ix.config.eviction_scan_limit:
                    return None
                victims = victims_on(ix, nrow, size, price, image)
                if victims is not None and serves_member(ix, nrow, image):
                    found.append((nrow, victims))
                    if len(found) == count:
                        return found
            start += step
            step *= 2
        return None

    def notice(self, arow: int, reason: NoticeReason, deadline: float, now: float) -> None:
        """Notice every running member of a gang; reserve where it resumes (module doc)."""
        ix = self.index
        a, b = ix.a, ix.b
        noticed = int(a.bid[arow])
        members = ix.members(noticed)
        for member in members:
            run = int(b.run[member])
            if run >= 0 and a.status[run] == RUNNING:
                self.allocations.notice_one(run, reason, deadline)
        if reason not in MIGRATING_REASONS or any(b.res[m] >= 0 for m in members):
            return
        least = ix.books[b.book[noticed]].least
        runs = {m: int(b.run[m]) for m in members if b.run[m] >= 0}
        if len(runs) < least:
            return
        pool = ix.pools[int(a.pool[arow])]
        size, price = int(b.gpus[noticed]), float(b.price[noticed])
        kept: dict[int, int] = {}  # member -> its own node, kept for the resume
        moved: list[int] = []  # members that need a node
        for member in members:
            run = runs.get(member, -1)
            if member != noticed and run >= 0 and self._can_keep(int(a.node[run]), member):
                kept[member] = int(a.node[run])
            elif member == noticed or run < 0 or least < len(members):
                moved.append(member)  # (a parked member of a smaller gang: it may grow back)
            else:
                return  # a survivor of a gang that runs whole cannot keep its GPUs: it waits
        used = {int(a.node[r]) for r in runs.values()}
        fits = self._distinct_fits(pool, size, price, int(b.image[noticed]), len(moved), used)
        if len(kept) + len(fits) < least:
            return  # no replacement: the gang waits whole once every member has stopped
        # the gang resumes on its survivors' own GPUs (a takeover of them) and replacements (a
        # migration): whole, each survivor keeps its node; smaller, its first ranks take them,
        # so that a gang gone smaller always holds its first ranks (rank 0 runs the flow)
        kinds = dict.fromkeys(kept.values(), PlacementKind.TAKEOVER)
        kinds.update(dict.fromkeys(fits, PlacementKind.MIGRATION))
        if len(kinds) == len(members):
            plan = kept | dict(zip(moved, fits, strict=True))
        else:
            plan = dict(zip(members, kinds, strict=False))
        expires = deadline + ix.config.reservation_grace_seconds
        for member in members:  # in rank order
            if member in plan:
                nrow = plan[member]
                self.allocations.place(member, nrow, kinds[nrow], now, expires)

    def _can_keep(self, nrow: int, member: int) -> bool:
        """Whether a running member's node can hold a reservation of its GPUs for the resume."""
        ix, b = self.index, self.index.b
        room = ix.n_cap[nrow] - ix.n_running[nrow] - ix.n_reserved[nrow]
        return (
            room >= int(b.gpus[member])
            and ix.n_state[nrow].offers_capacity()
            and ix.n_reserve[nrow] <= float(b.price[member])
            and serves_member(ix, nrow, int(b.image[member]))
        )

    def cascade(self, brow: int, old: int, status: int, at: float) -> None:
        """After a member's allocation ended: end the rest of the gang where a gang would
        otherwise run or be reserved partially."""
        ix = self.index
        a, b = ix.a, ix.b
        if old == RUNNING and status == PREEMPTED:  # lost without notice: the gang is down
            for member in ix.members(brow):
                for r in (int(b.run[member]), int(b.res[member])):
                    if r < 0:
                        continue
                    if a.status[r] == RESERVED:
                        self.allocations.end(r, RELEASED, EndReason.GANG_RESERVATION_RELEASED, at)
                    elif a.status[r] in (RUNNING, NOTICED):
                        ended = max(at, float(a.charged[r]))
                        self.allocations.end(r, PREEMPTED, EndReason.GANG_MEMBER_ENDED, ended)
        elif old == RESERVED and status == RELEASED:  # reserved whole or not at all
            for member in ix.members(brow):
                r = int(b.res[member])
                if r >= 0:
                    self.allocations.end(r, RELEASED, EndReason.GANG_RESERVATION_RELEASED, at)


def serves_member(ix: MarketIndex, nrow: int, image: int) -> bool:
    """Whether node row ``nrow`` runs a gang member with image id ``image``: it serves the bid,
    and its jobs reach other hosts (``serving.SERVES_GANGS``)."""
    return ix.serves(nrow, image) and bool(ix.n_serves[nrow] & SERVES_GANGS)


def without_gangs(ix: MarketIndex, pool: Pool) -> set[int]:
    """The node rows of a pool that run no gang member (none outside a mixed pool), kept
    with the pool's live nodes until one of its nodes changes."""
    live = ix.live(pool)  # (a new list whenever a node of the pool changed)
    if pool.no_gangs_of is not live:
        serves = ix.n_serves
        pool.no_gangs = (
            {r for r in pool.nodes if not serves[r] & SERVES_GANGS} if pool.mixed else set()
        )
        pool.no_gangs_of = live
    return pool.no_gangs
