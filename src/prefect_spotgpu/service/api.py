"""The HTTP API (``/api/v1``). Routes open the transaction and map domain errors to HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import threading
import time
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

import prefect_spotgpu
from prefect_spotgpu.market import DEFAULT_CATALOG, AllocationStatus
from prefect_spotgpu.market.money import to_micros
from prefect_spotgpu.service import access, crud, dashboard, forecast_api, schemas
from prefect_spotgpu.service.db import make_reading_sessionmaker, make_sessionmaker
from prefect_spotgpu.service.deps import (
    AdminOnly,
    CurrentNode,
    CurrentTenant,
    Db,
    TenantOrAdmin,
)
from prefect_spotgpu.service.errors import Forbidden, Invalid, ServiceError
from prefect_spotgpu.service.limits import BodyLimit
from prefect_spotgpu.service.models import AllocationRow, BidRow, NodeRow, PoolQuoteRow, Tenant
from prefect_spotgpu.service.public_cache import PublicCache, declared_query_names
from prefect_spotgpu.service.roles import api_route_contexts, authorize, check_route_table
from prefect_spotgpu.service.sealing import Sealer, SealError
from prefect_spotgpu.service.settings import ServiceSettings
from prefect_spotgpu.service.ticker import Notifier, Ticker
from prefect_spotgpu.service.webhooks import WebhookSender

Id = Annotated[int, Path(ge=1, le=2**62, description="Numeric id.")]
Cursor = Annotated[int, Query(ge=0, le=2**62, description="Events after this id.")]
Wait = Annotated[float, Query(ge=0, le=60, description="Seconds to wait for an event.")]
Before = Annotated[
    int | None,
    Query(
        ge=0,
        le=2**62,
        description="Only rows older than this id: the cursor in the previous page's "
        '`Link: <...>; rel="next"` header (0: none). Without it, the newest rows.',
    ),
]
PageSize = Annotated[int, Query(ge=1, le=1000, description="Rows in one page.")]

router = APIRouter(prefix="/api/v1")
logger = logging.getLogger("prefect_spotgpu.service")


def _now() -> datetime:
    return datetime.now(UTC)


def _bid_response(bid: BidRow) -> schemas.BidResponse:
    return schemas.BidResponse.model_validate(bid, from_attributes=True)


def _alloc_response(alloc: AllocationRow) -> schemas.AllocationResponse:
    return schemas.AllocationResponse.model_validate(alloc, from_attributes=True)


def _node_response(node: NodeRow) -> schemas.NodeResponse:
    return schemas.NodeResponse.model_validate(node, from_attributes=True)


def _next_cursor(rows: list, limit: int) -> int | None:
    """Where the page after ``rows`` (newest first) starts; None when this one is the last."""
    return rows[-1].id if len(rows) == limit else None


def _link_next(request: Request, response: Response, **cursors: int | None) -> None:
    """Point to the next page (RFC 8288 ``Link: <url>; rel="next"``) while any list goes on;
    a list that has ended is asked again with cursor 0 (nothing older)."""
    if any(c is not None for c in cursors.values()):
        url = request.url.include_query_params(**{k: c or 0 for k, c in cursors.items()})
        response.headers["Link"] = f'<{url}>; rel="next"'


# ---------------------------------------------------------------- tenants


@router.post(
    "/tenants",
    status_code=201,
    response_model=schemas.TenantCreated,
    tags=["tenants"],
    summary="Create a tenant and its first API key (admin)",
)
def create_tenant(data: schemas.TenantCreate, _: AdminOnly, db: Db, request: Request):
    credit = data.starting_credit
    if credit is None:
        credit = request.app.state.settings.starting_credit
    with db.begin() as session:
        tenant, key = crud.create_tenant(
            session=session, name=data.name, starting_credit=to_micros(credit), now=_now()
        )
        session.flush()
        session.refresh(tenant)
        return {**schemas.tenant_response(tenant), "api_key": key}


@router.get(
    "/tenants",
    response_model=list[schemas.TenantResponse],
    tags=["tenants"],
    summary="List tenants (admin)",
)
def list_tenants(_: AdminOnly, db: Db):
    with db.begin() as session:
        return [
            schemas.tenant_response(t) for t in session.scalars(select(Tenant).order_by(Tenant.id))
        ]


@router.post(
    "/tenants/{tenant_id}/credits",
    status_code=201,
    response_model=schemas.LedgerEntryResponse,
    tags=["tenants"],
    summary="Credit a tenant's balance (admin)",
)
def credit_tenant(tenant_id: Id, data: schemas.CreditCreate, _: AdminOnly, db: Db):
    with db.begin() as session:
        entry = crud.add_credit(
            session=session,
            tenant_id=tenant_id,
            amount=to_micros(data.amount),
            kind="credit",
            reason=data.reason,
            now=_now(),
        )
        session.flush()
        return schemas.LedgerEntryResponse.model_validate(entry, from_attributes=True)


@router.get(
    "/me", response_model=schemas.TenantResponse, tags=["tenants"], summary="The calling tenant"
)
def me(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return schemas.tenant_response(crud.get_tenant(session=session, tenant_id=tenant_id))


# ---------------------------------------------------------------- nodes


@router.post(
    "/nodes",
    status_code=201,
    response_model=schemas.NodeCreated,
    tags=["nodes"],
    summary="Register a node you own (providers only); returns its agent token once",
)
def register_node(data: schemas.NodeCreate, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        node, token = crud.register_node(session=session, owner_id=tenant_id, data=data, now=_now())
        return {**_node_response(node).model_dump(), "token": token}


@router.get(
    "/nodes",
    response_model=list[schemas.NodeResponse],
    tags=["nodes"],
    summary="Your nodes (all nodes for the admin)",
)
def list_nodes(caller: TenantOrAdmin, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        return [_node_response(n) for n in crud.list_nodes(session=session, owner_id=owner)]


@router.get(
    "/nodes/me",
    response_model=schemas.NodeResponse,
    tags=["agents"],
    summary="The node this agent token belongs to",
)
def my_node(caller_node: CurrentNode, db: Db):
    with db.begin() as session:
        return _node_response(crud.get_node(session=session, node_id=caller_node, owner_id=None))


@router.get("/nodes/{node_id}", response_model=schemas.NodeResponse, tags=["nodes"])
def get_node(node_id: Id, caller: TenantOrAdmin, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        return _node_response(crud.get_node(session=session, node_id=node_id, owner_id=owner))


@router.patch(
    "/nodes/{node_id}",
    response_model=schemas.NodeResponse,
    tags=["nodes"],
    summary="Set a node's reserve price, drain it, reclaim it or offer it again",
)
def update_node(node_id: Id, data: schemas.NodeUpdate, caller: TenantOrAdmin, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        node = crud.get_node(session=session, node_id=node_id, owner_id=owner)
        return _node_response(
            crud.update_node(
                session=session, node=node, data=data, provider=caller.admin or caller.provider
            )
        )


@router.post(
    "/nodes/{node_id}/heartbeat",
    response_model=schemas.NodeResponse,
    tags=["agents"],
    summary="The node agent's heartbeat, with telemetry",
)
def heartbeat(node_id: Id, data: schemas.Heartbeat, caller_node: CurrentNode, db: Db):
    _same_node(node_id, caller_node)
    with db.begin() as session:
        node = crud.get_node(session=session, node_id=node_id, owner_id=None)
        return _node_response(
            crud.heartbeat_node(
                session=session,
                node=node,
                telemetry=None
                if data.telemetry is None
                else data.telemetry.model_dump(mode="json", exclude_none=True),
                now=_now(),
            )
        )


@router.get(
    "/nodes/{node_id}/allocations",
    response_model=list[schemas.Assignment],
    tags=["agents"],
    summary="The node's active allocations (for reconciliation)",
)
def node_allocations(node_id: Id, caller_node: CurrentNode, db: Db, request: Request):
    """A job, its environment opened, goes only to the node that holds a running (or noticed)
    allocation of its bid, while it holds it; a reserved allocation shows no job yet."""
    _same_node(node_id, caller_node)
    sealer = request.app.state.sealer
    with db.begin() as session:
        allocations = crud.list_allocations(session=session, node_id=node_id, active_only=True)
        bids = {
            b.id: b
            for b in session.scalars(
                select(BidRow).where(BidRow.id.in_({a.bid_id for a in allocations}))
            )
        }
        return [
            schemas.Assignment(
                **_alloc_response(a).model_dump(),
                tenant_id=a.tenant_id,
                job=_job(bids[a.bid_id], sealer) if a.status in RUNS_A_JOB else None,
                checkpoint_key=f"bid-{a.bid_id}",
            )
            for a in allocations
        ]


RUNS_A_JOB = frozenset({AllocationStatus.RUNNING.value, AllocationStatus.NOTICED.value})


def _job(bid: BidRow, sealer: Sealer) -> dict | None:
    """The bid's job for its node; one that cannot be opened is logged and left out (the
    agent then reports the allocation failed), never a 500 for the node's every job."""
    try:
        return crud.job_for_node(bid=bid, sealer=sealer)
    except SealError:
        logger.error("bid %s: its sealed job environment does not open with this key", bid.id)
        return None


