"""The ledger: credits and compensations (entries), and what each allocation was charged."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field

from prefect_spotgpu.messages import LedgerEntryResponse as LedgerEntryResponse
from prefect_spotgpu.service.schemas.fields import Strict, whole_micros


class CreditCreate(Strict):
    amount: Annotated[
        float,
        Field(
            gt=0,
            le=1e9,
            allow_inf_nan=False,
            strict=True,
            description="Units, six decimals at most.",
        ),
        AfterValidator(whole_micros),
    ]
    reason: str = Field(min_length=1, max_length=500)


class LedgerCursors(BaseModel):
    """Where each of the ledger's lists goes on (the query parameters of the next page);
    null where that list has ended."""

    before: int | None
    charges_before: int | None


class AllocationCharge(BaseModel):
    allocation_id: int
    bid_id: int
    gpu_count: int
    charged_amount: float
    charged_micros: int
    charged_seconds: float
    status: str


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
