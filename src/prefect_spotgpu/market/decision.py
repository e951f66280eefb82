"""What one clearing tick decided: placements, notices, endings, charges and pool quotes.

Bulk parts (placements, charges) are columnar numpy tables, because a cold tick can place
hundreds of thousands of allocations; iterate them to get one small record per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from prefect_spotgpu.market.types import AllocationStatus, Capacity, EndReason, NoticeReason


class PlacementKind(StrEnum):
    """Why an allocation was created."""

    NEW = "new"
    """A waiting bid won free GPUs and starts now (status RUNNING)."""
    TAKEOVER = "takeover"
    """A challenger won GPUs that noticed incumbents will free (status RESERVED)."""
    MIGRATION = "migration"
    """Free GPUs reserved at once for a noticed bid, so it resumes without waiting (RESERVED)."""


_KINDS = tuple(PlacementKind)


@dataclass(frozen=True, slots=True)
class Placement:
    allocation_id: int
    bid_id: int
    node_id: int
    gpu_count: int
    kind: PlacementKind
    status: AllocationStatus
    expires_at: float | None


@dataclass(frozen=True, slots=True)
class Placements:
    """Allocations created by a tick, one row each, in the order they were decided."""

    allocation_id: np.ndarray
    bid_id: np.ndarray
    node_id: np.ndarray
    gpu_count: np.ndarray
    kind: np.ndarray  # index into PlacementKind
    expires_at: np.ndarray  # NaN for RUNNING

    def __len__(self) -> int:
        return len(self.allocation_id)

    def __iter__(self) -> Iterator[Placement]:
        for i in range(len(self)):
            kind = _KINDS[int(self.kind[i])]
            expires = float(self.expires_at[i])
            yield Placement(
                allocation_id=int(self.allocation_id[i]),
                bid_id=int(self.bid_id[i]),
                node_id=int(self.node_id[i]),
                gpu_count=int(self.gpu_count[i]),
                kind=kind,
                status=AllocationStatus.RUNNING
                if kind is PlacementKind.NEW
                else AllocationStatus.RESERVED,
                expires_at=None if np.isnan(expires) else expires,
            )

    def equals(self, other: Placements) -> bool:
        return all(
            np.array_equal(getattr(self, f), getattr(other, f), equal_nan=(f == "expires_at"))
            for f in ("allocation_id", "bid_id", "node_id", "gpu_count", "kind", "expires_at")
        )


@dataclass(frozen=True, slots=True)
class Notice:
    """An eviction notice: the allocation keeps running and paying until ``deadline``."""

    allocation_id: int
    bid_id: int
    node_id: int
    reason: NoticeReason
    deadline: float


@dataclass(frozen=True, slots=True)
class Ending:
    """An allocation that ended (or a reservation that was released) at ``at``."""

    allocation_id: int
    bid_id: int
    node_id: int
    status: AllocationStatus
    reason: EndReason
    at: float
    previous: AllocationStatus
    """The status it ended from."""


@dataclass(frozen=True, slots=True)
class NoticeFee:
    """What an allocation that ended still owed of the notice fee of the takeover it was
    (:mod:`prefect_spotgpu.market.notice_fee`): charged to its bid's tenant, on it."""

    allocation_id: int
    bid_id: int
    tenant_id: int
    amount: int
    """In micros."""


@dataclass(frozen=True, slots=True)
class Charge:
    allocation_id: int
    bid_id: int
    tenant_id: int
    gpu_count: int
    price: float
    seconds: float
    amount: int
    """In micros (:mod:`prefect_spotgpu.market.money`)."""


@dataclass(frozen=True, slots=True)
class Charges:
    """Per-second billing since each allocation's last charge: ``price * gpus * seconds / 3600``
    in whole micros (``amount``, int64), what was below one micro carried into the next charge;
    ``seconds`` are whole milliseconds."""

    allocation_id: np.ndarray
    bid_id: np.ndarray
    tenant_id: np.ndarray
    gpu_count: np.ndarray
    price: np.ndarray
    seconds: np.ndarray
    amount: np.ndarray

    @classmethod
    def empty(cls) -> Charges:
        ints, floats = np.zeros(0, np.int64), np.zeros(0, np.float64)
        return cls(ints, ints, ints, ints, floats, floats, ints)

    @classmethod
    def concat(cls, parts: list[Charges]) -> Charges:
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__slots__))

    def __len__(self) -> int:
        return len(self.allocation_id)

    def total(self) -> int:
        """Micros charged in all."""
        return int(self.amount.sum())

    def __iter__(self) -> Iterator[Charge]:
        for i in range(len(self)):
            yield Charge(
                int(self.allocation_id[i]),
                int(self.bid_id[i]),
                int(self.tenant_id[i]),
                int(self.gpu_count[i]),
                float(self.price[i]),
                float(self.seconds[i]),
                int(self.amount[i]),
            )

    def equals(self, other: Charges) -> bool:
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in self.__slots__)


@dataclass(frozen=True, slots=True)
class PoolQuote:
    """The state of one pool after a tick.

    ``clearing_price`` is what running allocations pay per GPU-hour: the highest losing eligible
    bid, never below the pool's lowest reserve (a node with a higher reserve charges its reserve;
    nobody pays above their own maximum). ``None`` when the pool has no live node.
    """

    gpu_model: str
    region: str
    capacity: Capacity
    clearing_price: float | None
    reserve_price: float | None
    highest_losing_bid: float | None
    gpus_total: int
    gpus_free: int
    gpus_running: int
    waiting_bids: int
    kind_prices: tuple[float, float] | None = None
    """In a mixed pool (``types.Runner``): the clearing prices of bids without an image and of
    bids with one, each set by the losers of its own kind; None in a uniform pool."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """What an external change (cancel, ack, job end) ended and charged."""

    endings: tuple[Ending, ...]
    charges: Charges
    fees: tuple[NoticeFee, ...] = ()
    """Notice fees the endings left owing (``notice_fee.py``), besides the charges."""


@dataclass(frozen=True, slots=True)
class Decision:
    now: float
    placements: Placements
    notices: tuple[Notice, ...] = ()
    endings: tuple[Ending, ...] = ()
    promotions: tuple[int, ...] = ()
    """Reserved allocations that start now (RESERVED -> RUNNING)."""
    charges: Charges = field(default_factory=Charges.empty)
    quotes: tuple[PoolQuote, ...] = ()
    fees: tuple[NoticeFee, ...] = ()
    """Notice fees the endings left owing (``notice_fee.py``), besides the charges."""

    def quote(self, gpu_model: str, region: str, capacity: Capacity = Capacity.SPOT) -> PoolQuote:
        for q in self.quotes:
            if q.gpu_model == gpu_model and q.region == region and q.capacity == capacity:
                return q
        raise KeyError(f"no {capacity.value} pool {gpu_model}/{region}")

    def equals(self, other: Decision) -> bool:
        """Field-by-field equality (numpy tables compared element-wise)."""
        return (
            self.now == other.now
            and self.placements.equals(other.placements)
            and self.notices == other.notices
            and self.endings == other.endings
            and self.promotions == other.promotions
            and self.charges.equals(other.charges)
            and self.quotes == other.quotes
            and self.fees == other.fees
        )
