"""The replies the market service sends to its own clients (node agents, the worker, the CLI), as
pydantic models they all import: the service declares them as its response models, and the
clients parse what they read into them instead of reading dicts by string keys. Here: a bid
(``BidResponse``, and a batch of them placed together, ``BidBatchResponse``), a pool's quote
(``QuoteResponse``), an allocation (``AllocationResponse``; as its node agent sees it, with its
job: ``Assignment``), a bid's events (``EventResponse``, its payload ``EventPayload``, a page of
them: ``EventsPage``), a node
(``NodeResponse``; as registered, with its agent's token: ``NodeCreated``; a new token:
``NodeToken``; as anyone sees it on the market, with its GPUs in use: ``MarketNodeResponse``), an
image catalogue entry (``ImageResponse``), a tenant's webhook (``WebhookConfigResponse``), a
tenant (``TenantResponse``; as created, with its key: ``TenantCreated``), its keys
(``KeyIssued``, ``KeysRevoked``), a ledger entry (``LedgerEntryResponse``) and a cost estimate
(``EstimateResponse``, each region's beside it: ``RegionEstimate``). And the requests both
ways, which the service declares as its request models (subclasses adding its checks, with the
same fields: ``tests/test_messages.py``): a new bid (``BidRequest``, its job ``JobSpec``), what
a node agent reports of an allocation (``AllocationReport``), a node's registration
(``NodeRegistration``) and its heartbeat (``Heartbeat``). A refusal is an ``ErrorResponse``; a
client too old for the market is refused with a ``VersionRefusal``.

Wire compatibility: a field a newer service adds is ignored by an older client (pydantic's
default ``extra="ignore"``), and a field a client needs that a reply lacks fails the parse
naming it (``pydantic.ValidationError``), never a ``KeyError`` deep in the client. An event's
``payload`` is an ``EventPayload``: each key the service writes into one is an optional field
(which keys an event carries depends on its kind, ``protocol.EventKind``), a key it does not
declare is kept as it came (``extra="allow"``: a newer service's), and a declared key of the
wrong type fails the parse naming it (``payload.deadline``). A bid's ``labels`` and ``job``,
and a node's ``inventory`` and ``telemetry``, stay mappings. Statuses and capacities stay
strings, so an older client still reads a status a newer service adds: compare them with
``protocol``'s ``StrEnum``s (``BidStatus.HELD``, ``Capacity.ON_DEMAND``), never with bare
strings.

Imports only pydantic and ``protocol`` (``tests/test_architecture.py``), so the agent and the
worker may use it without the service's dependencies.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from prefect_spotgpu.protocol import REPORT_DETAIL_CHARS, ReportOutcome


class AllocationResponse(BaseModel):
    """An allocation: GPUs on one node held for one bid."""

    id: int
    bid_id: int
    node_id: int
    gpu_count: int
    status: str
    epoch: int
    kind: str
    started_at: float
    charged_until: float
    price: float
    deadline: float | None
    notice_reason: str | None
    charged_amount: float
    charged_micros: int = Field(description="What it cost so far, exactly, in micros.")
    charged_seconds: float
    notice_fee_micros: int = Field(
        0,
        description="A takeover's notice fee, in micros: it outbid running allocations and "
        "noticed them, so it pays at least this in all, however soon it ends (0: none).",
    )
    last_checkpoint_at: float | None
    final_save: str | None
    ended_at: float | None
    end_reason: str | None
    rank: int | None = Field(None, description="A gang member's rank (None: a one-node bid).")


class AssignedJob(BaseModel):
    """The job a node runs for an allocation (the bid's ``JobSpec``, its environment opened)."""

    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    checkpoint_url: str | None = None


class Assignment(AllocationResponse):
    """An allocation as its node agent sees it: with the job to run (its environment opened,
    only while the allocation runs on this node), and for a gang member where its gang meets."""

    tenant_id: int
    job: AssignedJob | None = None
    checkpoint_key: str
    job_address: str | None = Field(
        None,
        description="The job's address on its node's job network (a Docker node started with "
        "--job-subnet); None: the node has none.",
    )
    gang: dict | None = Field(
        None,
        description="A gang member's place in its gang: rank, world_size, master_addr "
        "(rank 0's job address, else rank 0's node's address), master_port, gpus_per_node, "
        "lead_allocation (rank 0's allocation of the same attempt) and peers (the job "
        "addresses of its members of the same attempt, in rank order: who may reach it on its "
        "job network); None for a one-node bid. The agent checks it (a malformed one fails "
        "that allocation, saying why, not the node's every reply).",
    )


class EventPayload(BaseModel):
    """What an event says, by its kind (``EventKind``; times in Unix epoch seconds). Every
    event: ``at`` (when the market wrote it), and ``allocation_id``, ``bid_id``, ``node_id`` and
    ``event`` (its kind) as the event itself has them. ``allocated`` and ``reserved`` (an
    allocation placed): ``status``, ``gpu_count``, ``placement`` and ``epoch``; one the market
    has just placed also ``expires_at`` (a reservation's expiry; null for a running one).
    ``noticed``: ``reason`` (a notice reason), ``deadline`` and ``epoch``. ``preempted``,
    ``finished`` and ``released`` (an end): ``reason`` (an end reason), ``epoch``, and
    ``detail`` when the node said why its job failed. ``pulling``: ``epoch`` and ``detail`` (how
    far the image pull is). A key not listed here is kept as it came; a listed one an event does
    not carry is absent, never sent as null."""

    model_config = ConfigDict(extra="allow")

    at: float | None = Field(None, description="When the market wrote the event (epoch s).")
    epoch: int | None = Field(
        None, description="The allocation's epoch: the fencing token its agent's reports carry."
    )
    placement: str | None = Field(
        None,
        description="How the allocation was placed: new, takeover or migration (its GPUs "
        "reserved for the bid's next allocation), or promoted (a reservation that now runs).",
    )
    status: str | None = Field(None, description="The allocation's status when placed.")
    gpu_count: int | None = Field(None, description="The allocation's GPUs.")
    expires_at: float | None = Field(
        None, description="When a reservation lapses unless promoted (epoch s)."
    )
    deadline: float | None = Field(
        None, description="A notice's deadline: the final save is due by then (epoch s)."
    )
    reason: str | None = Field(
        None, description="Why: a notice's reason, or an end's (the allocation's end_reason)."
    )
    detail: str | None = Field(
        None,
        description="A pull's progress, or the node's word on why a job failed (e.g. a "
        "missing image).",
    )

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler):
        """Only the keys the payload came with: a field it lacks is not added as null, so a
        client that reads it as a mapping (an older one, a Prefect event) sees what the
        service wrote."""
        written = handler(self)
        fields = type(self).model_fields
        return {k: v for k, v in written.items() if k in self.model_fields_set or k not in fields}


