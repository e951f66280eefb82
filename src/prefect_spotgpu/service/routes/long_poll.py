"""The long poll behind every ``.../events`` route (a bid's, a tenant's, a node agent's).

The events after a cursor, as soon as there is one: the route waits up to its ``timeout``
without busy work, asking the database again when this process's tick leader commits (the
``Notifier``'s version changes) and twice a second (another replica may lead), and answers
an empty page with the same cursor when the time is up or the client has gone.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.service import crud, schemas
from prefect_spotgpu.service.ticker import Notifier


async def long_poll(
    request: Request, db: sessionmaker[Session], after: int, timeout: float, **where
) -> dict:
    """Events after ``after`` (of ``where``: a ``bid_id``, ``tenant_id`` or ``node_id``);
    waits up to ``timeout`` s for the first one."""
    notifier: Notifier = request.app.state.notifier

    def query():
        with db.begin() as session:
            return [
                schemas.EventResponse.model_validate(e, from_attributes=True)
                for e in crud.events_after(session=session, after=after, **where)
            ]

    deadline = time.monotonic() + timeout
    while True:
        seen = notifier.version
        events = await run_in_threadpool(query)
        if events:
            return {"events": events, "cursor": events[-1].id}
        last_check = time.monotonic()
        while notifier.version == seen and time.monotonic() - last_check < 0.5:
            if time.monotonic() >= deadline or await request.is_disconnected():
                return {"events": [], "cursor": after}
            await asyncio.sleep(0.05)
        if time.monotonic() >= deadline:
            return {"events": [], "cursor": after}
