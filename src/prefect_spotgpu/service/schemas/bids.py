"""Bids: what a tenant asks for (GPUs, a price, a window, a job to run) and the events of each
(the replies are shared with the clients: ``prefect_spotgpu.messages``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from prefect_spotgpu import messages
from prefect_spotgpu.market.checks import MAX_GANG_NODES
from prefect_spotgpu.messages import BidBatchResponse as BidBatchResponse
from prefect_spotgpu.messages import BidResponse as BidResponse
from prefect_spotgpu.messages import EventResponse as EventResponse
from prefect_spotgpu.messages import EventsPage as EventsPage
from prefect_spotgpu.protocol import MAX_BIDS_PER_BATCH
from prefect_spotgpu.service.schemas.fields import (
    CapacityKind,
    GpuCount,
    GpuModelName,
    Price,
    Region,
    Strict,
    fixed_price,
)
from prefect_spotgpu.service.schemas.images import ImageReference


class JobSpec(Strict, messages.JobSpec):
    """What the node agent runs for an allocation: a command, or an image with a command
    (``messages.JobSpec``, with the service's checks)."""

    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=256, examples=[["python", "-m", "prefect.engine"]]
    )
    env: dict[
        Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=200)],
        Annotated[str, Field(max_length=65536)],
    ] = Field(default_factory=dict, max_length=256)
    image: ImageReference | None = Field(
        None,
        description="Container image (Docker runner), from the market's catalogue "
        "(GET /images): its name or its reference. None: a process.",
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


NodeCount = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_GANG_NODES,
        strict=True,
        description="How many nodes the job spans: above 1, a gang of that many member bids "
        "(ranks 0..n-1), each for gpu_count GPUs on its own node of one pool; at most "
        f"{MAX_GANG_NODES}, and no more than the pool's registered nodes.",
    ),
]


class BidCreate(Strict, messages.BidRequest):
    """A new bid (``messages.BidRequest``, with the service's checks)."""

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
    node_count: NodeCount = 1
    min_node_count: int | None = Field(
        None,
        ge=1,
        le=MAX_GANG_NODES,
        strict=True,
        description="A gang that may go on smaller: the fewest of its node_count nodes it runs "
        "on when no replacement is free (its flow must reshard its checkpoint, as "
        "DistributedCheckpointer does). Null: all of them, always.",
    )

    @model_validator(mode="after")
    def _on_demand_pays_the_on_demand_price(self) -> BidCreate:
        self.max_price = fixed_price(self.capacity, self.max_price, self.gpu_model, "max_price")
        return self

    @field_validator("min_node_count")
    @classmethod
    def _min_node_count_within_the_gang(cls, value: int | None, info: ValidationInfo):
        nodes = info.data.get("node_count")  # (absent when node_count itself was refused)
        if value is not None and nodes is not None and value > nodes:
            raise ValueError(
                f"min_node_count {value} is more than node_count {nodes}: give at most "
                "node_count, or leave it out"
            )
        return value

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


# MAX_BIDS_PER_BATCH (protocol): the body limit still holds, and about 2 KB of job
# environment a bid fits 500 in a request


class BidBatchCreate(Strict):
    """Many bids at once: written all together or not at all (``service/bulk_bids.py``)."""

    bids: list[BidCreate] = Field(
        min_length=1,
        max_length=MAX_BIDS_PER_BATCH,
        description=f"The bids, 1 to {MAX_BIDS_PER_BATCH}; each as for POST /bids, with its "
        "own idempotency key (recommended: a retried batch then writes only what is missing).",
    )


class BidUpdate(Strict):
    max_price: Price


def bid_response(bid, members: list[int] | None = None) -> BidResponse:
    """A bid row as its ``BidResponse`` (its job's environment values left out), with its
    gang's ``members`` (rank order) when it is a gang member."""
    response = BidResponse.model_validate(bid, from_attributes=True)
    response.members = list(members or [])
    return response
