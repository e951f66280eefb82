"""Nodes: the GPUs a provider offers, what its agent reports with each heartbeat, and its token
(the replies are shared with the clients: ``prefect_spotgpu.messages``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from prefect_spotgpu import messages
from prefect_spotgpu.market import MAX_GPUS_PER_NODE
from prefect_spotgpu.messages import NodeCreated as NodeCreated
from prefect_spotgpu.messages import NodeResponse as NodeResponse
from prefect_spotgpu.messages import NodeToken as NodeToken
from prefect_spotgpu.protocol import (
    MAX_NODE_IMAGES,
    NODE_ADDRESS_PATTERN,
    REPORT_DETAIL_CHARS,
    Runner,
    unfit_job_subnet,
    unfit_node_address,
)
from prefect_spotgpu.service.schemas.fields import (
    CapacityKind,
    GpuCount,
    GpuModelName,
    Name,
    NodeRegion,
    Price,
    Strict,
    fixed_price,
)
from prefect_spotgpu.service.schemas.images import ImageReference, PlainLine
from prefect_spotgpu.service.telemetry import GpuInventoryItem, Telemetry

NodeAddress = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        pattern=NODE_ADDRESS_PATTERN,
        examples=["10.0.0.7"],
        description="The IP or hostname other nodes reach this node at (a gang's rank 0 "
        "node's is the gang's MASTER_ADDR); never link-local, multicast or unspecified.",
    ),
    AfterValidator(lambda address: _fit_node_address(address)),
]


def _fit_node_address(address: str) -> str:
    if why := unfit_node_address(address):
        raise ValueError(f"{address!r} is {why}")
    return address


def _fit_job_subnet(subnet: str) -> str:
    if why := unfit_job_subnet(subnet):
        raise ValueError(f"{subnet!r} is {why}")
    return subnet


JobSubnet = Annotated[
    str,
    Field(
        min_length=9,
        max_length=18,
        pattern=r"^[0-9./]+$",
        examples=["10.88.3.0/24"],
        description="A Docker node's job network: a private IPv4 subnet, /16 to /24, that the "
        "operator routes to this node from the other GPU hosts. Its containers get addresses "
        "there and a gang's members reach each other there (None: Docker's default bridge, "
        "and no gang member runs here).",
    ),
    AfterValidator(_fit_job_subnet),
]


class RunnerTerms(Strict, messages.RunnerTerms):
    """How a node's agent runs jobs (``market.Runner``), as it says when it registers and with
    every heartbeat (None: not said; at registration, a node that serves any bid)."""

    runner: Runner | None = Field(
        None,
        description="process (bids without an image) or docker (bids with one; without one "
        "only in default_image).",
    )
    default_image: ImageReference | None = Field(
        None, description="A Docker node's image for bids without one (runner docker only)."
    )
    job_subnet: JobSubnet | None = None

    @model_validator(mode="after")
    def _default_image_is_a_docker_nodes(self) -> RunnerTerms:
        for name in ("default_image", "job_subnet"):
            if getattr(self, name) is not None and self.runner != Runner.DOCKER:
                raise ValueError(f"{name} needs runner 'docker': a process node runs no image")
        return self


class NodeCreate(RunnerTerms, messages.NodeRegistration):
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
    address: NodeAddress | None = None

    @model_validator(mode="after")
    def _on_demand_sells_at_the_on_demand_price(self) -> NodeCreate:
        self.reserve_price = fixed_price(
            self.capacity, self.reserve_price, self.gpu_model, "reserve_price", exact=True
        )
        return self


class NodeUpdate(Strict):
    reserve_price: Price | None = None
    state: Literal["live", "draining", "reclaimed"] | None = None

    @model_validator(mode="after")
    def _changes_something(self) -> NodeUpdate:
        if self.reserve_price is None and self.state is None:
            raise ValueError("give reserve_price or state")
        return self


class NodeDrain(Strict):
    """Why a node's agent drains its own node (``POST /nodes/{node_id}/drain``): its jobs
    could not start, several in a row."""

    reason: PlainLine = Field(
        min_length=1,
        max_length=REPORT_DETAIL_CHARS,
        description="One line of plain text: what kept the jobs from starting.",
    )


def node_response(node) -> NodeResponse:
    """A node row as its ``NodeResponse``."""
    return NodeResponse.model_validate(node, from_attributes=True)


class Heartbeat(RunnerTerms, messages.Heartbeat):
    telemetry: Telemetry | None = None
    images: list[ImageReference] | None = Field(
        None,
        max_length=MAX_NODE_IMAGES,
        description="The image references the node holds locally (None: unchanged). Placement "
        "prefers, among equal fits, a node that already has a bid's image.",
    )
    address: NodeAddress | None = Field(None, description="The node's address (None: unchanged).")
