"""Request and response bodies. Validation here reuses the market's own checks, so a bad field
is a 422 that names it (never a 500, never a partial write)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    UrlConstraints,
    field_validator,
    model_validator,
)

from prefect_spotgpu.market import DEFAULT_CATALOG, MAX_GPUS_PER_NODE
from prefect_spotgpu.market.types import check_region
from prefect_spotgpu.service import webhooks
from prefect_spotgpu.service.telemetry import GpuInventoryItem, Telemetry


def _model(value: str) -> str:
    return DEFAULT_CATALOG.normalize(value)


def _region(value: str) -> str:
    return check_region("region", value, allow_any=True)


def _node_region(value: str) -> str:
    return check_region("region", value, allow_any=False)


GpuModelName = Annotated[
    str, Field(min_length=1, max_length=100, examples=["A100-80G"]), AfterValidator(_model)
]
Region = Annotated[
    str, Field(min_length=1, max_length=63, examples=["eu-west"]), AfterValidator(_region)
]
NodeRegion = Annotated[
    str, Field(min_length=1, max_length=63, examples=["eu-west"]), AfterValidator(_node_region)
]


def _whole_micros(value: float) -> float:
    """Prices (per GPU-hour) and credits are whole micros (market/money.py): six decimals."""
    quantized = round(value, 6)
    if quantized <= 0:
        raise ValueError("must be at least 0.000001 (one micro)")
    return quantized


Price = Annotated[
    float,
    Field(
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="Per GPU-hour, one currency unit, at most six decimals (rounded to them).",
    ),
    AfterValidator(_whole_micros),
]
GpuCount = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]
CapacityKind = Annotated[
    Literal["spot", "on_demand"],
    Field(
        description="spot: idle GPUs, auctioned every second, preemptible with a notice; "
        "on_demand: non-preemptible GPUs at the model's on-demand price."
    ),
]
Name = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


def _has_nul(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


class Strict(BaseModel):
    """Request bodies: unknown fields and NUL characters (which PostgreSQL cannot store) are
    refused with a 422 naming the field."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value):
        if _has_nul(value):
            raise ValueError("must not contain NUL characters")
        return value


class TenantCreate(Strict):
    name: Name
    starting_credit: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)


class TenantResponse(BaseModel):
    id: int
    name: str
    balance: float
    provider: bool = Field(False, description="Whether the operator lets it register nodes.")
    created_at: datetime


def tenant_response(tenant) -> dict:
    """A tenant row as ``TenantResponse``'s fields (its balance computed)."""
    return {
        "id": tenant.id,
        "name": tenant.name,
        "balance": tenant.balance,
        "provider": tenant.provider,
        "created_at": tenant.created_at,
    }


class ProviderUpdate(Strict):
    provider: bool = Field(description="true: the tenant may register nodes; false: no more.")


class KeyIssued(BaseModel):
    api_key: str = Field(description="Shown once; store it. Every older key is revoked.")


class KeysRevoked(BaseModel):
    revoked: int = Field(description="How many live keys were revoked.")


class NodeToken(BaseModel):
    token: str = Field(description="The node agent's new token. Shown once; the old one is dead.")


class TenantCreated(TenantResponse):
    api_key: str = Field(description="Shown once; store it.")


class CreditCreate(Strict):
    amount: Annotated[
        float,
        Field(gt=0, le=1e9, allow_inf_nan=False, description="Units, six decimals at most."),
        AfterValidator(_whole_micros),
    ]
    reason: str = Field(min_length=1, max_length=500)


class NodeCreate(Strict):
    name: Name
    gpu_model: GpuModelName
    region: NodeRegion
    gpu_count: GpuCount
    reserve_price: Price | None = Field(
        None,
        description="The owner's floor per GPU-hour; an on-demand node's is its "
        "model's on-demand price.",
    )
    capacity: CapacityKind = "spot"
    declared: bool = Field(False, description="Inventory declared by hand (no NVML).")
    inventory: list[GpuInventoryItem] | None = Field(None, max_length=MAX_GPUS_PER_NODE)

    @model_validator(mode="after")
    def _on_demand_sells_at_the_on_demand_price(self) -> NodeCreate:
        self.reserve_price = _fixed_price(
            self.capacity, self.reserve_price, self.gpu_model, "reserve_price", exact=True
        )
        return self


