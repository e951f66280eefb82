"""The market dashboard: one page served by the service, kept live by server-sent events.

``GET /dashboard`` is a static page (HTML, CSS and JavaScript from ``service/static``; nothing
is fetched from another host). Everything it shows comes from the public JSON API (the image
catalogue, ``GET /api/v1/images``, among it: read at most every 10 s, the operator changes it
by hand) plus three read-only views here:

- ``GET /api/v1/market/nodes``: every node's GPUs, state, load and telemetry, without its
  owner or name (the market's supply is public; who owns it is not);
- ``GET /api/v1/market/depth/{model}/{region}``: the pool's order book, aggregated by price
  level (GPUs waiting and GPUs held at each maximum price), anonymous;
- ``GET /api/v1/stream``: server-sent events. A ``market`` event carries every pool's quote
  whenever this process's tick leader commits new events or a changed quote, and at least
  every ``STREAM_SECONDS``; the page refreshes its views (and a signed-in tenant's own bids,
  allocations and ledger, with the tenant's key, over the ordinary API) on each one. Every
  stream of the process sends the same message, read once (``public_cache.SharedSnapshot``),
  and one client address holds at most ``streams_per_address`` open streams at once (``once``
  ones, a single read, are not held): beyond, a 429 with ``Retry-After`` (``service.fairness``).

A tenant signs in on the page with its API key; the key stays in the browser's session
storage and goes only to this service, in the ``Authorization`` header, so a tenant sees
exactly what the API shows it and nothing of anyone else's.
The page folds a gang's member bids (and their allocations) under one entry, rank 0's, from
the ordinary bid and allocation pages (``static/gangs.js``): no view here knows of gangs.

The page renders data, never markup: every value from the API goes into the page as text
(``textContent``, ``createElement``), numbers in styles and SVG attributes are coerced and
clamped, and the telemetry the page shows is checked against ``service.telemetry``'s schema on
the way in and again on the way out. Every response of the service carries a
Content-Security-Policy that runs only this host's scripts, styles and connections
(``service.hardening``): an injected string that slipped past both still could not run.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.messages import MarketNodeResponse
from prefect_spotgpu.protocol import Capacity
from prefect_spotgpu.service import crud, queries
from prefect_spotgpu.service.deps import Db
from prefect_spotgpu.service.errors import Invalid, NotFound
from prefect_spotgpu.service.fairness import FairShares, client_address, take_or_refuse
from prefect_spotgpu.service.models import PoolQuoteRow
from prefect_spotgpu.service.public_cache import SharedSnapshot
from prefect_spotgpu.service.routes.params import API
from prefect_spotgpu.service.telemetry import public_gpus

STATIC = Path(__file__).parent.parent / "static"
STREAM_SECONDS = 2.0
"""The longest the stream stays silent: a replica that does not lead the ticks still updates."""
DEPTH_LEVELS = 25

router = APIRouter()
api = APIRouter(prefix=API, tags=["dashboard"])


@router.get("/", include_in_schema=False)
def root():
    return RedirectResponse("/dashboard")


@router.get("/dashboard", include_in_schema=False)
def page():
    return FileResponse(STATIC / "dashboard.html", media_type="text/html")


@router.get("/dashboard/{name}", include_in_schema=False)
def asset(name: Annotated[str, PathParam(pattern=r"^[a-z]+\.(js|css|svg)$")]):
    path = STATIC / name
    if not path.is_file():
        raise NotFound(f"no dashboard file {name!r}")
    return FileResponse(path)


@api.get(
    "/market/nodes",
    response_model=list[MarketNodeResponse],
    summary="Every node's GPUs, state, load and telemetry (anonymous)",
)
def market_nodes(db: Db):
    with db.begin() as session:
        busy = queries.count_busy_gpus(session=session)
        nodes = crud.list_nodes(session=session, owner_id=None)
        return [
            {
                "id": n.id,
                "gpu_model": n.gpu_model,
                "region": n.region,
                "capacity": n.capacity,
                "state": n.state,
                "gpu_count": n.gpu_count,
                "gpus_busy": int(busy.get(n.id) or 0),
                "reserve_price": n.reserve_price,
                "gpus": public_gpus(n.telemetry),
                "last_heartbeat_at": n.last_heartbeat_at,
            }
            for n in nodes
        ]


@api.get(
    "/market/depth/{gpu_model}/{region}",
    summary="A pool's order book by price level: GPUs waiting and GPUs held (anonymous)",
)
def depth(
    gpu_model: Annotated[str, PathParam(max_length=100)],
    region: Annotated[str, PathParam(max_length=63)],
    db: Db,
    capacity: Capacity = Capacity.SPOT,
):
    try:
        model = DEFAULT_CATALOG.normalize(gpu_model)
    except ValueError as exc:
        raise Invalid(str(exc), field="gpu_model") from None
    with db.begin() as session:
        rows = queries.list_book_orders(
            session=session, gpu_model=model, region=region, capacity=capacity
        )
    levels: dict[float, dict] = {}
    for price, gpus, held in rows:
        level = levels.setdefault(
            round(price, 2), {"price": round(price, 2), "waiting": 0, "held": 0}
        )
        level["held" if held else "waiting"] += gpus
    ordered = sorted(levels.values(), key=lambda lv: -lv["price"])
    return {
        "gpu_model": model,
        "region": region,
        "capacity": capacity,
        "levels": ordered[:DEPTH_LEVELS],
    }


@api.get(
    "/stream",
    summary="Server-sent events: every pool's quote, as the market moves",
    include_in_schema=False,  # an endless text/event-stream: OpenAPI cannot describe it
)
async def stream(request: Request, db: Db, once: Annotated[bool, Query()] = False):
    """``event: market`` with ``{"version", "at", "pools"}``; ``once`` sends one and ends."""
    notifier = request.app.state.notifier
    shares: FairShares = request.app.state.fair_shares
    snapshot: SharedSnapshot = request.app.state.stream_snapshot

    def message(version: tuple[int, int]) -> str:
        with db.begin() as session:
            pools = [
                {
                    **{c.name: getattr(r, c.name) for c in PoolQuoteRow.__table__.columns},
                    "on_demand_price": DEFAULT_CATALOG.get(r.gpu_model).on_demand_price,
                }
                for r in queries.list_quotes(session=session)
            ]
        body = {"version": sum(version), "at": time.time(), "pools": pools}
        return f"event: market\ndata: {json.dumps(body)}\n\n"

    async def events():
        seen, sent_at = None, 0.0
        while True:
            version = (notifier.version, notifier.market_version)
            if version != seen or time.monotonic() - sent_at >= STREAM_SECONDS:
                seen, sent_at = version, time.monotonic()
                yield await snapshot.get(version, lambda v=version: run_in_threadpool(message, v))
                if once:
                    return
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.25)

    slots = [] if once else [(shares.streams_by_address, client_address(request))]  # held
    give_back = take_or_refuse(slots, what="streams", names=("client address",))
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return _HeldStream(
        events(), give_back=give_back, media_type="text/event-stream", headers=headers
    )


class _HeldStream(StreamingResponse):
    """A stream that gives its slot back however it ends (or, never sent, when collected)."""

    def __init__(self, content, *, give_back: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.give_back = give_back
        weakref.finalize(self, give_back)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.give_back()


router.include_router(api)
