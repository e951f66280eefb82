"""The replies the market service sends to its own clients (node agents, the worker), as
pydantic models all three import: the service declares them as its response models, and the
clients parse what they read into them instead of reading dicts by string keys.

Wire compatibility: a field a newer service adds is ignored by an older client (pydantic's
default ``extra="ignore"``), and a field a client needs that a reply lacks fails the parse
naming it (``pydantic.ValidationError``), never a ``KeyError`` deep in the client. An event's
``payload`` stays a mapping: its keys depend on the event's kind (``protocol.EventKind``).

Imports only pydantic and ``protocol`` (``tests/test_architecture.py``), so the agent and the
worker may use it without the service's dependencies.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class AllocationResponse(BaseModel):
    """An allocation: GPUs on one node held for one bid."""

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


class AssignedJob(BaseModel):
    """The job a node runs for an allocation (the bid's ``JobSpec``, its environment opened)."""

    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    checkpoint_url: str | None = None


class Assignment(AllocationResponse):
    """An allocation as its node agent sees it: with the job to run (its environment opened,
    only while the allocation runs on this node), and for a gang member where its gang meets."""

    tenant_id: int
    job: AssignedJob | None = None
    checkpoint_key: str
    gang: dict | None = Field(
        None,
        description="A gang member's place in its gang: rank, world_size, master_addr "
        "(rank 0's node's address), master_port, gpus_per_node and lead_allocation (rank 0's "
        "allocation of the same attempt); None for a one-node bid. The agent checks it "
        "(a malformed one fails that allocation, saying why, not the node's every reply).",
    )


class EventResponse(BaseModel):
    """One event of a bid (and of the node that holds its allocation)."""

    id: int
    kind: str
    bid_id: int
    node_id: int
    allocation_id: int
    payload: dict
    created_at: datetime


class EventsPage(BaseModel):
    """A page of events, and where the next long-poll starts."""

    events: list[EventResponse]
    cursor: int = Field(description="Pass as `after` to wait for the next events.")