class EventResponse(BaseModel):
    """One event of a bid (and of the node that holds its allocation)."""

    id: int
    kind: str
    bid_id: int
    node_id: int
    allocation_id: int
    payload: EventPayload
    created_at: datetime


class EventsPage(BaseModel):
    """A page of events, and where the next long-poll starts."""

    events: list[EventResponse]
    cursor: int = Field(description="Pass as `after` to wait for the next events.")


# BidResponse, BidBatchResponse, QuoteResponse and the models below them have no docstring: the
# service's OpenAPI schema shows a model's docstring as its description, and theirs has none.


class BidResponse(BaseModel):
    id: int
    tenant_id: int
    idempotency_key: str | None
    gpu_model: str
    region: str
    gpu_count: int
    max_price: float
    capacity: str = "spot"
    status: str
    hold_reason: str | None
    window_start: datetime | None
    window_end: datetime | None
    deadline: datetime | None
    labels: dict | None
    job: dict | None = Field(
        None,
        description="The job: command, image, checkpoint_url and env_names. The "
        "environment's values are sealed: never returned, given only to the node running it.",
    )
    created_at: datetime
    node_count: int = 1
    min_node_count: int | None = Field(
        None, description="The fewest nodes the gang goes on with (null: all of them)."
    )
    gang_id: int | None = Field(None, description="A gang member's gang: rank 0's bid id.")
    members: list[int] = Field(
        default_factory=list,
        description="A gang's member bid ids in rank order ([] for a one-node bid).",
    )


