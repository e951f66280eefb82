"""Allocations: GPUs on one node held for one bid, as tenants and node agents see them, and
what an agent reports of one."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from prefect_spotgpu.protocol import REPORT_DETAIL_CHARS, ReportOutcome
from prefect_spotgpu.service.schemas.fields import Strict


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
    rank: int | None = Field(None, description="A gang member's rank (None: a one-node bid).")


class Assignment(AllocationResponse):
    """An allocation as its node agent sees it: with the job to run (its environment opened,
    only while the allocation runs on this node), and for a gang member where its gang meets."""

    tenant_id: int
    job: dict | None = None
    checkpoint_key: str
    gang: dict | None = Field(
        None,
        description="A gang member's place in its gang: rank, world_size, master_addr "
        "(rank 0's node's address), master_port, gpus_per_node and lead_allocation (rank 0's "
        "allocation of the same attempt); None for a one-node bid.",
    )


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
