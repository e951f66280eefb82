"""The configuration of the Prefect worker type ``spot-gpu``.

One pydantic model (docs/development/code-style.md#style-6), as prefect-docker's: each job
variable is declared once, in ``SpotGPUJobConfiguration``, whose titles, descriptions and
``Literal`` choices are the form the Prefect UI shows for a work pool or deployment, and whose
values are what a flow run gets after templating. Each cross-field rule is one named
``model_validator``. The worker that uses them is
``prefect_spotgpu.worker.SpotGPUWorker``.
"""

from __future__ import annotations

import hashlib
import hmac
import shlex
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from prefect.settings import PREFECT_API_URL
from prefect.workers.base import BaseJobConfiguration
from pydantic import Field, ValidationError, WithJsonSchema, field_validator, model_validator

from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket
from prefect_spotgpu.economics.policies import get_policy
from prefect_spotgpu.economics.schedules import aware, zone
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.market.checks import MAX_GANG_NODES, check_node_count
from prefect_spotgpu.messages import ImageResponse, JobSpec
from prefect_spotgpu.protocol import (
    IMAGE_BUILD_COMMAND,
    IMAGE_REFERENCE_PATTERN,
    JOB_ENV,
    PROCESS_IMAGE,
)
from prefect_spotgpu.worker.pacing import Pace

PolicyChoice = Literal["deadline-aware", "uniform-progress", "greedy-spot", "always-on-demand"]
"""The bidding policies of ``prefect_spotgpu.economics.deadline``
(``tests/test_worker.py`` checks)."""

GpuModelChoice = Literal["RTX-4090", "RTX-3090Ti", "A100-80G", "H100-80G", "H200"]
"""The catalogue's models, as the UI's choices (``tests/test_worker.py`` keeps them in step)."""

LAUNCH_COMMAND = "python -m prefect_spotgpu.launch"
"""The job every allocation starts: waits for the worker's go, then execs the Prefect engine
(``python`` is the agent's own interpreter for the process runner, the image's in a container)."""


ImageName = Annotated[
    Literal["process"], WithJsonSchema({"enum": [PROCESS_IMAGE], "type": "string"})
]
"""The default form's one choice (an ``enum``, which ``spotgpu pool setup`` extends with the
market's flow-ready images, ``runs_flows``): the seeded catalogue's images are bases that run
only a job's own command, never a flow."""
SEEDED_IMAGES: tuple[str, ...] = (
    "pytorch",
    "pytorch-devel",
    "ngc-pytorch",
    "tensorrt",
    "huggingface",
    "stable-diffusion",
)
"""The names the market's catalogue is seeded with, as command-only bases (the operator's to
change: ``spotgpu admin image build NAME`` makes one flow-ready; ``GET /api/v1/images`` has the
real list)."""
ImageReference = Annotated[str, Field(pattern=IMAGE_REFERENCE_PATTERN)]
"""The reference of a catalogue image (``repo/name:tag``), or another name of it."""