class BidBatchResponse(BaseModel):
    bids: list[BidResponse] = Field(description="The batch's bids, in the request's order.")
    created: list[bool] = Field(
        description="Per bid: true when this request created it, false when its idempotency "
        "key found an earlier one."
    )


class QuoteResponse(BaseModel):
    gpu_model: str
    region: str
    capacity: str = "spot"
    clearing_price: float | None
    reserve_price: float | None
    on_demand_price: float
    gpus_total: int
    gpus_free: int
    gpus_running: int
    waiting_bids: int


class NodeResponse(BaseModel):
    id: int
    owner_id: int
    name: str
    gpu_model: str
    region: str
    gpu_count: int
    reserve_price: float
    capacity: str = "spot"
    state: str
    declared: bool
    inventory: list[dict] | None = None
    telemetry: dict | None = None
    images: list[str] | None = None
    address: str | None = None
    runner: str | None = None
    default_image: str | None = None
    job_subnet: str | None = Field(
        None, description="A Docker node's job network (None: Docker's default bridge)."
    )
    last_heartbeat_at: datetime


class NodeCreated(NodeResponse):
    token: str = Field(description="The node agent's token. Shown once; store it.")


class NodeToken(BaseModel):
    token: str = Field(description="The node agent's new token. Shown once; the old one is dead.")


class ImageResponse(BaseModel):
    name: str
    reference: str
    framework: str
    cuda_version: str | None
    description: str
    runs_flows: bool = Field(
        True,
        description="A flow run may pick it (it holds prefect-spotgpu); false: it runs only a "
        "job's own command. (A market from before the field does not say: taken as true.)",
    )
    updated_at: datetime


class WebhookConfigResponse(BaseModel):
    url: str | None
    has_secret: bool


class MarketNodeResponse(BaseModel):
    """A node as anyone sees it on the market (``GET /market/nodes``): no owner, no address."""

    id: int
    gpu_model: str
    region: str
    capacity: str = "spot"
    state: str
    gpu_count: int
    gpus_busy: int = Field(description="GPUs held by an allocation now.")
    reserve_price: float
    gpus: list[dict] = Field(description="Each GPU's last readings that pass the schema.")
    last_heartbeat_at: datetime


class TenantResponse(BaseModel):
    id: int
    name: str
    balance: float
    provider: bool = Field(False, description="Whether the operator lets it register nodes.")
    created_at: datetime


class TenantCreated(TenantResponse):
    api_key: str = Field(description="Shown once; store it.")


class KeyIssued(BaseModel):
    api_key: str = Field(description="Shown once; store it. Every older key is revoked.")


class KeysRevoked(BaseModel):
    revoked: int = Field(description="How many live keys were revoked.")


class LedgerEntryResponse(BaseModel):
    id: int
    kind: str
    amount: float
    amount_micros: int = Field(description="The amount, exactly, in micros (1 = 1e-6).")
    allocation_id: int | None
    reason: str
    created_at: datetime


class RegionEstimate(BaseModel):
    """What some GPU-hours by a deadline are expected to cost and when they finish, from one
    forecast: spot where its price is at most the cap, on-demand for what spot cannot cover."""

    expected_cost: float
    expected_finish: datetime | None = Field(
        description="None: spot alone does not finish before the deadline."
    )
    p_meet_deadline_on_spot: float
    on_demand_cost: float
    saving: float = Field(description="1 - expected_cost / on_demand_cost.")
    expected_spot_gpu_hours: float
    expected_on_demand_gpu_hours: float
    region: str | None = Field(None, description="Whose forecast (in ``regions``).")


class EstimateResponse(RegionEstimate):
    """The estimate for the asked region (for ``any``: from every region's forecast at once),
    with each region's own, cheapest first."""

    gpu_model: str
    region: str
    regions: list[RegionEstimate]
    assumptions: str


