"""Prices: every pool's quote (shared with the clients: ``prefect_spotgpu.messages``), its price
history, and a request for the cost estimator (its reply shared too)."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field, model_validator

from prefect_spotgpu.messages import EstimateResponse as EstimateResponse
from prefect_spotgpu.messages import QuoteResponse as QuoteResponse
from prefect_spotgpu.service.schemas.fields import GpuCount, GpuModelName, Price, Region, Strict


class PriceBarResponse(BaseModel):
    minute: datetime
    open: float
    high: float
    low: float
    close: float
    seconds: int = Field(
        60,
        description="The bar's width: 60 (a minute), or 3600 (an hour: minute bars older than "
        "the minute bars' retention are folded into hourly ones).",
    )


class EstimateRequest(Strict):
    gpu_model: GpuModelName
    region: Region = "any"
    gpu_hours: float = Field(gt=0, le=1e6, allow_inf_nan=False, strict=True)
    gpus: GpuCount = 1
    max_price: Price
    start: datetime | None = Field(None, description="Not before (default: now).")
    deadline: datetime

    @model_validator(mode="after")
    def _deadline_after_start(self) -> EstimateRequest:
        for name in ("start", "deadline"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"{name} needs a timezone")
        start = self.start or datetime.now(UTC)
        if self.deadline <= start:
            raise ValueError("deadline must be after the start")
        if (self.deadline - start).total_seconds() > 90 * 86400:
            raise ValueError("deadline must be within 90 days of the start")
        return self
