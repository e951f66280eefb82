"""The market dashboard: one page served by the service, kept live by server-sent events.

``GET /dashboard`` is a static page (HTML, CSS and JavaScript from ``service/static``; nothing
is fetched from another host). Everything it shows comes from the public JSON API plus three
read-only views here:

- ``GET /api/v1/market/nodes``: every node's GPUs, state, load and telemetry, without its
  owner or name (the market's supply is public; who owns it is not);
- ``GET /api/v1/market/depth/{model}/{region}``: the pool's order book, aggregated by price
  level (GPUs waiting and GPUs held at each maximum price), anonymous;
- ``GET /api/v1/stream``: server-sent events. A ``market`` event carries every pool's quote
  whenever this process's tick leader commits new events or a changed quote, and at least
  every ``STREAM_SECONDS``; the page refreshes its views (and a signed-in tenant's own bids,
  allocations and ledger, with the tenant's key, over the ordinary API) on each one.

A tenant signs in on the page with its API key; the key stays in the browser's session
storage and goes only to this service, in the ``Authorization`` header, so a tenant sees
exactly what the API shows it and nothing of anyone else's.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse
from sqlalchemy import func, select

from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.service import crud
from prefect_spotgpu.service.deps import Db
from prefect_spotgpu.service.errors import Invalid, NotFound
from prefect_spotgpu.service.models import AllocationRow, BidRow, NodeRow, PoolQuoteRow

STATIC = Path(__file__).parent / "static"
STREAM_SECONDS = 2.0
"""The longest the stream stays silent: a replica that does not lead the ticks still updates."""
DEPTH_LEVELS = 25

router = APIRouter()
api = APIRouter(prefix="/api/v1", tags=["dashboard"])


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


@api.get("/market/nodes", summary="Every node's GPUs, state, load and telemetry (anonymous)")
def market_nodes(db: Db):
    with db.begin() as session:
        busy = dict(
            session.execute(
                select(AllocationRow.node_id, func.sum(AllocationRow.gpu_count))
                .where(AllocationRow.status.in_(("running", "noticed")))
                .group_by(AllocationRow.node_id)
            ).all()
        )
        nodes = session.scalars(select(NodeRow).order_by(NodeRow.id)).all()
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
                "gpus": _gpu_telemetry(n.telemetry),
                "last_heartbeat_at": n.last_heartbeat_at,
            }
            for n in nodes
        ]


def _gpu_telemetry(telemetry: dict | None) -> list[dict]:
    keep = ("index", "utilization", "memory_used_mb", "power_w", "temperature_c")
    gpus = (telemetry or {}).get("gpus") or []
    return [{k: g.get(k) for k in keep} for g in gpus if isinstance(g, dict)]


@api.get(
    "/market/depth/{gpu_model}/{region}",
    summary="A pool's order book by price level: GPUs waiting and GPUs held (anonymous)",
)
def depth(
    gpu_model: Annotated[str, PathParam(max_length=100)],
    region: Annotated[str, PathParam(max_length=63)],
    db: Db,
    capacity: Literal["spot", "on_demand"] = "spot",
):
    try:
        model = DEFAULT_CATALOG.normalize(gpu_model)
    except ValueError as exc:
        raise Invalid(str(exc), field="gpu_model") from None
    active = AllocationRow.status.in_(crud.ACTIVE)
    with db.begin() as session:
        holding = select(AllocationRow.bid_id).where(active).scalar_subquery()
        here = (
            select(AllocationRow.bid_id)
            .join(NodeRow, NodeRow.id == AllocationRow.node_id)
            .where(active, NodeRow.region == region)
            .scalar_subquery()
        )
        rows = session.execute(
            select(BidRow.max_price, BidRow.gpu_count, BidRow.id.in_(here)).where(
                BidRow.status == "open",
                BidRow.gpu_model == model,
                BidRow.capacity == capacity,
                BidRow.region.in_((region, "any")),
                BidRow.id.in_(here) | BidRow.id.not_in(holding),  # not held in another pool
            )
        ).all()
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

    def pools():
        with db.begin() as session:
            return [
                {
                    **{c.name: getattr(r, c.name) for c in PoolQuoteRow.__table__.columns},
                    "on_demand_price": DEFAULT_CATALOG.get(r.gpu_model).on_demand_price,
                }
                for r in session.scalars(select(PoolQuoteRow))
            ]

    async def events():
        seen, sent_at = None, 0.0
        while True:
            version = (notifier.version, notifier.market_version)
            if version != seen or time.monotonic() - sent_at >= STREAM_SECONDS:
                seen, sent_at = version, time.monotonic()
                body = {
                    "version": sum(version),
                    "at": time.time(),
                    "pools": await run_in_threadpool(pools),
                }
                yield f"event: market\ndata: {json.dumps(body)}\n\n"
                if once:
                    return
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.25)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


router.include_router(api)