class AllocationReport(BaseModel):
    """What a node agent reports about an allocation (``POST /allocations/{id}/report``),
    fenced by its epoch. ``body()`` is what it sends."""

    epoch: int = Field(ge=1, le=2**31 - 1, strict=True)
    outcome: ReportOutcome
    cause: Literal["storage", "job", "deadline"] | None = Field(
        None,
        description="Why a final save failed: storage (the write failed: compensated), job "
        "(the job exited without saving) or deadline (still unsaved at the deadline).",
    )
    checkpoint_at: float | None = Field(None, ge=0, allow_inf_nan=False, strict=True)
    step: int | None = Field(None, ge=0, le=2**62, strict=True)
    detail: str | None = Field(
        None,
        max_length=REPORT_DETAIL_CHARS,
        pattern=r"^[^\x00-\x1f\x7f-\x9f]*$",
        description="For a failed job: what the node saw (e.g. an image it could not pull), "
        "one line of plain text; the bid's tenant sees it in the allocation's ending event.",
    )

    def body(self) -> dict:
        """The report as sent: the fields it holds."""
        return self.model_dump(mode="json", exclude_none=True)


class JobSpec(BaseModel):
    """What a node runs for an allocation of a bid (its ``job``): a command, in an image from
    the market's catalogue (None: a process), with its environment and checkpoint URL."""

    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    checkpoint_url: str | None = None


class BidRequest(BaseModel):
    """A new bid (``POST /bids``, or an item of ``POST /bids/batch``). ``body()`` is what is
    sent: the fields it holds, so an older market never sees a field it does not know
    (``min_node_count``) unless the bid needs it."""

    gpu_model: str
    gpu_count: int
    max_price: float | None = None
    capacity: str = "spot"
    region: str = "any"
    idempotency_key: str | None = None
    window_start: datetime | None = None
    window_end: datetime | None = None
    deadline: datetime | None = None
    labels: dict[str, str] | None = None
    job: JobSpec | None = None
    node_count: int = 1
    min_node_count: int | None = None

    def body(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


class RunnerTerms(BaseModel):
    """How a node's agent runs jobs (``protocol.Runner``), said at registration and with every
    heartbeat: its runner, a Docker node's default image and its job network."""

    runner: str | None = None
    default_image: str | None = None
    job_subnet: str | None = None


class NodeRegistration(RunnerTerms):
    """A node as its agent registers it (``POST /nodes``, with its owner's key)."""

    name: str
    gpu_model: str
    region: str | None = None
    gpu_count: int
    reserve_price: float | None = None
    capacity: str = "spot"
    declared: bool = False
    inventory: list[dict] | None = None
    address: str | None = None

    def body(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


class Heartbeat(RunnerTerms):
    """A node agent's heartbeat (``POST /nodes/{id}/heartbeat``): its telemetry, the images it
    holds (None: unchanged) and its address (None: unchanged)."""

    telemetry: dict | None = None
    images: list[str] | None = None
    address: str | None = None

    def body(self) -> dict:
        return self.model_dump(mode="json", exclude_none=True)


class ValidationIssue(BaseModel):
    """One problem of a 422 (FastAPI's shape: where, what; a key it adds is kept)."""

    model_config = ConfigDict(extra="allow")

    loc: list[str | int] = Field(default_factory=list)
    msg: str = ""
    type: str = ""


class ErrorResponse(BaseModel):
    """What the service answers when it refuses a request: ``detail`` (a message, or a 422's
    problems), ``field`` (the one it names) and, for a batch, ``item`` (the refused one's
    index)."""

    model_config = ConfigDict(extra="allow")

    detail: str | list[ValidationIssue] | None = None
    field: str | None = None
    item: int | None = None

    @classmethod
    def of(cls, response) -> ErrorResponse | None:
        """The refusal in an ``httpx.Response`` (None: its body is not one)."""
        try:
            return cls.model_validate(response.json())
        except ValueError:  # (not JSON, or not this shape: pydantic's errors are ValueErrors)
            return None


class VersionRefusal(ErrorResponse):
    """The market's refusal of a client older than it accepts (HTTP 426 Upgrade Required):
    ``detail`` says it in words; the versions and the command that upgrades the client are
    data too (docs/operators/version-skew.md)."""

    market_version: str
    oldest_accepted: str = Field(description="The oldest client version the market accepts.")
    client_version: str = Field(description="The version the client sent (or was taken as).")
    upgrade: str = Field(description="The command that installs a version the market accepts.")
