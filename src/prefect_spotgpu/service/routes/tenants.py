"""Tenant routes: the operator creates tenants (each with its first API key), lists them and
credits their balance; a tenant reads itself (``GET /me``). Keys, and the provider role, are
``access``'s routes. Who may call each route is in ``roles.ROUTE_ROLES``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from prefect_spotgpu.market.money import to_micros
from prefect_spotgpu.service import crud, queries, schemas
from prefect_spotgpu.service.deps import AdminOnly, CurrentTenant, Db
from prefect_spotgpu.service.ledger import CreditKind
from prefect_spotgpu.service.routes.params import API, Id, now

router = APIRouter(prefix=API, tags=["tenants"])


@router.post(
    "/tenants",
    status_code=201,
    response_model=schemas.TenantCreated,
    summary="Create a tenant and its first API key (admin)",
)
def create_tenant(data: schemas.TenantCreate, _: AdminOnly, db: Db, request: Request):
    credit = data.starting_credit
    if credit is None:
        credit = request.app.state.settings.starting_credit
    with db.begin() as session:
        tenant, key = crud.create_tenant(
            session=session, name=data.name, starting_credit=to_micros(credit), now=now()
        )
        session.flush()
        session.refresh(tenant)
        return {**schemas.tenant_response(tenant), "api_key": key}


@router.get("/tenants", response_model=list[schemas.TenantResponse], summary="List tenants (admin)")
def list_tenants(_: AdminOnly, db: Db):
    with db.begin() as session:
        return [schemas.tenant_response(t) for t in queries.list_tenants(session=session)]


@router.post(
    "/tenants/{tenant_id}/credits",
    status_code=201,
    response_model=schemas.LedgerEntryResponse,
    summary="Credit a tenant's balance (admin)",
)
def credit_tenant(tenant_id: Id, data: schemas.CreditCreate, _: AdminOnly, db: Db):
    with db.begin() as session:
        entry = crud.add_credit(
            session=session,
            tenant_id=tenant_id,
            amount=to_micros(data.amount),
            kind=CreditKind.CREDIT,
            reason=data.reason,
            now=now(),
        )
        session.flush()
        return schemas.LedgerEntryResponse.model_validate(entry, from_attributes=True)


@router.get("/me", response_model=schemas.TenantResponse, summary="The calling tenant")
def me(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return schemas.tenant_response(crud.get_tenant(session=session, tenant_id=tenant_id))
