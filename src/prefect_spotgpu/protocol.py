"""The wire vocabulary shared by the market service, the node agent, the worker and the job.

Every string one process writes and another reads is named here once, so a typo fails at
import time instead of end to end: the bid statuses, the kinds of a bid's events, the outcomes
an agent reports, why an allocation ended, the labels on flow runs and bids, and the
``SPOTGPU_*`` variables a job gets. Pure: nothing but the standard library and ``market``'s
own enums (``AllocationStatus``, ``NoticeReason``, ``EndReason``), which it re-exports.

    >>> EventKind("preempted") is EventKind.PREEMPTED
    True
    >>> EventKind.PREEMPTED in ENDING_EVENTS, EventKind.NOTICED in ENDING_EVENTS
    (True, False)
    >>> f"{LABELS.BID}={7}"
    'spotgpu.bid=7'
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.types import (
    AllocationStatus,
    Capacity,
    EndReason,
    MarketConfig,
    NodeState,
    NoticeReason,
    Runner,
)

__all__ = [
    "ACK_WAKE_SUFFIX",
    "DASK_CLUSTER_LABEL",
    "DASK_ENV",
    "DASK_UNREACHABLE_EXIT",
    "ENDING_EVENTS",
    "GANG_ENV_NAMES",
    "HELD_FOR_CREDIT",
    "HELD_UNSERVED",
    "HOLDING_STATUSES",
    "IMAGE_BUILD_COMMAND",
    "IMAGE_NAME_PATTERN",
    "IMAGE_REFERENCE_PATTERN",
    "JOB_ENV",
    "LABELS",
    "LIVE_BID_STATUSES",
    "MAX_IMAGE_REFERENCE_CHARS",
    "MAX_NODE_IMAGES",
    "NODE_ADDRESS_PATTERN",
    "PID_PREFIX",
    "PROCESS_IMAGE",
    "PULL_REPORT_SECONDS",
    "REPORT_DETAIL_CHARS",
    "TORCH_ENV",
    "UNSET_NODE_ADDRESS",
    "AllocationStatus",
    "BidStatus",
    "Capacity",
    "DeliveryStatus",
    "EndReason",
    "EventKind",
    "EventPlacement",
    "NodeState",
    "NoticeReason",
    "ReportOutcome",
    "RunState",
    "Runner",
    "WorkerEvent",
    "normal_image_reference",
    "unfit_node_address",
]


class BidStatus(StrEnum):
    """A bid's status on the market (``GET /bids/{id}``)."""

    OPEN = "open"
    """Waiting for GPUs, or running on them."""
    HELD = "held"
    """Kept, but not placed: its tenant's balance ran out, or no node of its pools can run it
    as asked (``hold_reason`` says which)."""
    CANCELLED = "cancelled"
    FINISHED = "finished"
    """Its job ended by itself (exit 0, or non-zero)."""


LIVE_BID_STATUSES = (BidStatus.OPEN, BidStatus.HELD)
"""The bids that may still run: a worker follows and adopts only these."""

BID_FROM_STATES: dict[BidStatus, frozenset[BidStatus]] = {
    BidStatus.OPEN: frozenset({BidStatus.HELD}),  # reopened: credit again, a node serves it
    BidStatus.HELD: frozenset({BidStatus.OPEN}),  # out of credit, or no node serves it
    BidStatus.CANCELLED: frozenset(LIVE_BID_STATUSES),  # its tenant, or the worker
    BidStatus.FINISHED: frozenset(LIVE_BID_STATUSES),  # its job ended by itself
}
"""For each bid status, the statuses a bid may come from; cancelled and finished are final.
The market service's gate checks every write of a bid's status against it."""
BID_NEW_STATES = frozenset({BidStatus.OPEN})
"""A bid is created open (a hold comes after, from the tick)."""

HELD_FOR_CREDIT = "out of credit"
"""How the ``hold_reason`` of a bid held for its tenant's balance begins."""

HELD_UNSERVED = "no node can run it"
"""How the ``hold_reason`` of a bid held because no node of its pools serves it begins
(``market.Runner``): it opens again when a node that serves it registers or changes."""


