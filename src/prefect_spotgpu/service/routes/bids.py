"""Bid routes: a tenant places a bid (an idempotency key makes a retry return the first bid)
or a batch of them (``bulk_bids``: all or none), lists its bids a page at a time, reads,
reprices and cancels one, lists a bid's allocations, and long-polls the events of one bid or
of all its bids. A tenant sees only its own bids.

A gang bid (``node_count`` above 1) is one row per member (``gangs``): any member's id reads,
reprices or cancels the gang, and a member's allocations and events are the whole gang's."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from prefect_spotgpu.protocol import BidStatus
from prefect_spotgpu.service import bulk_bids, crud, gangs, schemas
from prefect_spotgpu.service.deps import CurrentTenant, Db
from prefect_spotgpu.service.routes.long_poll import long_poll
from prefect_spotgpu.service.routes.params import (
    API,
    Before,
    Cursor,
    Id,
    PageSize,
    Wait,
    link_next,
    next_cursor,
    now,
)

router = APIRouter(prefix=API, tags=["bids"])


@router.post(
    "/bids",
    status_code=201,
    response_model=schemas.BidResponse,
    summary="Place a bid (an idempotency key makes retries safe)",
    responses={
        200: {"description": "The bid this idempotency key created before"},
        402: {"description": "The balance does not cover the credit the bid reserves"},
    },
)
def create_bid(
    data: schemas.BidCreate, tenant_id: CurrentTenant, db: Db, response: Response, request: Request
):
    with db.begin() as session:
        bid, created = crud.create_bid(
            session=session,
            tenant_id=tenant_id,
            data=data,
            now=now(),
            sealer=request.app.state.sealer,
            limits=request.app.state.bid_limits,
        )
        if not created:
            response.status_code = 200
        return _response(session, bid)


@router.post(
    "/bids/batch",
    status_code=201,
    response_model=schemas.BidBatchResponse,
    summary="Place many bids at once: all of them or none (idempotent per bid)",
    responses={
        200: {"description": "Every bid's idempotency key found an earlier bid"},
        402: {"description": "The balance does not cover the credit the bids reserve"},
        409: {"description": "A key found a bid with other terms, or the cap on open bids"},
    },
)
def create_bids(
    data: schemas.BidBatchCreate,
    tenant_id: CurrentTenant,
    db: Db,
    response: Response,
    request: Request,
):
    with db.begin() as session:
        placed = bulk_bids.create_bids(
            session=session,
            tenant_id=tenant_id,
            items=data.bids,
            now=now(),
            sealer=request.app.state.sealer,
            limits=request.app.state.bid_limits,
        )
        if not any(created for _, created in placed):
            response.status_code = 200
        rows = [bid for bid, _ in placed]
        members = gangs.members_of(session=session, bids=rows)
        return schemas.BidBatchResponse(
            bids=[schemas.bid_response(b, members[b.id]) for b in rows],
            created=[created for _, created in placed],
        )


@router.get(
    "/bids",
    response_model=list[schemas.BidResponse],
    summary="Your bids, newest first, a page at a time (the next page's URL: the Link header)",
)
def list_bids(
    tenant_id: CurrentTenant,
    db: Db,
    request: Request,
    response: Response,
    status: BidStatus | None = None,
    before: Before = None,
    limit: PageSize = 100,
):
    with db.begin() as session:
        bids = crud.list_bids(
            session=session, tenant_id=tenant_id, status=status, limit=limit, before_id=before
        )
        link_next(request, response, before=next_cursor(bids, limit))
        members = gangs.members_of(session=session, bids=bids)
        return [schemas.bid_response(b, members[b.id]) for b in bids]


@router.get("/bids/{bid_id}", response_model=schemas.BidResponse)
def get_bid(bid_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return _response(session, crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id))


@router.patch(
    "/bids/{bid_id}", response_model=schemas.BidResponse, summary="Change a bid's maximum price"
)
def update_bid(
    bid_id: Id, data: schemas.BidUpdate, tenant_id: CurrentTenant, db: Db, request: Request
):
    with db.begin() as session:
        bid = crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
        repriced = crud.reprice_bid(
            session=session,
            bid=bid,
            max_price=data.max_price,
            now=now(),
            limits=request.app.state.bid_limits,
        )
        return _response(session, repriced)


@router.post(
    "/bids/{bid_id}/cancel",
    response_model=schemas.BidResponse,
    summary="Cancel a bid; its running job is stopped at the next tick",
)
def cancel_bid(bid_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        bid = crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
        return _response(session, crud.cancel_bid(session=session, bid=bid, now=now()))


@router.get(
    "/bids/{bid_id}/allocations",
    response_model=list[schemas.AllocationResponse],
    summary="The bid's allocations, oldest first (a gang's: every member's, with its rank)",
)
def bid_allocations(bid_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        bid = crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
        members = gangs.members_of(session=session, bids=[bid])[bid.id]
        allocations = crud.list_allocations(session=session, bid_ids=members or [bid.id])
        return [
            schemas.allocation_response(a, members.index(a.bid_id) if members else None)
            for a in allocations
        ]


@router.get(
    "/bids/{bid_id}/events",
    response_model=schemas.EventsPage,
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
    def members() -> list[int]:
        with db.begin() as session:
            bid = crud.get_bid(session=session, tenant_id=tenant_id, bid_id=bid_id)
            return gangs.members_of(session=session, bids=[bid])[bid.id]

    ids = await run_in_threadpool(members)
    if ids:  # a gang: every member's events
        return await long_poll(request, db, after, timeout, bid_ids=ids)
    return await long_poll(request, db, after, timeout, bid_id=bid_id)


@router.get("/events", response_model=schemas.EventsPage, summary="Long-poll all your events")
async def tenant_events(
    tenant_id: CurrentTenant, db: Db, request: Request, after: Cursor = 0, timeout: Wait = 25.0
):
    return await long_poll(request, db, after, timeout, tenant_id=tenant_id)


def _response(session, bid) -> schemas.BidResponse:
    """A bid's response, with its gang's members."""
    return schemas.bid_response(bid, gangs.members_of(session=session, bids=[bid])[bid.id])