@router.get(
    "/nodes/{node_id}/events",
    response_model=schemas.EventsPage,
    tags=["agents"],
    summary="Long-poll the node's assignments and notices",
)
async def node_events(
    node_id: Id,
    caller_node: CurrentNode,
    db: Db,
    request: Request,
    after: Cursor = 0,
    timeout: Wait = 25.0,
):
    _same_node(node_id, caller_node)
    return await _long_poll(request, db, after, timeout, node_id=node_id)


@router.post(
    "/allocations/{allocation_id}/report",
    response_model=schemas.AllocationResponse,
    tags=["agents"],
    summary="Report a checkpoint, the final save or the job's end",
)
def report(allocation_id: Id, data: schemas.AllocationReport, caller_node: CurrentNode, db: Db):
    """Accepted only for the calling node's own allocation in its current epoch; every report,
    accepted or refused, is kept in the audit table ``node_reports``."""
    audit = {"node_id": caller_node, "allocation_id": allocation_id, "report": data}
    try:
        with db.begin() as session:
            alloc = crud.report_allocation(session=session, **audit, now=_now())
            crud.audit_report(session=session, **audit, status_code=200, detail=None, now=_now())
            return _alloc_response(alloc)
    except ServiceError as exc:
        with db.begin() as session:
            crud.audit_report(
                session=session,
                **audit,
                status_code=exc.status_code,
                detail=exc.message,
                now=_now(),
            )
        raise


