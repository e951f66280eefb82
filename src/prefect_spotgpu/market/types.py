"""The market's data: nodes, bids, allocations and their statuses — frozen values, validated.

Times are UNIX seconds (floats) passed in by the caller; nothing here reads a clock. Prices are
per GPU-hour in one currency unit. Constructors reject bad input with a ``ValueError`` that names
the field and the value, so the service can turn it into a 4xx without guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from prefect_spotgpu.market.checks import (
    ANY_REGION,
    check_gpu_count,
    check_id,
    check_images,
    check_min_node_count,
    check_node_count,
    check_price,
    check_region,
    check_time,
)
from prefect_spotgpu.market.gpus import DEFAULT_CATALOG
from prefect_spotgpu.market.money import MS_PER_HOUR
from prefect_spotgpu.market.serving import Runner, check_runner, serves_mask


class Capacity(StrEnum):
    """Which market a node sells into and a bid buys from.

    The two never mix: a spot bid is never placed on an on-demand node, nor an on-demand bid
    on a spot node, and an ``"any"``-region bid stays within its own kind.
    """

    SPOT = "spot"
    """Idle GPUs, auctioned every tick; a holder can be outbid or reclaimed with a notice."""
    ON_DEMAND = "on_demand"
    """Non-preemptible GPUs at the model's on-demand price: the service sets every such bid's
    maximum and every such node's reserve to that price, so the clearing price is that price
    and no bid can outbid another (the hysteresis margin is never exceeded). A node can still
    be reclaimed by its owner, with a notice."""


class NodeState(StrEnum):
    """Where a node stands as a seller of GPUs."""

    LIVE = "live"
    """Heartbeating and offering its GPUs."""
    DRAINING = "draining"
    """Keeps the work it has, takes no new work (owner maintenance, agent upgrade)."""
    RECLAIMED = "reclaimed"
    """The owner takes it back: every allocation on it gets a notice, then it leaves the pool."""
    LOST = "lost"
    """Heartbeats stopped: its allocations end as preempted at once, with no notice."""

    def offers_capacity(self) -> bool:
        """Whether new allocations may be placed on a node in this state."""
        return self is NodeState.LIVE


class AllocationStatus(StrEnum):
    """The life of an allocation: GPUs on one node held for one bid.

    ``RESERVED -> RUNNING -> NOTICED -> PREEMPTED`` is the reclaim path; ``FINISHED`` ends a job
    that completed or was cancelled, ``RELEASED`` a reservation that was never used.
    """

    RESERVED = "reserved"
    """GPUs promised to the bid (a migration target, or GPUs a noticed allocation will free);
    the job has not started and nothing is charged."""
    RUNNING = "running"
    """The job runs and pays the pool's clearing price every second."""
    NOTICED = "noticed"
    """Evicted with a deadline; still runs and pays until it acks its final save or the
    deadline passes."""
    PREEMPTED = "preempted"
    """Terminal: ended by eviction (after the notice, or at once when the node was lost)."""
    FINISHED = "finished"
    """Terminal: the job completed or the bid was cancelled."""
    RELEASED = "released"
    """Terminal: a reservation that expired or was given up before it ran."""

    def is_terminal(self) -> bool:
        return self in _TERMINAL

    def holds_gpus(self) -> bool:
        """Whether GPUs are physically in use by this allocation now."""
        return self in (AllocationStatus.RUNNING, AllocationStatus.NOTICED)

    def is_charged(self) -> bool:
        return self in (AllocationStatus.RUNNING, AllocationStatus.NOTICED)

    @classmethod
    def active_statuses(cls) -> frozenset[AllocationStatus]:
        """Statuses that hold or promise GPUs on a node."""
        return frozenset(s for s in cls if not s.is_terminal())


_TERMINAL = frozenset(
    {AllocationStatus.PREEMPTED, AllocationStatus.FINISHED, AllocationStatus.RELEASED}
)