class EventKind(StrEnum):
    """The kind of one event of a bid (``GET /bids/{id}/events``, webhooks, the agent's feed)."""

    ALLOCATED = "allocated"
    """An allocation runs (new, or a reservation promoted): its job may start."""
    RESERVED = "reserved"
    """GPUs are held for the bid's next allocation (a migration target)."""
    NOTICED = "noticed"
    """The running allocation got its notice: a final save is due by ``payload.deadline``."""
    PREEMPTED = "preempted"
    FINISHED = "finished"
    RELEASED = "released"
    PULLING = "pulling"
    """The node is pulling the allocation's image (``payload.detail``: how far): progress
    before the job starts, no change of the allocation."""


class DeliveryStatus(StrEnum):
    """A webhook delivery's status (``GET /webhook/deliveries``)."""

    PENDING = "pending"
    """Not delivered yet: its next attempt is due at ``next_attempt_at``."""
    DELIVERED = "delivered"
    """The tenant's endpoint answered 2xx."""
    FAILED = "failed"
    """Every attempt failed (``webhook_max_attempts``)."""


DELIVERY_FROM_STATES: dict[DeliveryStatus, frozenset[DeliveryStatus]] = {
    DeliveryStatus.PENDING: frozenset({DeliveryStatus.PENDING}),  # an attempt failed: a retry
    DeliveryStatus.DELIVERED: frozenset({DeliveryStatus.PENDING}),
    DeliveryStatus.FAILED: frozenset({DeliveryStatus.PENDING}),
}
"""For each delivery status, the statuses a delivery may come from (delivered and failed are
final)."""
DELIVERY_NEW_STATES = frozenset({DeliveryStatus.PENDING})
"""A delivery is created pending."""


class EventPlacement(StrEnum):
    """How an event's allocation came to be (its ``payload.placement``): the market's
    ``PlacementKind`` of a new allocation, or ``promoted`` when a reservation starts."""

    NEW = PlacementKind.NEW.value
    TAKEOVER = PlacementKind.TAKEOVER.value
    MIGRATION = PlacementKind.MIGRATION.value
    """A noticed bid's reservation: the node may give its job the job early (a warm start)."""
    PROMOTED = "promoted"
    """A reservation that starts now (an ``allocated`` event)."""


class RunState(StrEnum):
    """The names of the Prefect states the worker gives a flow run (beside Prefect's own),
    which the launcher on the node and ``spotgpu demo`` read."""

    AWAITING_GPU = "AwaitingGPU"
    """Pending: the run's bid waits for GPUs (the message: the bid and its quote)."""
    STARTING = "Starting"
    """Pending: an allocation of this attempt runs; its launcher may start the engine."""
    PREEMPTED = "Preempted"
    """Scheduled: the run's allocation was preempted; the run resumes from its checkpoint."""


ENDING_EVENTS = frozenset({EventKind.PREEMPTED, EventKind.FINISHED, EventKind.RELEASED})
"""The events that end an allocation (its ``payload.reason`` is an ``EndReason``)."""

HOLDING_STATUSES = (AllocationStatus.RUNNING, AllocationStatus.NOTICED)
"""Allocation statuses whose job holds GPUs (and is billed)."""
STARTABLE = (AllocationStatus.RUNNING, AllocationStatus.RESERVED)
"""Allocation statuses whose job a node agent starts: running, or reserved (a migration
target that the market gives its job at the notice, to start warm; never billed)."""


class ReportOutcome(StrEnum):
    """What an agent reports of a job (``POST /allocations/{allocation_id}/report``)."""

    CHECKPOINT = "checkpoint"
    """A durable checkpoint was written (``checkpoint_at``)."""
    SAVED = "saved"
    """The final save after a notice is durable: the agent stops the job."""
    SAVE_FAILED = "save_failed"
    FINISHED = "finished"
    """The job exited 0."""
    FAILED = "failed"
    """The job exited non-zero."""
    PULLING = "pulling"
    """The node is pulling the job's image (``detail``: how far); sent at most every
    ``PULL_REPORT_SECONDS``, before the job starts."""


