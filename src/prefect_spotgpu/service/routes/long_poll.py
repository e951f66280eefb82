"""The long poll behind every ``.../events`` route (a bid's, a tenant's, a node agent's).

The events after a cursor, as soon as there is one: the route waits up to its ``timeout``
without busy work, asking the database again only when the process's event watcher
(:mod:`~prefect_spotgpu.service.event_watch`) has seen an event id above what this poll has
seen, and answers an empty page with the same cursor when the time is up or the client has
gone (checked every ``DISCONNECT_CHECK_SECONDS``).

A poll holds a slot of its caller (the tenant, or the node agent) and of its client address
for as long as it waits (``service.fairness``): beyond ``long_polls_per_caller`` or
``long_polls_per_address`` at once, a 429 with ``Retry-After``, and a slot is given back
however the poll ends.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.service import crud, schemas
from prefect_spotgpu.service.event_watch import EventWatch
from prefect_spotgpu.service.fairness import FairShares, client_address, holding
from prefect_spotgpu.service.models import BidRow

DISCONNECT_CHECK_SECONDS = 1.0


async def long_poll(
    request: Request, db: sessionmaker[Session], after: int, timeout: float, **where
) -> dict:
    """Events after ``after`` (of ``where``: a ``bid_id``, ``bid_ids``, ``tenant_id`` or
    ``node_id``); waits up to ``timeout`` s for the first one."""
    watch: EventWatch = request.app.state.event_watch
    shares: FairShares = request.app.state.fair_shares

    def query():
        with db.begin() as session:
            return [
                schemas.EventResponse.model_validate(e, from_attributes=True)
                for e in crud.events_after(session=session, after=after, **where)
            ]

    caller = await _caller(db, where)
    slots = [
        (shares.long_polls_by_caller, caller),
        (shares.long_polls_by_address, client_address(request)),
    ]
    with holding(slots, what="long-polls", names=("caller", "client address")):
        deadline = time.monotonic() + timeout
        while True:
            seen = max(after, watch.newest)  # before the query: it sees every event up to it
            events = await run_in_threadpool(query)
            if events:
                return {"events": events, "cursor": events[-1].id}
            while watch.newest <= seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or await request.is_disconnected():
                    return {"events": [], "cursor": after}
                await watch.wait_past(seen, min(remaining, DISCONNECT_CHECK_SECONDS))


async def _caller(db: sessionmaker[Session], where: dict) -> tuple[str, int]:
    """Whose slot a poll takes: ``("tenant", id)`` or ``("node", id)`` (a bid's poll: its
    tenant's, one indexed read)."""
    if where.get("tenant_id") is not None:
        return "tenant", where["tenant_id"]
    if where.get("node_id") is not None:
        return "node", where["node_id"]
    bid_id = where["bid_id"] if where.get("bid_id") is not None else where["bid_ids"][0]

    def tenant_of_bid() -> int:
        with db.begin() as session:
            return session.scalar(select(BidRow.tenant_id).where(BidRow.id == bid_id))

    return "tenant", await run_in_threadpool(tenant_of_bid)
