"""What a node agent may say about its GPUs: the inventory it registers with and the telemetry
of each heartbeat. A schema, never any JSON: the telemetry is shown to anonymous visitors of
the dashboard, so every field is a bounded number or a short string of plain characters
(letters, digits, space and ``._:()+/-``), unknown fields are refused, and a bad field is a 422
that names it (a number is strict: ``true`` or ``"1"`` is no number).

The shapes are the agent's own (``agent/discovery.py``): an inventory item is
``GpuInfo.to_json()``, a heartbeat's telemetry is ``{"jobs", "declared", "gpus"}`` with
``telemetry_nvml()``'s entries as ``gpus``. A reading NVML could not take is ``null`` (the
service stores it left out).

>>> Telemetry.model_validate(
...     {"jobs": 1, "gpus": [{"index": 0, "utilization": 87, "power_w": 301.5}]}
... ).gpus[0].utilization
87.0

Telemetry stored before this schema is checked again on its way out (``public_gpus``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prefect_spotgpu.market import MAX_GPUS_PER_NODE

PLAIN_TEXT = r"^[A-Za-z0-9 ._:()+/-]*$"
"""The characters a GPU's name, uuid or driver version may use: never markup, never quotes."""

MAX_MEMORY_MB = 1 << 20  # 1 TiB on one GPU
MAX_POWER_W = 5_000.0
MAX_JOBS = 1_000

Text = Annotated[str, Field(max_length=100, pattern=PLAIN_TEXT)]
GpuIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE, strict=True)]
MemoryMb = Annotated[int, Field(ge=0, le=MAX_MEMORY_MB, strict=True)]
ThrottleReason = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")]


def _reading(low: float, high: float, description: str):
    """A finite measurement between ``low`` and ``high``; ``None`` where the GPU did not say."""
    return Annotated[
        float | None,
        Field(None, ge=low, le=high, allow_inf_nan=False, strict=True, description=description),
    ]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuInventoryItem(_Closed):
    """One GPU as the agent registers it (``GpuInfo.to_json()``)."""

    index: GpuIndex
    model: Text = Field(min_length=1, description="The market's canonical model, e.g. A100-80G.")
    name: Text = Field(description="As the driver reports it, e.g. NVIDIA A100-SXM4-80GB.")
    uuid: Text
    memory_mb: MemoryMb
    driver: Text | None = None
    mig_mode: bool | None = None
    ecc_errors: int | None = Field(None, ge=0, le=1 << 53, strict=True)
    throttle_reasons: list[ThrottleReason] = Field(default_factory=list, max_length=32)


class GpuTelemetry(_Closed):
    """One GPU's readings in a heartbeat (an entry of ``telemetry_nvml()``)."""

    index: GpuIndex
    utilization: _reading(0, 100, "Percent of time the GPU was busy.")
    memory_used_mb: MemoryMb | None = None
    power_w: _reading(0, MAX_POWER_W, "Power draw, watts.")
    temperature_c: _reading(-50, 200, "Core temperature, degrees Celsius.")


class Telemetry(_Closed):
    """A heartbeat's telemetry: jobs running, whether the inventory was declared, each GPU."""

    jobs: int | None = Field(None, ge=0, le=MAX_JOBS, strict=True)
    declared: bool | None = None
    gpus: list[GpuTelemetry] | None = Field(None, max_length=MAX_GPUS_PER_NODE)

    @field_validator("gpus")
    @classmethod
    def _one_entry_per_gpu(cls, gpus: list[GpuTelemetry] | None) -> list[GpuTelemetry] | None:
        indexes = [g.index for g in gpus or ()]
        if len(set(indexes)) != len(indexes):
            raise ValueError("each GPU index at most once")
        return gpus


def public_gpus(telemetry: dict | None) -> list[dict]:
    """The GPU readings of a stored telemetry that pass the schema, every field present
    (``None`` where not reported); anything else (stored before the schema) is left out."""
    gpus = telemetry.get("gpus") if isinstance(telemetry, dict) else None
    out = []
    for gpu in gpus if isinstance(gpus, list) else ():
        try:
            out.append(GpuTelemetry.model_validate(gpu).model_dump(mode="json"))
        except ValidationError:
            continue
    return out[:MAX_GPUS_PER_NODE]