REPORT_DETAIL_CHARS = 300
"""The longest ``detail`` of a report (a failed job's, an image pull's progress): one line of
plain text (no control characters) that reaches the bid's tenant, in the allocation's events
and its flow-run log."""

ACK_WAKE_SUFFIX = ".wake"
"""Beside a noticed job's acknowledgement file: a FIFO its agent waits on, which the checkpoint
library pokes once the acknowledgement is written (``agent/ack_wait.py``)."""

PULL_REPORT_SECONDS = 2.0
"""How often, at most, an agent reports an image pull's progress."""

PROCESS_IMAGE = "process"
"""The image name that means no container: the job runs as a process on the node."""
IMAGE_BUILD_COMMAND = "spotgpu admin image build"
"""The operator's command that makes a flow-ready catalogue image (``runs_flows``) from a base:
what a refusal of a command-only image for a flow run names."""

IMAGE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
"""A catalogue image's name (what a deployment's ``image`` variable says): lower case, 63 at
most, as in the pool form's choices."""

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE_PATTERN = (
    r"^(?:[a-z0-9]+(?:[.-][a-z0-9]+)*(?::[0-9]{1,5})?/)?"  # [registry[:port]/]
    rf"{_COMPONENT}(?:/{_COMPONENT})*"  # repo/name
    r"(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"  # [:tag][@digest]
)
"""A container image reference (``[registry[:port]/]repo/name[:tag][@sha256:digest]``), as
Docker writes it: the market's catalogue holds these, nodes report and pull them."""

MAX_IMAGE_REFERENCE_CHARS = 500
"""The longest image reference the market takes."""
MAX_NODE_IMAGES = 500
"""The most image references one heartbeat reports."""

NODE_ADDRESS_PATTERN = r"^[A-Za-z0-9.:-]{1,253}$"
"""The address a node's agent advertises (an IP or a hostname other nodes reach it at): a
gang's rank 0 node's address is its ``MASTER_ADDR``."""
UNSET_NODE_ADDRESS = "127.0.0.1"
"""A gang's ``master_addr`` when rank 0's node advertised no address."""


def unfit_node_address(address: str) -> str | None:
    """Why ``address`` cannot be where other nodes reach a node (None: it can).

    A provider chooses its node's address, and a gang's other ranks, running some tenant's job
    on other providers' nodes, connect to it: an IP literal nobody's node can be (unspecified,
    multicast, broadcast, reserved) or a link-local one (``169.254.169.254``, a cloud's
    metadata service; ``fe80::/10``) would aim them elsewhere, so the market refuses it at
    registration and the agents refuse it in a rendezvous. Loopback is this host (the default:
    a stack on one machine); private ranges are a data centre's own. Host names pass (the
    pattern's characters only): they are resolved by the nodes that use them.

    >>> unfit_node_address("169.254.169.254")
    'a link-local address (a cloud metadata service, not a node)'
    >>> unfit_node_address("10.0.0.7") is None and unfit_node_address("gpu-7.lan") is None
    True
    """
    import ipaddress
    import re

    if not re.fullmatch(NODE_ADDRESS_PATTERN, address):
        return "not an IP address or a host name (letters, digits, '.', ':', '-'; at most 253)"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None  # a host name
    if ip.is_link_local:
        return "a link-local address (a cloud metadata service, not a node)"
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved or str(ip) == "255.255.255.255":
        return "an address no node can have (unspecified, multicast, broadcast or reserved)"
    return None


JOB_SUBNET_PREFIXES = (16, 24)
"""The sizes a Docker node's job network may have (``--job-subnet``): from a /16 to a /24, so
that a node always has an address for each job it holds (at least 253)."""