def _same_node(node_id: int, caller_node: int) -> None:
    if node_id != caller_node:
        raise Forbidden(f"this token belongs to node {caller_node}, not node {node_id}")


# ---------------------------------------------------------------- bids


@router.post(
    "/bids",
    status_code=201,
    response_model=schemas.BidResponse,
    tags=["bids"],
    summary="Place a bid (an idempotency key makes retries safe)",
    responses={200: {"description": "The bid this idempotency key created before"}},
)
def create_bid(
    data: schemas.BidCreate, tenant_id: CurrentTenant, db: Db, response: Response, request: Request
):
    with db.begin() as session:
        bid, created = crud.create_bid(
            session=session,
            tenant_id=tenant_id,
            data=data,
            now=_now(),
            sealer=request.app.state.sealer,
        )
        if not created:
            response.status_code = 200
        return _bid_response(bid)


@router.get(
    "/bids",
    response_model=list[schemas.BidResponse],
    tags=["bids"],
    summary="Your bids, newest first, a page at a time (the next page's URL: the Link header)",
)
def list_bids(
    tenant_id: CurrentTenant,
    db: Db,
    request: Request,
    response: Response,
    status: Literal["open", "held", "cancelled", "finished"] | None = None,
    before: Before = None,
    limit: PageSize = 100,
):
    with db.begin() as session:
        bids = crud.list_bids(
            session=session, tenant_id=tenant_id, status=status, limit=limit, before_id=before
        )
        _link_next(request, response, before=_next_cursor(bids, limit))
        return [_bid_response(b) for b in bids]


@router.get("/bids/{bid_id}", response_model=schemas.BidResponse, tags=["bids"])
def get_bid(bid_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return _bid_response(crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id))


