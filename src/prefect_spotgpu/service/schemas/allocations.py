"""Allocations: GPUs on one node held for one bid, as tenants and node agents see them (the
replies are shared with the clients: ``prefect_spotgpu.messages``), and what an agent reports
of one."""

from __future__ import annotations

from prefect_spotgpu import messages
from prefect_spotgpu.messages import AllocationResponse as AllocationResponse
from prefect_spotgpu.messages import Assignment as Assignment
from prefect_spotgpu.service.schemas.fields import Strict


class AllocationReport(Strict, messages.AllocationReport):
    """What a node agent reports about an allocation (``messages.AllocationReport``, the
    agent's own), as the service takes it: unknown fields and bad characters refused."""


def allocation_response(alloc, rank: int | None = None) -> AllocationResponse:
    """An allocation row as its ``AllocationResponse`` (``rank``: its bid's in a gang)."""
    response = AllocationResponse.model_validate(alloc, from_attributes=True)
    response.rank = rank
    return response
