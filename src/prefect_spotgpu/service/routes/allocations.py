"""Allocation routes for tenants: its allocations (GPUs on one node held for one of its bids),
newest first a page at a time, optionally only the active ones, and one by id. What a node
agent reads and reports of its allocations is ``agents``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from prefect_spotgpu.service import crud, gangs, schemas
from prefect_spotgpu.service.deps import CurrentTenant, Db
from prefect_spotgpu.service.routes.params import API, Before, Id, PageSize, link_next, next_cursor

router = APIRouter(prefix=API, tags=["allocations"])


@router.get(
    "/allocations",
    response_model=list[schemas.AllocationResponse],
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
        link_next(request, response, before=next_cursor(allocs, limit))
        ranks = gangs.allocation_ranks(session=session, allocations=allocs)
        return [schemas.allocation_response(a, ranks.get(a.bid_id)) for a in allocs]


@router.get("/allocations/{allocation_id}", response_model=schemas.AllocationResponse)
def get_allocation(allocation_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        alloc = crud.get_allocation(
            session=session, allocation_id=allocation_id, tenant_id=tenant_id
        )
        ranks = gangs.allocation_ranks(session=session, allocations=[alloc])
        return schemas.allocation_response(alloc, ranks.get(alloc.bid_id))
