"""Plain containers the engine keeps its state in: growable numpy columns, pools, tick output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prefect_spotgpu.market.book import PoolCapacity
from prefect_spotgpu.market.checks import MAX_GPUS_PER_NODE
from prefect_spotgpu.market.decision import Ending, Notice, NoticeFee, PlacementKind, Placements
from prefect_spotgpu.market.types import AllocationStatus, NoticeReason

# Bid row status.
GONE, WAITING, ACTIVE = 0, 1, 2
# Allocation row status codes, in AllocationStatus order.
STATUSES = tuple(AllocationStatus)
RESERVED, RUNNING, NOTICED, PREEMPTED, FINISHED, RELEASED = range(6)
REASONS = tuple(NoticeReason)
KIND_CODES = {k: i for i, k in enumerate(PlacementKind)}
MIGRATING_REASONS = frozenset(
    {NoticeReason.RECLAIMED, NoticeReason.OUTBID, NoticeReason.BELOW_RESERVE}
)
"""Notices after which the market reserves where the job resumes (not a closing window)."""


class Columns:
    """Growable numpy columns (rows are appended, never moved)."""

    def __init__(self, **dtypes: object) -> None:
        self.n = 0
        self._cap = 16
        self._dtypes = dtypes
        for name, dtype in dtypes.items():
            setattr(self, name, np.zeros(self._cap, dtype))

    def reserve(self, extra: int) -> slice:
        need = self.n + extra
        if need > self._cap:
            self._cap = max(need, self._cap * 2)
            for name, dtype in self._dtypes.items():
                old = getattr(self, name)
                new = np.zeros(self._cap, dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        s = slice(self.n, need)
        self.n = need
        return s


@dataclass(slots=True)
class Pool:
    index: int
    model: int
    region: int
    nodes: list[int] = field(default_factory=list)  # node rows, kept sorted by node id
    capacity: PoolCapacity = field(default_factory=PoolCapacity)
    image_capacity: dict[int, PoolCapacity] = field(default_factory=dict)  # image -> its holders
    mixed: bool = False  # a node of the pool serves not every bid (types.Runner): fits then
    # come from kind_capacity[need] (the nodes that serve what the bid needs)
    kind_capacity: dict[int, PoolCapacity] = field(default_factory=dict)  # SERVES_* -> nodes
    incumbents: np.ndarray | None = None  # alloc rows RUNNING at tick start, weakest first
    incumbent_eff: np.ndarray | None = None
    scan_from: int = 0  # incumbents before this index are no longer running
    noticed_nodes: set[int] = field(default_factory=set)  # nodes with noticed GPUs
    claimable: set[int] = field(default_factory=set)  # of those, nodes with unclaimed GPUs
    # (cap > running + reserved), kept by MarketIndex.refresh_free
    evict_failed_size: int = MAX_GPUS_PER_NODE + 1
    busy: int = 0  # GPUs running, noticed or reserved on its nodes
    free: int = 0  # sum of free GPUs of its live nodes
    live: list[int] | None = None  # live node rows (None: recompute)
    max_cap: int = 0
    total: int = 0
    min_reserve: float | None = None
    serves: int = 0  # what its live nodes serve, together (SERVES_* bits; with ``live``)
    no_gangs: set[int] = field(default_factory=set)  # rows that run no gang member, known
    no_gangs_of: list[int] | None = None  # for this ``live`` (gangs.without_gangs)


@dataclass(slots=True)
class TickOut:
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
    fees: list[NoticeFee] = field(default_factory=list)
    final_charges: list[tuple[int, int, int, int, float, int, int]] = field(default_factory=list)
    chunks: list[tuple[np.ndarray, ...]] = field(default_factory=list)

    def add_chunk(self, *columns: np.ndarray) -> None:
        """Append placements decided in bulk, after those decided one by one so far."""
        self.flush()
        self.chunks.append(columns)

    def flush(self) -> None:
        if self.p_alloc:
            self.chunks.append(
                (
                    np.asarray(self.p_alloc, np.int64),
                    np.asarray(self.p_bid, np.int64),
                    np.asarray(self.p_node, np.int64),
                    np.asarray(self.p_gpus, np.int64),
                    np.asarray(self.p_kind, np.int8),
                    np.asarray(self.p_expires, np.float64),
                )
            )
            for column in (
                self.p_alloc,
                self.p_bid,
                self.p_node,
                self.p_gpus,
                self.p_kind,
                self.p_expires,
            ):
                column.clear()

    def placements(self) -> Placements:
        self.flush()
        if not self.chunks:
            return Placements(
                *(
                    np.zeros(0, t)
                    for t in (np.int64, np.int64, np.int64, np.int64, np.int8, np.float64)
                )
            )
        return Placements(*(np.concatenate(c) for c in zip(*self.chunks, strict=False)))