class NoticeReason(StrEnum):
    """Why an allocation got a notice."""

    OUTBID = "outbid"
    """A challenger bid more than the hysteresis margin above it, and fits once it leaves."""
    RECLAIMED = "reclaimed"
    """The owner took the node back."""
    WINDOW_CLOSING = "window_closing"
    """The bid's eligibility window (e.g. the cheap night window) closes by the deadline."""
    BELOW_RESERVE = "below_reserve"
    """The node's reserve is now above the bid's maximum price (the owner raised the reserve,
    or the user lowered the bid)."""
    OUT_OF_CREDIT = "out_of_credit"
    """The tenant's balance covers no more than this notice (``market/credit.py``): the bid is
    held, the job saves and stops, and the bid leaves the market."""


class EndReason(StrEnum):
    """Why an allocation ended: its ``end_reason`` and the ``reason`` of its ending event.

    The market writes the first group; the service names the end of a job its agent reported
    (the second group). The worker reads them (``prefect_spotgpu.protocol`` re-exports this)."""

    NODE_LOST = "node lost"
    NODE_DRAINING = "node draining"
    NODE_RECLAIMED = "node reclaimed"
    BELOW_RESERVE = "below reserve"
    NOTICE_DEADLINE_PASSED = "notice deadline passed"
    RESERVATION_EXPIRED = "reservation expired"
    BID_CANCELLED = "bid cancelled"
    BID_FINISHED = "bid finished"
    BID_HELD = "bid held: out of credit"
    ENDED_PREEMPTED = "ended: preempted"
    ENDED_FINISHED = "ended: finished"
    ENDED_RELEASED = "ended: released"

    SAVED_AND_STOPPED = "final save acknowledged"
    """After a final save: the agent stopped the job before reporting it."""
    JOB_FINISHED = "job finished"
    JOB_FAILED = "job failed on the node"
    """The job exited non-zero: the run's own end, not a preemption."""

    GANG_MEMBER_ENDED = "gang member ended"
    """Another member of the gang stopped without notice (its node was lost): a gang never
    runs partially, so every member ends."""
    GANG_RESERVATION_RELEASED = "gang reservation released"
    """Another member's reservation was released: a gang is reserved whole or not at all."""


def check_capacity(value: object) -> Capacity:
    try:
        return Capacity(value)
    except ValueError:
        raise ValueError(
            f"capacity must be one of {', '.join(c.value for c in Capacity)}, got {value!r}"
        ) from None


@dataclass(frozen=True, slots=True, order=True)
class Interval:
    """An eligibility window ``[start, end)`` in UNIX seconds.

    The service turns recurring windows (the cheap night window) into the interval that is open
    now or opens next, so the market itself needs no calendar.
    """

    start: float
    end: float

    def __post_init__(self) -> None:
        check_time("window.start", self.start)
        check_time("window.end", self.end)
        if not self.end > self.start:
            raise ValueError(
                f"window.end must be after window.start, got {self.start!r}..{self.end!r}"
            )

    def is_open(self, now: float) -> bool:
        return self.start <= now < self.end


@dataclass(frozen=True, slots=True)
class Node:
    """A GPU host offering ``gpu_count`` GPUs of one model in one region at a reserve price."""

    id: int
    gpu_model: str
    region: str
    gpu_count: int
    reserve_price: float
    state: NodeState = NodeState.LIVE
    capacity: Capacity = Capacity.SPOT
    images: frozenset[str] = frozenset()
    """The image references the node holds locally: among equal fits, a bid lands on a node
    that has its image (no pull)."""
    runner: Runner | None = None
    """How it runs jobs (None: not said, any bid): a bid lands only where it can run."""
    default_image: bool = False
    """A Docker node runs bids without an image in an image its operator named."""
    job_network: bool = False
    """A Docker node's containers are on a job network that other hosts route to: it runs
    gang members (``serving.SERVES_GANGS``)."""

    def __post_init__(self) -> None:
        check_id("node.id", self.id)
        object.__setattr__(self, "images", check_images(self.images))
        runner = check_runner(self.runner, self.default_image, self.job_network)
        object.__setattr__(self, "runner", runner)
        object.__setattr__(self, "capacity", check_capacity(self.capacity))
        object.__setattr__(self, "gpu_model", DEFAULT_CATALOG.normalize(self.gpu_model))
        object.__setattr__(self, "region", check_region("region", self.region, allow_any=False))
        check_gpu_count("gpu_count", self.gpu_count)
        object.__setattr__(self, "reserve_price", check_price("reserve_price", self.reserve_price))
        object.__setattr__(self, "state", NodeState(self.state))

    @property
    def pool(self) -> tuple[str, str, Capacity]:
        return (self.gpu_model, self.region, self.capacity)

    @property
    def serves(self) -> int:
        """What it serves (:func:`serves_mask`)."""
        return serves_mask(self.runner, self.default_image, self.job_network)


