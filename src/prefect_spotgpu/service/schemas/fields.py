"""The fields every body shares: GPU model, region, price, GPU count, capacity, name, and
``Strict``, the base of every request body. Each reuses the market's own check, so a bad
value is a 422 that names its field.

Every number of a request body is strict (``strict=True``): ``true`` or ``"1"`` is refused
with a 422 naming the field, never read as 1. JSON does not tell 2 from 2.0, so a float field
takes an integer; an integer field takes only an integer."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from prefect_spotgpu.market import DEFAULT_CATALOG, MAX_GPUS_PER_NODE
from prefect_spotgpu.market.types import check_region
from prefect_spotgpu.protocol import Capacity


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


def whole_micros(value: float) -> float:
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
        strict=True,
        description="Per GPU-hour, one currency unit, at most six decimals (rounded to them).",
    ),
    AfterValidator(whole_micros),
]
GpuCount = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE, strict=True)]
CapacityKind = Annotated[
    Capacity,
    Field(
        description="spot: idle GPUs, auctioned every second, preemptible with a notice; "
        "on_demand: non-preemptible GPUs at the model's on-demand price."
    ),
]
Name = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


def fixed_price(
    capacity: str, price: float | None, gpu_model: str, name: str, *, exact: bool = False
) -> float:
    """A spot price as given (required); on-demand capacity trades at the catalog's on-demand
    price, so ``price`` may be left out, and a given one must not disagree with it."""
    if capacity == Capacity.SPOT:
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
    refused with a 422 naming the field. A field typed as a ``protocol`` enum is checked
    against it and kept as its plain string (``use_enum_values``), as the wire spells it."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value):
        if _has_nul(value):
            raise ValueError("must not contain NUL characters")
        return value
