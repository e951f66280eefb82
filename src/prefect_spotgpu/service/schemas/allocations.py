"""Allocations: GPUs on one node held for one bid, as tenants and node agents see them (the
replies are shared with the clients: ``prefect_spotgpu.messages``), and what an agent reports
of one."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefect_spotgpu.messages import AllocationResponse as AllocationResponse
from prefect_spotgpu.messages import Assignment as Assignment
from prefect_spotgpu.protocol import REPORT_DETAIL_CHARS, ReportOutcome
from prefect_spotgpu.service.schemas.fields import Strict


class AllocationReport(Strict):
    """What a node agent (or a worker) reports about an allocation, fenced by its epoch."""

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


def allocation_response(alloc, rank: int | None = None) -> AllocationResponse:
    """An allocation row as its ``AllocationResponse`` (``rank``: its bid's in a gang)."""
    response = AllocationResponse.model_validate(alloc, from_attributes=True)
    response.rank = rank
    return response