@dataclass(frozen=True, slots=True)
class Bid:
    """Demand for ``gpu_count`` GPUs on one node, at most ``max_price`` per GPU-hour.

    ``region`` is a region name or ``"any"``. ``created_at`` orders bids of equal price (older
    first). ``window``, when set, limits when the bid may run; ``deadline`` is carried for the
    deadline-aware policies and does not change clearing.
    """

    id: int
    gpu_model: str
    gpu_count: int
    max_price: float
    region: str = ANY_REGION
    created_at: float = 0.0
    window: Interval | None = None
    deadline: float | None = None
    tenant_id: int = 0
    capacity: Capacity = Capacity.SPOT
    image: str | None = None
    """The job's image reference (None: none): placement prefers a node that holds it."""
    node_count: int = 1
    """How many nodes the job spans: a gang of ``node_count`` member bids, each for
    ``gpu_count`` GPUs on its own node of one region, placed all or nothing."""
    gang_id: int | None = None
    """A gang member's gang: the id of its first member (rank 0), which is the lowest id
    of the gang; None for a one-node bid."""
    min_node_count: int | None = None
    """A gang that may go on smaller: the fewest members it runs on when no replacement is
    free (its flow reshards its checkpoint); None: all ``node_count``, always."""

    def __post_init__(self) -> None:
        check_id("bid.id", self.id)
        check_node_count(self.node_count)
        check_min_node_count(self.min_node_count, self.node_count)
        if self.node_count == 1 and self.gang_id is not None:
            raise ValueError(f"gang_id needs node_count above 1, got gang_id {self.gang_id!r}")
        if self.node_count > 1:
            check_id("gang_id", self.gang_id)
            if self.gang_id > self.id:
                raise ValueError(
                    f"gang_id must be the id of the gang's first member (at most the bid's "
                    f"id {self.id}), got {self.gang_id!r}"
                )
        if self.image is not None and not (isinstance(self.image, str) and self.image):
            raise ValueError(f"image must be a non-empty string or None, got {self.image!r}")
        object.__setattr__(self, "capacity", check_capacity(self.capacity))
        object.__setattr__(self, "gpu_model", DEFAULT_CATALOG.normalize(self.gpu_model))
        check_gpu_count("gpu_count", self.gpu_count)
        object.__setattr__(self, "max_price", check_price("max_price", self.max_price))
        object.__setattr__(self, "region", check_region("region", self.region, allow_any=True))
        check_time("created_at", self.created_at)
        if self.window is not None and not isinstance(self.window, Interval):
            raise ValueError(f"window must be an Interval or None, got {self.window!r}")
        if self.deadline is not None:
            check_time("deadline", self.deadline)
        check_id("tenant_id", self.tenant_id)

    @property
    def least_nodes(self) -> int:
        """The fewest nodes the gang runs on: ``min_node_count``, or all of them."""
        return self.node_count if self.min_node_count is None else self.min_node_count