class SpotGPUJobConfiguration(BaseJobConfiguration):
    """What one flow run asks of the market, after templating; and, field for field, the work
    pool's and deployments' form in the Prefect UI (the worker declares no separate variables
    model, so Prefect derives the form from this one: titles, descriptions, choices)."""

    market: SpotMarket | None = Field(
        default=None,
        title="Market",
        description="The Spot Market block: the service's URL and your API key.",
    )
    gpu_model: GpuModelChoice = Field(
        default="A100-80G",
        title="GPU model",
        description="The GPU model to bid for; on-demand prices: RTX-4090 0.68, RTX-3090Ti "
        "0.52, A100-80G 2.10, H100-80G 3.80, H200 4.50 per GPU-hour. Other spellings the "
        "market knows (nvidia h200) are normalised to these names.",
    )
    gpu_count: int = Field(
        default=1, ge=1, le=16, title="GPUs", description="GPUs on one node (1-16)."
    )
    node_count: int = Field(
        default=1,
        ge=1,
        le=MAX_GANG_NODES,
        strict=True,
        title="Nodes",
        description=f"Nodes the run takes at once (1-{MAX_GANG_NODES}), each with the GPUs "
        "above: a gang, placed all or nothing. Rank 0 runs the flow run; the others run the "
        "flow's function with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun's "
        "environment).",
    )
    min_node_count: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GANG_NODES,
        strict=True,
        title="Fewest nodes",
        description="A gang that may go on smaller: when a member's node is taken back and no "
        "replacement is free, the run resumes on at least this many of its nodes instead of "
        "waiting for all of them (WORLD_SIZE says how many). Its flow must load its checkpoint "
        "on another world size: DistributedCheckpointer does. Empty: all of them, always.",
    )
    max_price: float = Field(
        default=1.2,
        gt=0,
        title="Maximum price",
        description="The most you pay per GPU-hour; you pay the market's "
        "clearing price, never more than this.",
    )
    region: str = Field(
        default="any", title="Region", description="A region such as eu-west, or 'any'."
    )
    image: ImageName | ImageReference = Field(
        default=PROCESS_IMAGE,
        title="Image",
        description="Named environment from the market's image catalogue (a container), or "
        "'process' to run on the node without a container; or the reference of a catalogue "
        "image (repo/name:tag). The operator keeps the catalogue: GET /api/v1/images.",
    )
    cheap_window_only: bool = Field(
        default=False,
        title="Cheap window only",
        description="Run only 18:00-09:00 on weekdays and at weekends; the run pauses "
        "(checkpoint, stop) when the window closes.",
    )
    timezone: str = Field(
        default="UTC",
        title="Timezone",
        description="IANA timezone of the cheap window's hours, e.g. Europe/Berlin.",
    )
    gpu_hours: float | None = Field(
        default=None,
        gt=0,
        title="GPU-hours of work",
        description="How long the work runs on its GPUs. With a deadline, a bidding policy "
        "paces it: spot while on schedule, a higher bid when behind, on-demand when the "
        "slack can no longer absorb a restart.",
    )
    deadline: datetime | None = Field(
        default=None, title="Deadline", description="When the work must be finished."
    )
    deadline_hours: float | None = Field(
        default=None,
        gt=0,
        title="Deadline (hours)",
        description="Or: hours after the run's scheduled start by which it must finish "
        "(for scheduled deployments).",
    )
    bidding_policy: PolicyChoice = Field(
        default="uniform-progress",
        title="Bidding policy",
        description="deadline-aware: reads every region's quote, runs where capacity is at the "
        "best price, keeps what it holds, on-demand only when the slack is gone; "
        "uniform-progress: spot while on pace, bid up when behind, on-demand at "
        "the end; greedy-spot: spot at the maximum price until the deadline forces on-demand; "
        "always-on-demand: the baseline.",
    )
    restart_minutes: float = Field(
        default=5.0,
        ge=0,
        title="Restart overhead (minutes)",
        description="Time each (re)start loses: node start, image, checkpoint restore.",
    )
    on_demand_fallback: bool = Field(
        default=True,
        title="On-demand fallback",
        description="With a deadline: move to on-demand capacity (never outbid, at the "
        "on-demand price; only its owner's reclaim gives it a notice) when spot can no longer "
        "meet it.",
    )
    checkpoint_storage: CheckpointStorage | None = Field(
        default=None,
        title="Checkpoint storage",
        description="Where the flow's checkpoints go (a directory every node reaches, or S3).",
    )
    max_preemptions: int = Field(
        default=10,
        ge=0,
        title="Maximum preemptions",
        description="After this many preemptions the run fails.",
    )
    notice_webhook: str | None = Field(
        default=None,
        title="Notice webhook",
        description="A URL that also receives the market's signed notices.",
    )

    @field_validator("node_count", mode="before")
    @classmethod
    def _node_count_in_range(cls, value: object) -> int:
        return check_node_count(value)

    @field_validator("gpu_model", mode="before")
    @classmethod
    def _model_is_sold(cls, value: object) -> str:
        """Any spelling the market knows ("nvidia h200" is H200); an unknown one is refused
        naming the models it sells."""
        return DEFAULT_CATALOG.normalize(value)

    @field_validator("bidding_policy", mode="before")
    @classmethod
    def _policy_is_registered(cls, value: object) -> object:
        """The registry's error, which lists the policies, for an unknown name."""
        if isinstance(value, str):
            get_policy(value)
        return value  # anything else: the type's own error

    @field_validator("image", mode="wrap")
    @classmethod
    def _image_is_a_name_or_a_reference(cls, value: object, handler) -> str:
        """One clear error for an image, instead of pydantic's one per branch of the type."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                f"image {value!r} is neither 'process' nor an image name or reference "
                "(the market's catalogue: GET /api/v1/images)"
            ) from None

    @model_validator(mode="after")
    def _fewest_nodes_within_the_gang(self) -> SpotGPUJobConfiguration:
        if self.min_node_count is not None and self.min_node_count > self.node_count:
            raise ValueError(
                f"min_node_count {self.min_node_count} is more than node_count "
                f"{self.node_count}: give at most node_count, or leave it empty"
            )
        return self

    @model_validator(mode="after")
    def _timezone_is_known(self) -> SpotGPUJobConfiguration:
        zone(self.timezone)
        return self

    @model_validator(mode="after")
    def _one_deadline(self) -> SpotGPUJobConfiguration:
        if self.deadline is not None and self.deadline_hours is not None:
            raise ValueError("give deadline or deadline_hours, not both")
        return self

    @model_validator(mode="after")
    def _pacing_needs_work_and_a_deadline(self) -> SpotGPUJobConfiguration:
        has_deadline = self.deadline is not None or self.deadline_hours is not None
        if self.gpu_hours is not None and not has_deadline:
            raise ValueError(
                "gpu_hours needs a deadline (deadline or deadline_hours): the bidding policy "
                "paces the work to it"
            )
        if self.gpu_hours and self.deadline_hours and self.gpu_hours > self.deadline_hours:
            raise ValueError(
                f"gpu_hours ({self.gpu_hours}) cannot fit in deadline_hours ({self.deadline_hours})"
            )
        return self

    def finish_by(self, flow_run) -> datetime | None:
        """The run's deadline, absolute (``deadline``) or from its scheduled start."""
        if self.deadline is not None:
            return aware(self.deadline)
        if self.deadline_hours is not None:
            return _origin(flow_run) + timedelta(hours=self.deadline_hours)
        return None

    def pace(self, flow_run) -> Pace | None:
        """The run's deadline terms, or None for a run without ``gpu_hours``."""
        if self.gpu_hours is None:
            return None
        origin, deadline = _origin(flow_run), self.finish_by(flow_run)
        return Pace(
            gpu_hours=self.gpu_hours,
            deadline=deadline,
            origin=origin,
            policy=self.bidding_policy,
            restart_minutes=self.restart_minutes,
            cap=self.max_price,
            gpu_model=self.gpu_model,
            on_demand_fallback=self.on_demand_fallback,
            region=self.region,
            gpu_count=self.gpu_count,
        )

    def catalogue_image(self, catalogue: list[ImageResponse]) -> str | None:
        """The container image to run, from the market's catalogue (``GET /images``), or None
        to run as a process on the node. ``image`` is a catalogue name, or the reference of a
        catalogue entry; anything else is refused (ValueError) with the catalogue's names, and
        so is an entry that runs only a job's own command (``runs_flows`` false: no
        prefect-spotgpu in it), naming the images that run flows and the command that makes
        one."""
        if self.image == PROCESS_IMAGE:
            return None
        named = [e for e in catalogue if self.image in (e.name, e.reference)]
        flow_ready = [e.name for e in catalogue if e.runs_flows]
        if not named:
            names = ", ".join([PROCESS_IMAGE, *(e.name for e in catalogue)])
            raise ValueError(
                f"image {self.image!r} is not in the market's image catalogue; known images: "
                f"{names}. The operator adds images (spotgpu admin image add); nothing was bid"
            )
        for entry in named:
            if entry.runs_flows:
                return entry.reference
        entry = named[0]
        raise ValueError(
            f"image {self.image!r} ({entry.reference}) runs only a job's own command, not a "
            "flow: it holds no prefect-spotgpu. Images that run flows: "
            f"{', '.join([PROCESS_IMAGE, *flow_ready])}. The operator makes one from this "
            f"base: {IMAGE_BUILD_COMMAND} {entry.name} --wheelhouse DIR --registry HOST/PATH; "
            "nothing was bid"
        )

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, **kwargs) -> None:
        """Prefect's environment for the run, plus the API URL and the checkpoint settings;
        the command is the launcher, which becomes ``python -m prefect.engine`` on the node.

        With a market block, the checkpoint settings include the run's signing key
        (:func:`checkpoint_signing_key`): the same for every attempt of the run, so a resumed
        attempt restores only what an attempt of this run signed. It reaches the node only in
        the job's environment, which the market seals at rest. Without a market key the
        checkpoints are unsigned (and any is restored), as before signing existed."""
        super().prepare_for_flow_run(flow_run, deployment, flow, **kwargs)
        if self.command in (None, "", self._base_flow_run_command()):
            self.command = LAUNCH_COMMAND
        extra = {"PREFECT_LOGGING_EXTRA_LOGGERS": "prefect_spotgpu"}  # checkpoint saves in the UI
        api_url = PREFECT_API_URL.value()
        if api_url:
            extra["PREFECT_API_URL"] = api_url
        if self.checkpoint_storage is not None:
            extra.update(self.checkpoint_storage.job_env())
        api_key = self.market.api_key.get_secret_value() if self.market is not None else ""
        if api_key:
            extra[JOB_ENV.CHECKPOINT_SIGNING_KEY] = checkpoint_signing_key(api_key, flow_run.id)
        self.env = {**extra, **self.env}

    def job_spec(self, image: str | None = None) -> JobSpec:
        """The bid's job: what the node's agent runs (``image``: the reference
        :meth:`catalogue_image` found; None, a process)."""
        storage = self.checkpoint_storage
        return JobSpec(
            command=shlex.split(self.command or LAUNCH_COMMAND),
            env={k: str(v) for k, v in self.env.items() if v is not None},
            image=image or None,
            checkpoint_url=None if storage is None else storage.url(),
        )


