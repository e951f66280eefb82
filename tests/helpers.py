"""Helpers that several test modules share (plain functions, not fixtures)."""

from __future__ import annotations

import httpx


def post_streamed_oversized(service, headers) -> httpx.Response:
    """A 2.5 MB bid body streamed without a Content-Length: refused as soon as what arrived
    passes the limit."""

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    return httpx.post(
        service.base_url + "/api/v1/bids",
        content=chunks(),
        headers={**headers, "content-type": "application/json"},
        timeout=30,
    )


def assignment(allocation_id: int, **fields):
    """An allocation as a node's agent reads it (``messages.Assignment``), running, with the
    fields a test does not name filled in."""
    from prefect_spotgpu.messages import Assignment

    defaults = {
        "id": allocation_id,
        "bid_id": 1,
        "node_id": 1,
        "gpu_count": 1,
        "status": "running",
        "epoch": 1,
        "kind": "spot",
        "started_at": 0.0,
        "charged_until": 0.0,
        "price": 1.0,
        "deadline": None,
        "notice_reason": None,
        "charged_amount": 0.0,
        "charged_micros": 0,
        "charged_seconds": 0.0,
        "last_checkpoint_at": None,
        "final_save": None,
        "ended_at": None,
        "end_reason": None,
        "tenant_id": 1,
        "checkpoint_key": f"bid-{fields.get('bid_id', 1)}",
    }
    return Assignment.model_validate({**defaults, **fields})


_event_ids = iter(range(1, 10**9))


def bid_event(kind: str, alloc: int, bid: int = 7, node: int = 1, **payload):
    """One event of a bid as the worker reads it (``messages.EventResponse``)."""
    from datetime import UTC, datetime

    from prefect_spotgpu.messages import EventResponse

    return EventResponse(
        id=next(_event_ids),
        kind=kind,
        bid_id=bid,
        node_id=node,
        allocation_id=alloc,
        payload=payload,
        created_at=datetime(2026, 12, 1, tzinfo=UTC),
    )