def _fixed_price(
    capacity: str, price: float | None, gpu_model: str, name: str, *, exact: bool = False
) -> float:
    """A spot price as given (required); on-demand capacity trades at the catalog's on-demand
    price, so ``price`` may be left out, and a given one must not disagree with it."""
    if capacity == "spot":
        if price is None:
            raise ValueError(f"{name} is required for spot capacity")
        return price
    on_demand = DEFAULT_CATALOG.get(gpu_model).on_demand_price
    if price is not None and (price != on_demand if exact else price < on_demand):
        raise ValueError(
            f"{name} of on-demand {gpu_model} capacity is its on-demand price {on_demand}, "
            f"got {price}"
        )
    return on_demand


class NodeUpdate(Strict):
    reserve_price: Price | None = None
    state: Literal["live", "draining", "reclaimed"] | None = None

    @model_validator(mode="after")
    def _changes_something(self) -> NodeUpdate:
        if self.reserve_price is None and self.state is None:
            raise ValueError("give reserve_price or state")
        return self


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
    last_heartbeat_at: datetime


class NodeCreated(NodeResponse):
    token: str = Field(description="The node agent's token. Shown once; store it.")


class Heartbeat(Strict):
    telemetry: Telemetry | None = None


class JobSpec(Strict):
    """What the node agent runs for an allocation: a command, or an image with a command."""

    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=256, examples=[["python", "-m", "prefect.engine"]]
    )
    env: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=200)],
        Annotated[str, Field(max_length=65536)],
    ] = Field(default_factory=dict, max_length=256)
    image: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="Container image (Docker runner); None: a process.",
    )
    checkpoint_url: str | None = Field(
        None,
        min_length=1,
        max_length=2000,
        description="Where the job checkpoints (path or s3://).",
    )

    @model_validator(mode="after")
    def _env_fits(self) -> JobSpec:
        size = sum(len(k) + len(v) for k, v in self.env.items())
        if size > MAX_JOB_ENV_BYTES:
            raise ValueError(
                f"env holds {size} characters; at most {MAX_JOB_ENV_BYTES} in all "
                "(put large data in the checkpoint storage, not the environment)"
            )
        return self


MAX_JOB_ENV_BYTES = 64 * 1024
"""The most a job's environment may hold, names and values together."""
LabelKey = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")
]
LabelValue = Annotated[str, Field(max_length=256)]


class BidCreate(Strict):
    gpu_model: GpuModelName
    gpu_count: GpuCount
    max_price: Price | None = Field(
        None,
        description="The most this bid pays per GPU-hour. Required for spot; an "
        "on-demand bid pays its model's on-demand price (give at least that, or nothing).",
    )
    capacity: CapacityKind = "spot"
    region: Region = "any"
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    window_start: datetime | None = None
    window_end: datetime | None = None
    deadline: datetime | None = None
    labels: dict[LabelKey, LabelValue] | None = Field(
        None, max_length=32, description="Up to 32 labels: keys of 63, values of 256 characters."
    )
    job: JobSpec | None = None

    @model_validator(mode="after")
    def _on_demand_pays_the_on_demand_price(self) -> BidCreate:
        self.max_price = _fixed_price(self.capacity, self.max_price, self.gpu_model, "max_price")
        return self

    @model_validator(mode="after")
    def _window_is_an_interval(self) -> BidCreate:
        if (self.window_start is None) != (self.window_end is None):
            raise ValueError("window_start and window_end go together")
        if self.window_start is not None and self.window_end <= self.window_start:
            raise ValueError("window_end must be after window_start")
        for name in ("window_start", "window_end", "deadline"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"{name} needs a timezone")
            if value is not None:
                try:
                    value.astimezone(UTC).timestamp()
                except (OverflowError, ValueError, OSError):
                    raise ValueError(f"{name} is out of range") from None
        return self


class BidUpdate(Strict):
    max_price: Price


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


class AllocationResponse(BaseModel):
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
    last_checkpoint_at: float | None
    final_save: str | None
    ended_at: float | None
    end_reason: str | None


