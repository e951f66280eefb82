"""Webhook routes: a tenant sets (or clears) the URL its events are POSTed to, with an optional
signing secret (Standard Webhooks), reads it back (the secret never: only whether there is
one), and reads the delivery log. The destination is resolved and checked before the
transaction (private addresses are refused unless the operator allows them)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from prefect_spotgpu.service import crud, schemas
from prefect_spotgpu.service.deps import CurrentTenant, Db
from prefect_spotgpu.service.outbox import Entity
from prefect_spotgpu.service.routes.params import API

router = APIRouter(prefix=API, tags=["webhooks"])


@router.put(
    "/webhook",
    response_model=schemas.WebhookConfigResponse,
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
            sealer=request.app.state.sealer,
            allow_private=allow_private,
        )
        crud.record_change(session=session, entity=Entity.TENANT, entity_id=tenant_id, op="webhook")
        return {"url": tenant.webhook_url, "has_secret": bool(tenant.webhook_secret)}


@router.get("/webhook", response_model=schemas.WebhookConfigResponse)
def get_webhook(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        tenant = crud.get_tenant(session=session, tenant_id=tenant_id)
        return {"url": tenant.webhook_url, "has_secret": bool(tenant.webhook_secret)}


@router.get(
    "/webhook/deliveries",
    response_model=list[schemas.DeliveryResponse],
    summary="The delivery log: every attempt's outcome",
)
def deliveries(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return [
            schemas.DeliveryResponse.model_validate(d, from_attributes=True)
            for d in crud.list_deliveries(session=session, tenant_id=tenant_id)
        ]