@dataclass(frozen=True, slots=True)
class Allocation:
    """GPUs of one node held (or promised) for one bid.

    ``price`` is the price per GPU-hour in force since ``charged_until``: the next charge bills
    ``price * gpu_count * (t - charged_until) / 3600`` in whole micros, plus ``charge_carry``
    (what was below one micro, see :mod:`prefect_spotgpu.market.money`). ``deadline`` is the
    notice deadline of a ``NOTICED`` allocation and the expiry of a ``RESERVED`` one.
    """

    id: int
    bid_id: int
    node_id: int
    gpu_count: int
    status: AllocationStatus
    started_at: float
    charged_until: float
    price: float = 0.0
    deadline: float | None = None
    notice_reason: NoticeReason | None = None
    kind: str = "new"
    """How placed: ``new``, ``takeover`` (on GPUs a notice frees) or ``migration`` (free GPUs)."""
    charge_carry: int = 0
    """Micro-milliseconds per hour owed below one micro: the next charge adds it."""
    notice_fee_owed: int = 0
    """Micros of its takeover's notice fee its charges have not covered (``notice_fee.py``)."""

    def __post_init__(self) -> None:
        check_id("allocation.id", self.id)
        if self.kind not in ("new", "takeover", "migration"):
            raise ValueError(f"kind must be new, takeover or migration, got {self.kind!r}")
        check_id("bid_id", self.bid_id)
        check_id("node_id", self.node_id)
        check_gpu_count("gpu_count", self.gpu_count)
        object.__setattr__(self, "status", AllocationStatus(self.status))
        check_time("started_at", self.started_at)
        check_time("charged_until", self.charged_until)
        if not (isinstance(fee := self.notice_fee_owed, int) and fee >= 0):
            raise ValueError(f"notice_fee_owed must be whole micros >= 0, got {fee!r}")
        if not 0 <= self.charge_carry < MS_PER_HOUR:
            raise ValueError(f"charge_carry must be in [0, {MS_PER_HOUR}), got {self.charge_carry}")
        if self.status.is_terminal():
            raise ValueError(f"an allocation in the market must be active, got {self.status!r}")
        if self.status in (AllocationStatus.NOTICED, AllocationStatus.RESERVED):
            if self.deadline is None:
                raise ValueError(f"a {self.status.value} allocation needs a deadline")
            check_time("deadline", self.deadline)
        if self.notice_reason is not None:
            object.__setattr__(self, "notice_reason", NoticeReason(self.notice_reason))


