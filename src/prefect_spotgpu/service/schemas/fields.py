"""The fields every body shares: GPU model, region, price, GPU count, capacity, name, and
``Strict``, the base of every request body. Each reuses the market's own check, so a bad
value is a 422 that names its field.

Every number of a request body is strict (``strict=True``): ``true`` or ``"1"`` is refused
with a 422 naming the field, never read as 1. JSON does not tell 2 from 2.0, so a float field
takes an integer; an integer field takes only an integer."""

from __future__ import annotations

from typing import Annotated, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from prefect_spotgpu.market import DEFAULT_CATALOG, MAX_GPUS_PER_NODE
from prefect_spotgpu.market.checks import check_region
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


def _bad_character(value) -> str | None:
    """What of ``value`` (its strings, its keys, nested) no database can store: a NUL, which
    PostgreSQL refuses, or a lone surrogate (JSON's ``"\\ud800"``), which is no UTF-8."""
    if isinstance(value, str):
        if "\x00" in value:
            return "NUL characters"
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "lone surrogates (\\ud800-\\udfff)"
        return None
    if isinstance(value, dict):
        items = (x for kv in value.items() for x in kv)
        return next(filter(None, map(_bad_character, items)), None)
    if isinstance(value, list | tuple):
        return next(filter(None, map(_bad_character, value)), None)
    return None


def _holds_bodies(annotation) -> bool:
    """Whether a field's type holds request bodies of their own (``list[BidCreate]``): they
    check their own strings, so an error names the item (``bids.2.job.command``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_bodies(arg) for arg in get_args(annotation))


class Strict(BaseModel):
    """Request bodies: unknown fields, NUL characters and lone surrogates (which no database
    stores) are refused with a 422 naming the field. A field typed as a ``protocol`` enum is
    checked against it and kept as its plain string (``use_enum_values``), as the wire spells
    it."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bad_characters(cls, value, info: ValidationInfo):
        if _holds_bodies(cls.model_fields[info.field_name].annotation):
            return value
        bad = _bad_character(value)
        if bad is not None:
            raise ValueError(f"must not contain {bad}")
        return value