def checkpoint_signing_key(api_key: str, flow_run_id) -> str:
    """The key a flow run's checkpoints are signed with (hex): HMAC-SHA256 keyed by the
    tenant's market API key over ``checkpoint-signing:<flow run id>``. Stable across the run's
    resumes; another run, or anyone without the API key, cannot compute it. Rotating the API
    key changes it: checkpoints signed before a rotation are then refused."""
    message = f"checkpoint-signing:{flow_run_id}".encode()
    return hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()


def _origin(flow_run) -> datetime:
    return aware(flow_run.expected_start_time or flow_run.created or datetime.now(UTC))


def market_of(configuration: SpotGPUJobConfiguration) -> SpotMarket:
    """The run's market block, or a clear error saying where to set one."""
    if configuration.market is None:
        raise ValueError(
            "no market: set the work pool's or deployment's 'market' variable to a Spot Market "
            "block (prefect block register -m prefect_spotgpu.blocks, then save one)"
        )
    return configuration.market


def check_storage(configuration: SpotGPUJobConfiguration) -> None:
    """Refuse, before any bid (and so any charge), a run with nowhere to keep checkpoints: its
    job would start, be billed, and fail on the node asking for its checkpoint location."""
    if configuration.checkpoint_storage is None:
        raise ValueError(
            "no checkpoint storage: set the work pool's or deployment's 'checkpoint_storage' "
            "variable to a Spot Checkpoint Storage block (spotgpu blocks save, then spotgpu "
            "pool setup POOL); nothing was bid"
        )
