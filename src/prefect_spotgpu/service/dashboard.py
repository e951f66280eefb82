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

The page renders data, never markup: every value from the API goes into the page as text
(``textContent``, ``createElement``), numbers in styles and SVG attributes are coerced and
clamped, and the telemetry the page shows is checked against ``service.telemetry``'s schema on
the way in and again on the way out. Every response of the service carries a
Content-Security-Policy that runs only this host's scripts, styles and connections, no inline
script, no plugin, no framing (``SecurityHeaders``, installed by ``install_security_headers``):
an injected string that slipped past both still could not run. The OpenAPI pages (``/docs``,
``/redoc``) load their viewer from a CDN and get a policy of their own (``DOCS_CSP``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
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
from prefect_spotgpu.service.telemetry import public_gpus

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


# ---------------------------------------------------------------- browser hardening

_SHARED = (
    "object-src 'none'",
    "base-uri 'none'",
    "frame-ancestors 'none'",
    "form-action 'self'",
)
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        *_SHARED,
    )
)
"""Every response but the OpenAPI pages: this host's scripts, styles and connections only."""

DOCS_CDN = "https://cdn.jsdelivr.net"
DOCS_CSP = "; ".join(
    (
        "default-src 'self'",
        f"script-src 'self' {DOCS_CDN}" + "{hashes}",
        f"style-src 'self' 'unsafe-inline' {DOCS_CDN} https://fonts.googleapis.com",
        "font-src 'self' data: https://fonts.gstatic.com",
        "img-src 'self' data: https://fastapi.tiangolo.com https://cdn.redoc.ly",
        "worker-src 'self' blob:",
        "connect-src 'self'",
        *_SHARED,
    )
)
"""FastAPI's Swagger UI and ReDoc pages: their viewer from the CDN, inline styles, and their
one inline script allowed by its hash (``{hashes}``), never ``'unsafe-inline'`` scripts."""

HARDENING = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
_INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.DOTALL)


def _hardened(headers, csp: str) -> list[tuple[bytes, bytes]]:
    """``headers`` with the hardening headers added where the response does not set them."""
    out = list(headers)
    present = {name.lower() for name, _ in out}
    for name, value in ((b"content-security-policy", csp.encode()), *HARDENING):
        if name not in present:
            out.append((name, value))
    return out


def docs_csp(html: bytes) -> str:
    """The OpenAPI page's policy, allowing exactly the inline scripts of ``html``."""
    hashes = "".join(
        f" 'sha256-{base64.b64encode(hashlib.sha256(script).digest()).decode()}'"
        for script in _INLINE_SCRIPT.findall(html)
    )
    return DOCS_CSP.format(hashes=hashes)


class SecurityHeaders:
    """ASGI middleware: the hardening headers on every HTTP response. Pure ASGI, so a
    streaming response (the dashboard's event stream) passes through unbuffered; only the
    OpenAPI pages (``docs_paths``, a few kB of HTML) are read whole to hash their scripts."""

    def __init__(self, app, docs_paths: frozenset[str]) -> None:
        self.app = app
        self.docs_paths = docs_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in self.docs_paths:
            await self._docs(scope, receive, send)
            return

        async def send_hardened(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": _hardened(message.get("headers", ()), CSP)}
            await send(message)

        await self.app(scope, receive, send_hardened)

    async def _docs(self, scope, receive, send) -> None:
        start, chunks = None, []

        async def send_hashed(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    html = b"".join(chunks)
                    headers = _hardened(start.get("headers", ()), docs_csp(html))
                    await send({**start, "headers": headers})
                    await send({"type": "http.response.body", "body": html})
            else:
                await send(message)

        await self.app(scope, receive, send_hashed)


def install_security_headers(app) -> None:
    """Every response of ``app`` carries the hardening headers (``CSP``, ``HARDENING``).

    Responses the server itself writes for an unhandled exception (Starlette's
    ``ServerErrorMiddleware``, outside every added middleware) are plain text without them.
    """
    docs = (app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
    app.add_middleware(SecurityHeaders, docs_paths=frozenset(p for p in docs if p))