@dataclass(frozen=True, slots=True)
class MarketConfig:
    """Tunables of the clearing rule (docs/operators/architecture.md#design-3)."""

    hysteresis: float = 0.05
    """A challenger must bid more than ``(1 + hysteresis)`` times an incumbent to evict it."""
    notice_seconds: float = 300.0
    """Time from notice to forced stop."""
    reservation_grace_seconds: float = 60.0
    """How long past the related notice deadline a reservation waits before it is released."""
    packing: str = "best-fit"
    """Name of the packing policy (see ``prefect_spotgpu.market.policies``)."""
    eviction_scan_limit: int = 512
    """How many distinct nodes (those of the pool's weakest running incumbents, weakest first)
    one challenger examines for an eviction. The outbid guarantee holds within this bound; a
    pool with more nodes of weaker incumbents than this may leave a challenger waiting a tick
    longer."""
    regions: frozenset[str] | None = None
    """Regions bids may name; ``None`` accepts the regions of the registered nodes."""
    open_regions: bool = False
    """Accept any well-formed region, even one no node offers yet (the service: a bid may
    arrive before the first node of its region)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.hysteresis) and 0 <= self.hysteresis < 10):
            raise ValueError(f"hysteresis must be in [0, 10), got {self.hysteresis!r}")
        if not (math.isfinite(self.notice_seconds) and self.notice_seconds > 0):
            raise ValueError(f"notice_seconds must be positive, got {self.notice_seconds!r}")
        if not (
            math.isfinite(self.reservation_grace_seconds) and self.reservation_grace_seconds >= 0
        ):
            raise ValueError(
                f"reservation_grace_seconds must be >= 0, got {self.reservation_grace_seconds!r}"
            )
        if self.eviction_scan_limit < 1:
            raise ValueError(f"eviction_scan_limit must be >= 1, got {self.eviction_scan_limit!r}")
        from prefect_spotgpu.market.policies import get_packing_policy

        get_packing_policy(self.packing)
        if self.regions is not None:
            object.__setattr__(
                self,
                "regions",
                frozenset(check_region("regions", r, allow_any=False) for r in self.regions),
            )


@dataclass(frozen=True, slots=True)
class MarketState:
    """Everything ``clear`` needs: the nodes, the open bids, the active allocations."""

    nodes: tuple[Node, ...] = ()
    bids: tuple[Bid, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    config: MarketConfig = field(default_factory=MarketConfig)
    next_allocation_id: int = 1
    """The id the next new allocation gets (ids are never reused)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "bids", "allocations"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_unique("node", [n.id for n in self.nodes])
        _check_unique("bid", [b.id for b in self.bids])
        _check_unique("allocation", [a.id for a in self.allocations])
        regions = self.config.regions
        if regions is None:
            regions = frozenset(n.region for n in self.nodes)
        for bid in () if self.config.open_regions else self.bids:
            if bid.region != ANY_REGION and bid.region not in regions:
                raise ValueError(
                    f"region {bid.region!r} of bid {bid.id} is not a known region; "
                    f"known regions: {', '.join(sorted(regions)) or 'none'}"
                )
        nodes = {n.id: n for n in self.nodes}
        bids = {b.id: b for b in self.bids}
        _check_gangs(bids)
        in_use: dict[int, int] = {}
        promised: dict[int, int] = {}
        holding: dict[tuple[int, bool], int] = {}
        for alloc in self.allocations:
            node, bid = nodes.get(alloc.node_id), bids.get(alloc.bid_id)
            if node is None:
                raise ValueError(f"allocation {alloc.id} names unknown node_id {alloc.node_id}")
            if bid is None:
                raise ValueError(f"allocation {alloc.id} names unknown bid_id {alloc.bid_id}")
            if (
                alloc.gpu_count != bid.gpu_count
                or node.gpu_model != bid.gpu_model
                or node.capacity != bid.capacity
                or (bid.region != ANY_REGION and bid.region != node.region)
            ):
                raise ValueError(
                    f"allocation {alloc.id} does not fit bid {bid.id} on node {node.id}"
                )
            reserved = alloc.status is AllocationStatus.RESERVED
            key = (bid.id, reserved)
            if key in holding:
                raise ValueError(
                    f"bid {bid.id} has two {'reserved' if reserved else 'active'} allocations"
                )
            holding[key] = alloc.id
            if alloc.status.holds_gpus():
                in_use[node.id] = in_use.get(node.id, 0) + alloc.gpu_count
            if alloc.status in (AllocationStatus.RUNNING, AllocationStatus.RESERVED):
                promised[node.id] = promised.get(node.id, 0) + alloc.gpu_count
            if max(in_use.get(node.id, 0), promised.get(node.id, 0)) > node.gpu_count:
                raise ValueError(f"node {node.id} has more GPUs allocated than it has")
        highest = max((a.id for a in self.allocations), default=0)
        if self.next_allocation_id <= highest:
            raise ValueError(
                f"next_allocation_id must exceed every allocation id ({highest}), "
                f"got {self.next_allocation_id}"
            )


def gang_terms(bid: Bid) -> tuple:
    """What every member of a gang shares."""
    return (
        bid.gpu_model,
        bid.gpu_count,
        bid.max_price,
        bid.region,
        bid.created_at,
        bid.window,
        bid.deadline,
        bid.tenant_id,
        bid.capacity,
        bid.image,
        bid.node_count,
        bid.least_nodes,
    )


def _check_gangs(bids: dict[int, Bid]) -> None:
    gangs: dict[int, list[Bid]] = {}
    for bid in bids.values():
        if bid.gang_id is not None:
            gangs.setdefault(bid.gang_id, []).append(bid)
    for gang_id, members in gangs.items():
        leader = bids.get(gang_id)
        if leader is None or leader.gang_id != gang_id:
            raise ValueError(f"gang {gang_id} has no first member (bid {gang_id})")
        if len(members) > leader.node_count:
            raise ValueError(f"gang {gang_id} has more than node_count members")
        if any(gang_terms(m) != gang_terms(leader) for m in members):
            raise ValueError(f"the members of gang {gang_id} must share every term")


def _check_unique(kind: str, ids: list[int]) -> None:
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"duplicate {kind} id {i}")
        seen.add(i)