@router.patch(
    "/bids/{bid_id}",
    response_model=schemas.BidResponse,
    tags=["bids"],
    summary="Change a bid's maximum price",
)
def update_bid(bid_id: Id, data: schemas.BidUpdate, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        bid = crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
        return _bid_response(
            crud.reprice_bid(session=session, bid=bid, max_price=data.max_price, now=_now())
        )


@router.post(
    "/bids/{bid_id}/cancel",
    response_model=schemas.BidResponse,
    tags=["bids"],
    summary="Cancel a bid; its running job is stopped at the next tick",
)
def cancel_bid(bid_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        bid = crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
        return _bid_response(crud.cancel_bid(session=session, bid=bid, now=_now()))


@router.get(
    "/bids/{bid_id}/allocations", response_model=list[schemas.AllocationResponse], tags=["bids"]
)
def bid_allocations(bid_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
        return [_alloc_response(a) for a in crud.list_allocations(session=session, bid_id=bid_id)]


@router.get(
    "/bids/{bid_id}/events",
    response_model=schemas.EventsPage,
    tags=["bids"],
    summary="Long-poll the bid's allocation and notice events",
)
async def bid_events(
    bid_id: Id,
    tenant_id: CurrentTenant,
    db: Db,
    request: Request,
    after: Cursor = 0,
    timeout: Wait = 25.0,
):
    def check():
        with db.begin() as session:
            crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)

    await run_in_threadpool(check)
    return await _long_poll(request, db, after, timeout, bid_id=bid_id)


@router.get(
    "/events", response_model=schemas.EventsPage, tags=["bids"], summary="Long-poll all your events"
)
async def tenant_events(
    tenant_id: CurrentTenant, db: Db, request: Request, after: Cursor = 0, timeout: Wait = 25.0
):
    return await _long_poll(request, db, after, timeout, tenant_id=tenant_id)


@router.get(
    "/allocations",
    response_model=list[schemas.AllocationResponse],
    tags=["allocations"],
    summary="Your allocations, newest first, a page at a time (the next: the Link header)",
)
def list_allocations(
    tenant_id: CurrentTenant,
    db: Db,
    request: Request,
    response: Response,
    active: bool = False,
    before: Before = None,
    limit: PageSize = 500,
):
    with db.begin() as session:
        allocs = crud.page_allocations(
            session=session, tenant_id=tenant_id, active_only=active, limit=limit, before_id=before
        )
        _link_next(request, response, before=_next_cursor(allocs, limit))
        return [_alloc_response(a) for a in allocs]


@router.get(
    "/allocations/{allocation_id}", response_model=schemas.AllocationResponse, tags=["allocations"]
)
def get_allocation(allocation_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return _alloc_response(
            crud.get_allocation(session=session, allocation_id=allocation_id, tenant_id=tenant_id)
        )


# ---------------------------------------------------------------- prices, ledger, webhooks


@router.get(
    "/prices",
    response_model=list[schemas.QuoteResponse],
    tags=["prices"],
    summary="The current quote of every pool",
)
def prices(db: Db):
    with db.begin() as session:
        rows = session.scalars(
            select(PoolQuoteRow).order_by(
                PoolQuoteRow.gpu_model, PoolQuoteRow.region, PoolQuoteRow.capacity.desc()
            )
        )
        return [
            {
                **{
                    c: getattr(r, c)
                    for c in (
                        "gpu_model",
                        "region",
                        "capacity",
                        "clearing_price",
                        "reserve_price",
                        "gpus_total",
                        "gpus_free",
                        "gpus_running",
                        "waiting_bids",
                    )
                },
                "on_demand_price": DEFAULT_CATALOG.get(r.gpu_model).on_demand_price,
            }
            for r in rows
        ]


@router.get(
    "/prices/{gpu_model}/{region}/history",
    response_model=list[schemas.PriceBarResponse],
    tags=["prices"],
    summary="A pool's clearing price per minute (OHLC)",
)
def price_history(
    gpu_model: Annotated[str, Path(max_length=100)],
    region: Annotated[str, Path(max_length=63)],
    db: Db,
    hours: Annotated[float, Query(gt=0, le=24 * 31)] = 24.0,
):
    try:
        model = DEFAULT_CATALOG.normalize(gpu_model)
    except ValueError as exc:
        raise Invalid(str(exc), field="gpu_model") from None
    now = time.time()
    with db.begin() as session:
        bars = crud.price_bars(
            session=session,
            gpu_model=model,
            region=region,
            since_minute=int((now - hours * 3600) // 60),
            until_minute=int(now // 60),
        )
        return [
            {
                "minute": datetime.fromtimestamp(b.minute * 60, UTC),
                "open": b.open,
                "high": b.high,
                "low": b.low,
                "close": b.close,
            }
            for b in bars
        ]


@router.get(
    "/ledger",
    response_model=schemas.LedgerResponse,
    tags=["ledger"],
    summary="Balance, credits and the charges of each allocation, newest first, paged",
)
def ledger(
    tenant_id: CurrentTenant,
    db: Db,
    request: Request,
    response: Response,
    before: Before = None,
    charges_before: Before = None,
    limit: PageSize = 100,
):
    """The balance, then two lists a page at a time, newest first: ``entries`` (credits,
    compensations; cursor ``before``) and ``charges`` (what each allocation cost; cursor
    ``charges_before``). ``next`` holds both cursors (null: that list has ended), and the
    Link header the URL of the next page of both."""
    with db.begin() as session:
        tenant = crud.get_tenant(session=session, tenant_id=tenant_id)
        entries = crud.ledger_entries(
            session=session, tenant_id=tenant_id, limit=limit, before_id=before
        )
        allocs = crud.page_allocations(
            session=session,
            tenant_id=tenant_id,
            active_only=False,
            limit=limit,
            before_id=charges_before,
        )
        cursors = {
            "before": _next_cursor(entries, limit),
            "charges_before": _next_cursor(allocs, limit),
        }
        _link_next(request, response, **cursors)
        return {
            "next": cursors,
            "tenant_id": tenant_id,
            "credits": tenant.credits,
            "spent": tenant.spent,
            "balance": tenant.balance,
            "credits_micros": tenant.credits_micros,
            "spent_micros": tenant.spent_micros,
            "balance_micros": tenant.balance_micros,
            "entries": [
                schemas.LedgerEntryResponse.model_validate(e, from_attributes=True) for e in entries
            ],
            "charges": [
                {
                    "allocation_id": a.id,
                    "bid_id": a.bid_id,
                    "gpu_count": a.gpu_count,
                    "charged_amount": a.charged_amount,
                    "charged_micros": a.charged_micros,
                    "charged_seconds": a.charged_seconds,
                    "status": a.status,
                }
                for a in allocs
            ],
        }


@router.put(
    "/webhook",
    response_model=schemas.WebhookConfigResponse,
    tags=["webhooks"],
    summary="Set (or clear, with url null) the URL your events are POSTed to",
)
def set_webhook(data: schemas.WebhookConfig, tenant_id: CurrentTenant, db: Db, request: Request):
    url = None if data.url is None else str(data.url)
    allow_private = request.app.state.settings.webhook_allow_private
    if url is not None:  # resolve the host before the transaction: DNS holds no lock
        crud.check_webhook_destination(url=url, allow_private=allow_private)
    with db.begin() as session:
        tenant = crud.get_tenant(session=session, tenant_id=tenant_id)
        crud.set_webhook(
            session=session,
            tenant=tenant,
            url=url,
            secret=data.secret,
            allow_private=allow_private,
        )
        crud.record_change(session=session, entity="tenant", entity_id=tenant_id, op="webhook")
        return {"url": tenant.webhook_url, "has_secret": bool(tenant.webhook_secret)}


@router.get("/webhook", response_model=schemas.WebhookConfigResponse, tags=["webhooks"])
def get_webhook(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        tenant = crud.get_tenant(session=session, tenant_id=tenant_id)
        return {"url": tenant.webhook_url, "has_secret": bool(tenant.webhook_secret)}


@router.get(
    "/webhook/deliveries",
    response_model=list[schemas.DeliveryResponse],
    tags=["webhooks"],
    summary="The delivery log: every attempt's outcome",
)
def deliveries(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return [
            schemas.DeliveryResponse.model_validate(d, from_attributes=True)
            for d in crud.list_deliveries(session=session, tenant_id=tenant_id)
        ]


@router.get("/health", tags=["service"], summary="Liveness, and whether this replica ticks")
def health(request: Request):
    ticker: Ticker | None = request.app.state.ticker
    return {
        "status": "ok",
        "version": prefect_spotgpu.__version__,
        "leader": bool(ticker and ticker.epoch is not None),
        "ticks": ticker.ticks if ticker else 0,
        "last_tick_seconds": ticker.tick_seconds_last if ticker else None,
    }


# ---------------------------------------------------------------- long-poll


async def _long_poll(
    request: Request, db: sessionmaker[Session], after: int, timeout: float, **where
) -> dict:
    """Events after ``after``; waits up to ``timeout`` s for the first one, without busy work:
    the database is asked again when this process's leader commits, and twice a second."""
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


# ---------------------------------------------------------------- the app


def _error_response(request: Request, exc: ServiceError) -> JSONResponse:
    body: dict = {"detail": exc.message}
    if exc.field is not None:
        body["field"] = exc.field
        if exc.status_code == 422:
            body["detail"] = [
                {"loc": ["body", exc.field], "msg": exc.message, "type": "value_error"}
            ]
    return JSONResponse(body, status_code=exc.status_code)


def _safe(value):
    """JSON-safe echo of bad input (NaN, infinities and bytes become strings)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _echo(loc: tuple, value):
    """What of a bad input goes back in an error: scalars (truncated), never a whole object
    (a bid's body holds its job's environment, secrets included) nor anything under ``env``
    or a webhook's ``secret``."""
    if "env" in loc or "secret" in loc:
        return "<redacted>"
    if isinstance(value, dict | list | tuple):
        return f"<{type(value).__name__}>"
    value = _safe(value)
    return value[:200] if isinstance(value, str) else value


def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [
        {
            "loc": list(e.get("loc", ())),
            "msg": e.get("msg", ""),
            "type": e.get("type", ""),
            "input": _echo(tuple(e.get("loc", ())), e.get("input")),
        }
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


def create_app(
    settings: ServiceSettings | None = None, engine: Engine | None = None, background: bool = True
) -> FastAPI:
    """The service as an ASGI app. With ``background``, the app's lifespan runs the tick loop
    (one leader among replicas) and the webhook sender."""
    from prefect_spotgpu.service import metrics as service_metrics
    from prefect_spotgpu.service.db import check_database, make_engine, migrate

    settings = settings or ServiceSettings()
    sealer = Sealer(settings.resolved_secret_key())
    own_engine = engine is None
    engine = engine or make_engine(settings.database_url())
    sessions = make_sessionmaker(engine)
    notifier = Notifier()
    metrics = service_metrics.ServiceMetrics(make_reading_sessionmaker(engine))  # scrapes read
    threads: list[threading.Thread] = []
    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if background and settings.run_ticker:
            ticker = Ticker(settings, engine, sessions, notifier, metrics)
            app.state.ticker = ticker
            sender = WebhookSender(
                settings, sessions, metrics, reads=make_reading_sessionmaker(engine)
            )
            # what start-up allocated lives for good: out of the collector's full passes,
            # which otherwise stall the tick thread (holding the GIL) under many readers
            gc.collect()
            gc.freeze()
            for target, name in ((ticker.run, "spotgpu-ticker"), (sender.run, "spotgpu-webhooks")):
                thread = threading.Thread(target=target, args=(stop,), name=name, daemon=True)
                thread.start()
                threads.append(thread)
        yield
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        if own_engine:
            engine.dispose()

    check_database(engine)  # one line naming the database and the fix, not a traceback
    migrate(engine)
    with sessions.begin() as session:
        try:
            crud.check_sealing_key(session=session, sealer=sealer)
        except SealError:
            raise RuntimeError(
                "this replica's secret key does not open the job environments this market "
                "has sealed: give every replica the same SPOTGPU_SECRET_KEY"
            ) from None
        crud.seal_plaintext_jobs(session=session, sealer=sealer)
    app = FastAPI(
        dependencies=[Depends(authorize)],  # every route's roles: service/roles.py
        title="prefect-spotgpu market",
        version=prefect_spotgpu.__version__,
        description="A spot market for idle GPUs: tenants bid, node agents serve, the market "
        "clears every second and bills per second.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.reads = make_reading_sessionmaker(engine)
    app.state.notifier = notifier
    app.state.metrics = metrics
    app.state.ticker = None
    app.state.admin_key = settings.resolved_admin_key()
    app.state.sealer = sealer
    app.add_exception_handler(ServiceError, _error_response)
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_middleware(  # inside the timer: hits are counted and timed too
        PublicCache,
        seconds=settings.public_cache_seconds,
        versions=lambda: (notifier.version, notifier.market_version),
        query_names=functools.cache(lambda: declared_query_names(api_route_contexts(app))),
    )
    app.add_middleware(service_metrics.RequestTimer, metrics=metrics)
    app.include_router(router)
    app.include_router(access.router)
    app.include_router(forecast_api.router)
    app.include_router(service_metrics.router)
    app.include_router(dashboard.router)
    dashboard.install_security_headers(app)
    app.add_middleware(BodyLimit)  # outermost: a huge body is refused before anything reads it
    check_route_table(app)
    return app