class Assignment(AllocationResponse):
    """An allocation as its node agent sees it: with the job to run (its environment opened,
    only while the allocation runs on this node)."""

    tenant_id: int
    job: dict | None = None
    checkpoint_key: str


class AllocationReport(Strict):
    """What a node agent (or a worker) reports about an allocation, fenced by its epoch."""

    epoch: int = Field(ge=1, le=2**31 - 1)
    outcome: Literal["checkpoint", "saved", "save_failed", "finished", "failed"]
    cause: Literal["storage", "job", "deadline"] | None = Field(
        None,
        description="Why a final save failed: storage (the write failed: compensated), job "
        "(the job exited without saving) or deadline (still unsaved at the deadline).",
    )
    checkpoint_at: float | None = Field(None, ge=0, allow_inf_nan=False)
    step: int | None = Field(None, ge=0, le=2**62)


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


class PriceBarResponse(BaseModel):
    minute: datetime
    open: float
    high: float
    low: float
    close: float


class LedgerEntryResponse(BaseModel):
    id: int
    kind: str
    amount: float
    amount_micros: int = Field(description="The amount, exactly, in micros (1 = 1e-6).")
    allocation_id: int | None
    reason: str
    created_at: datetime


class LedgerCursors(BaseModel):
    """Where each of the ledger's lists goes on (the query parameters of the next page);
    null where that list has ended."""

    before: int | None
    charges_before: int | None


class LedgerResponse(BaseModel):
    """Money as units (rounded to six decimals) and exactly, as whole micros (``*_micros``):
    ``balance_micros == credits_micros - spent_micros``, ``credits_micros`` is the sum of every
    entry and ``spent_micros`` the sum of every allocation's ``charged_micros``."""

    tenant_id: int
    credits: float
    spent: float
    balance: float
    credits_micros: int
    spent_micros: int
    balance_micros: int
    entries: list[LedgerEntryResponse]
    charges: list[AllocationCharge]
    next: LedgerCursors


class AllocationCharge(BaseModel):
    allocation_id: int
    bid_id: int
    gpu_count: int
    charged_amount: float
    charged_micros: int
    charged_seconds: float
    status: str


class WebhookConfig(Strict):
    url: Annotated[HttpUrl, UrlConstraints(max_length=2000)] | None = Field(
        description="Where events are POSTed: http(s), to a public address (private, loopback "
        "and link-local destinations are refused unless the operator allows them)."
    )
    secret: str | None = Field(
        None,
        min_length=16,
        max_length=200,
        description="The signing secret: `whsec_` and the base64 of 24 to 64 bytes (Standard "
        'Webhooks), or 16 to 200 characters of anything else, used as `"whsec_" + '
        "base64(secret)`.",
    )

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        return None if value is None else webhooks.check_secret(value)


class WebhookConfigResponse(BaseModel):
    url: str | None
    has_secret: bool


_OUTCOME = re.compile(r"HTTP \d{3}|refused: [a-z ]+|[A-Za-z]+")


def _outcome(value: str | None) -> str | None:
    """Only a status or an error class: rows written before bodies stopped being stored
    (``HTTP 500: <body>``, ``ConnectError: <message>``) show their first words."""
    if value is None or _OUTCOME.fullmatch(value):
        return value
    match = _OUTCOME.match(value)
    return match.group(0) if match else None


class DeliveryResponse(BaseModel):
    id: int = Field(description="The delivery id, sent as `webhook-id` on every attempt.")
    event_id: int
    url: str
    status: str = Field(description="pending, delivered or failed.")
    attempts: int
    last_status_code: int | None
    last_error: Annotated[str | None, AfterValidator(_outcome)] = Field(
        description="The last failure: `HTTP <code>`, an error class such as `ConnectTimeout`, "
        "or `refused: <reason>`. Never what the destination answered."
    )
    updated_at: datetime


class EventResponse(BaseModel):
    id: int
    kind: str
    bid_id: int
    node_id: int
    allocation_id: int
    payload: dict
    created_at: datetime


class EventsPage(BaseModel):
    events: list[EventResponse]
    cursor: int = Field(description="Pass as `after` to wait for the next events.")


LedgerResponse.model_rebuild()