def unfit_job_subnet(subnet: str) -> str | None:
    """Why ``subnet`` cannot be a Docker node's job network (None: it can): an IPv4 network
    in private ranges (``10/8``, ``172.16/12``, ``192.168/16``: routed between the GPU hosts of
    one data centre, never the internet's), written as its network address, /16 to /24.

    >>> unfit_job_subnet("10.88.3.0/24") is None
    True
    >>> unfit_job_subnet("10.88.3.7/24")
    'not a network address: 10.88.3.7/24 has host bits set (10.88.3.0/24?)'
    >>> unfit_job_subnet("8.8.8.0/24")
    'not a private range (10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16)'
    """
    import ipaddress

    try:
        net = ipaddress.IPv4Network(subnet)
    except ipaddress.AddressValueError:
        return "not an IPv4 network (e.g. 10.88.3.0/24)"
    except ValueError:
        try:
            near = ipaddress.IPv4Network(subnet, strict=False)
        except ValueError:
            return "not an IPv4 network (e.g. 10.88.3.0/24)"
        return f"not a network address: {subnet} has host bits set ({near}?)"
    private = [ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
    if not any(net.subnet_of(p) for p in private):
        return "not a private range (10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16)"
    low, high = JOB_SUBNET_PREFIXES
    if not low <= net.prefixlen <= high:
        return f"a /{net.prefixlen}: a job network is a /{low} to a /{high}"
    return None


_DOCKER_HUB_PREFIXES = (
    "docker.io/library/",
    "index.docker.io/library/",
    "docker.io/",
    "index.docker.io/",
)


def normal_image_reference(reference: str) -> str:
    """A reference as ``docker images`` lists it, so the catalogue's and a node's spellings of
    one image compare equal: Docker Hub's prefixes dropped, ``:latest`` made explicit.

    >>> normal_image_reference("docker.io/library/python")
    'python:latest'
    >>> normal_image_reference("nvcr.io/nvidia/pytorch:25.06-py3")
    'nvcr.io/nvidia/pytorch:25.06-py3'
    """
    for prefix in (
        "docker.io/library/",
        "index.docker.io/library/",
        "docker.io/",
        "index.docker.io/",
    ):
        if reference.startswith(prefix):
            reference = reference[len(prefix) :]
            break
    name = reference.split("@", 1)[0]
    if "@" not in reference and ":" not in name.rsplit("/", 1)[-1]:
        reference += ":latest"
    return reference


class WorkerEvent(StrEnum):
    """The Prefect events the worker emits, as ``spotgpu.bid.<value>`` on the bid's resource."""

    CREATED = "created"
    """The run's bid was placed (or, after a replacement, its new bid)."""
    ALLOCATED = "allocated"
    """GPUs were allocated: the run's job starts on a node."""
    RESUMED = "resumed"
    """A preempted run starts again, on its next allocation."""
    NOTICED = "noticed"
    """The run's allocation got its notice (payload: the reason and the deadline)."""
    PREEMPTED = "preempted"
    """The run's allocation ended by a preemption: the run is rescheduled."""
    ON_DEMAND = "on-demand"
    """A paced run (``gpu_hours`` and a deadline, under any bidding policy) moved to on-demand
    capacity."""
    SPOT = "spot"  # back to spot capacity from on-demand
    """A paced run went back to spot capacity from on-demand (a policy that moves back:
    ``deadline-aware``)."""
    HELD = "held"
    """The market holds the run's bid: no node of its pools can run it as asked (its runner;
    payload ``reason``). The run waits, AwaitingGPU, until a node that serves it comes. (A bid
    held for its tenant's credit says so in its own status, not by this event.)"""

    @property
    def event(self) -> str:
        return f"spotgpu.bid.{self.value}"


@dataclass(frozen=True)
class _Labels:
    """Labels on Prefect flow runs (``spotgpu.*``, ``prefect.worker.name``) and on market bids
    (``prefect.*``, ``spotgpu.replaces``)."""

    BID: str = "spotgpu.bid"
    """On a flow run: the market bid serving it."""
    ALLOCATION: str = "spotgpu.allocation"
    """On a flow run: the allocation whose launcher may start the engine."""
    RELEASED_BY: str = "spotgpu.released-by"
    """On a flow run: the worker that stopped while following it. While it still names the
    run's owner (``WORKER``), the next worker adopts the run at once instead of waiting for the
    owner's heartbeats to age."""
    WORKER: str = "prefect.worker.name"
    """On a flow run (Prefect's own): the worker that owns it."""
    FLOW_RUN: str = "prefect.flow-run-id"
    """On a bid: the flow run it serves."""
    FLOW_RUN_NAME: str = "prefect.flow-run-name"
    POOL: str = "prefect.work-pool"
    """On a bid: the work pool of its flow run (adoption looks only at its own pool's)."""
    REPLACES: str = "spotgpu.replaces"
    """On a bid that replaced an earlier bid of the same run (spot -> on-demand): that id."""
    BUNDLE_SHA256: str = "spotgpu.bundle-sha256"
    """On a flow run of a decorated flow: the SHA-256 of its bundle, set by the caller that
    uploaded it; the node runs the bundle only when the bytes it read match."""


LABELS = _Labels()

MAX_BIDS_PER_BATCH = 500
"""The most bids one ``POST /bids/batch`` places (the service's limit; the worker's batches)."""

PID_PREFIX = "spotgpu-bid-"
"""A flow run's infrastructure id: ``spotgpu-bid-<the bid serving it>``."""


@dataclass(frozen=True)
class _JobEnv:
    """The ``SPOTGPU_*`` variables the agent gives a job (and its launcher and checkpointer
    read). Paths are as the job sees them (inside a container: under its workdir)."""

    ALLOCATION_ID: str = "SPOTGPU_ALLOCATION_ID"
    ALLOCATION_EPOCH: str = "SPOTGPU_ALLOCATION_EPOCH"
    BID_ID: str = "SPOTGPU_BID_ID"
    NOTICE_FILE: str = "SPOTGPU_NOTICE_FILE"
    """Written by the agent at a notice (then SIGUSR1): the deadline of the final save."""
    ACK_FILE: str = "SPOTGPU_ACK_FILE"
    """Written by the job once its final save is durable."""
    SAVED_FILE: str = "SPOTGPU_SAVED_FILE"
    """Written by the job after each durable checkpoint (the agent reports it)."""
    CHECKPOINT_KEY: str = "SPOTGPU_CHECKPOINT_KEY"
    """The bid's key, ``bid-<id>``, the same on every node it runs on. The checkpoint library
    does not read it (it keys a flow run's checkpoints by ``flow-run-<id>``); a job without
    Prefect may."""
    CHECKPOINT_URL: str = "SPOTGPU_CHECKPOINT_URL"
    CHECKPOINT_SIGNING_KEY: str = "SPOTGPU_CHECKPOINT_SIGNING_KEY"
    LAUNCH_TIMEOUT: str = "SPOTGPU_LAUNCH_TIMEOUT"
    """How long the launcher waits for the worker's go (seconds, default 600)."""
    GPUS_PER_NODE: str = "SPOTGPU_GPUS_PER_NODE"
    """A gang member's GPUs on its node (the gang's ``gpu_count``)."""
    GANG_LEAD_ALLOCATION: str = "SPOTGPU_GANG_LEAD_ALLOCATION"
    """A gang member's rank 0 allocation in the same attempt: a member of rank > 0 starts
    when the worker has handed the flow run to that allocation (``launch``)."""


JOB_ENV = _JobEnv()


@dataclass(frozen=True)
class _TorchEnv:
    """torch.distributed's (torchrun's) standard variables, as a gang member gets them from
    its agent: one process per node, so a node's rank is the process's."""

    MASTER_ADDR: str = "MASTER_ADDR"
    """Rank 0's node's advertised address."""
    MASTER_PORT: str = "MASTER_PORT"
    WORLD_SIZE: str = "WORLD_SIZE"
    RANK: str = "RANK"
    NODE_RANK: str = "NODE_RANK"
    NNODES: str = "NNODES"
    LOCAL_RANK: str = "LOCAL_RANK"
    LOCAL_WORLD_SIZE: str = "LOCAL_WORLD_SIZE"


TORCH_ENV = _TorchEnv()

GANG_ENV_NAMES = (
    TORCH_ENV.MASTER_ADDR,
    TORCH_ENV.MASTER_PORT,
    TORCH_ENV.WORLD_SIZE,
    TORCH_ENV.RANK,
    TORCH_ENV.NODE_RANK,
    TORCH_ENV.NNODES,
    TORCH_ENV.LOCAL_RANK,
    TORCH_ENV.LOCAL_WORLD_SIZE,
    JOB_ENV.GPUS_PER_NODE,
    JOB_ENV.GANG_LEAD_ALLOCATION,
)
"""What a gang member's job gets from its agent, in this order; the agent's values win over
the tenant's environment of the same names."""


_MARKET_DEFAULTS = MarketConfig()


@dataclass(frozen=True, slots=True)
class MarketTerms:
    """What the market publishes for its clients (``GET /api/v1/market``), so a worker reads the
    operator's settings instead of copying them: the notice's length, the hysteresis margin
    an incumbent keeps, the tick, and whether migration targets start warm.

    >>> MarketTerms.read({"notice_seconds": 120, "hysteresis": 0.1, "new_field": 1})
    MarketTerms(notice_seconds=120.0, hysteresis=0.1, tick_seconds=1.0, warm_replacement=True)
    """

    notice_seconds: float = _MARKET_DEFAULTS.notice_seconds  # (an older market's: these)
    hysteresis: float = _MARKET_DEFAULTS.hysteresis
    tick_seconds: float = 1.0
    warm_replacement: bool = True

    @classmethod
    def read(cls, data: dict) -> MarketTerms:
        """From the route's JSON: fields a newer market adds are ignored, fields an older
        market lacks keep their defaults (the market's own defaults)."""
        known = {f: data[f] for f in cls.__slots__ if f in data}
        for name in ("notice_seconds", "hysteresis", "tick_seconds"):
            if name in known:
                known[name] = float(known[name])
        return cls(**known)


@dataclass(frozen=True)
class _DaskEnv:
    """What a Dask worker job (``python -m prefect_spotgpu.dask.worker_job``) reads from its
    bid's sealed ``job.env``, set by ``prefect_spotgpu.dask.SpotGPUCluster``. The TLS values
    are PEM text: the market gives them only to the node holding the bid's allocation."""

    SCHEDULER: str = "SPOTGPU_DASK_SCHEDULER"
    """The scheduler's address as the nodes reach it (``tls://host:port``)."""
    TLS_CA: str = "SPOTGPU_DASK_TLS_CA"
    TLS_CERT: str = "SPOTGPU_DASK_TLS_CERT"
    TLS_KEY: str = "SPOTGPU_DASK_TLS_KEY"
    NTHREADS: str = "SPOTGPU_DASK_NTHREADS"
    RESOURCES: str = "SPOTGPU_DASK_RESOURCES"
    """The worker's abstract resources, ``NAME=amount`` separated by spaces (``GPU=1``)."""
    MEMORY_LIMIT: str = "SPOTGPU_DASK_MEMORY_LIMIT"
    JOIN_TIMEOUT: str = "SPOTGPU_DASK_JOIN_TIMEOUT"
    """Seconds the worker tries to reach the scheduler before its job fails, saying so."""
    WORKER_HOST: str = "SPOTGPU_DASK_WORKER_HOST"
    """Where the worker listens (other workers fetch its results there); default: the
    node's address on the route to the scheduler."""


DASK_ENV = _DaskEnv()

DASK_CLUSTER_LABEL = "spotgpu.dask-cluster"
"""On a bid: the ``SpotGPUCluster`` whose Dask worker it runs (its scheduler's id)."""

DASK_UNREACHABLE_EXIT = 4
"""A Dask worker job's exit code when it could not reach its scheduler in time."""

VERSION_HEADER = "X-Spotgpu-Version"
"""The header on every request of an agent, a worker or the CLI: its prefect-spotgpu version
(``api_client`` sends it). The market refuses a client older than it accepts (426, a
``messages.VersionRefusal``); a request without it is a tenant's own script's, or an agent's
from before the header (docs/operators/version-skew.md)."""

TELEMETRY_AGENT_VERSION = "agent_version"
"""The key of a node's stored telemetry that holds the version its agent last sent."""
