"""The ledger route: a tenant's balance, then two lists a page at a time, newest first: its
entries (credits, compensations) and the charges of each of its allocations. The money is in
units and exactly, in whole micros (``schemas.LedgerResponse``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from prefect_spotgpu.service import crud, schemas
from prefect_spotgpu.service.deps import CurrentTenant, Db
from prefect_spotgpu.service.routes.params import API, Before, PageSize, link_next, next_cursor

router = APIRouter(prefix=API, tags=["ledger"])


@router.get(
    "/ledger",
    response_model=schemas.LedgerResponse,
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
            "before": next_cursor(entries, limit),
            "charges_before": next_cursor(allocs, limit),
        }
        link_next(request, response, **cursors)
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
