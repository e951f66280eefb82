"""Access routes: who supplies GPUs (providers), and the keys and tokens that say who is who.

- The operator makes a tenant a provider (``PUT /tenants/{id}/provider``) before it may
  register nodes, and may take that back (its live nodes then drain).
- A tenant rotates its own API key (``POST /me/key``): a new key, every older one refused at
  once. The operator revokes all of a tenant's keys (``POST /tenants/{id}/keys/revoke``) and
  may issue it a new one (``POST /tenants/{id}/keys``).
- A provider gets a new token for its node's agent (``POST /nodes/{id}/token``; the old one
  is refused at once); the provider or the operator revokes a node's token
  (``POST /nodes/{id}/token/revoke``): its agent can no longer act, and the node is lost after
  the heartbeat timeout.

Who may call each route is in ``roles.ROUTE_ROLES``.
"""

from __future__ import annotations

from fastapi import APIRouter

from prefect_spotgpu.service import crud, schemas
from prefect_spotgpu.service.deps import Authorized, CurrentTenant, Db
from prefect_spotgpu.service.routes.params import API, Id, now

router = APIRouter(prefix=API)


@router.put(
    "/tenants/{tenant_id}/provider",
    response_model=schemas.TenantResponse,
    tags=["tenants"],
    summary="Allow a tenant to register nodes, or take that back (admin)",
)
def set_provider(tenant_id: Id, data: schemas.ProviderUpdate, _: Authorized, db: Db):
    with db.begin() as session:
        tenant = crud.get_tenant(session=session, tenant_id=tenant_id)
        crud.set_provider(session=session, tenant=tenant, provider=data.provider)
        return schemas.tenant_response(tenant)


@router.post(
    "/me/key",
    status_code=201,
    response_model=schemas.KeyIssued,
    tags=["tenants"],
    summary="Rotate your API key: a new key, and every older one refused at once",
)
def rotate_key(tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        return {"api_key": crud.replace_keys(session=session, tenant_id=tenant_id, now=now())}


@router.post(
    "/tenants/{tenant_id}/keys",
    status_code=201,
    response_model=schemas.KeyIssued,
    tags=["tenants"],
    summary="Issue a tenant a new API key, revoking its older ones (admin)",
)
def issue_key(tenant_id: Id, _: Authorized, db: Db):
    with db.begin() as session:
        crud.get_tenant(session=session, tenant_id=tenant_id)
        return {"api_key": crud.replace_keys(session=session, tenant_id=tenant_id, now=now())}


@router.post(
    "/tenants/{tenant_id}/keys/revoke",
    response_model=schemas.KeysRevoked,
    tags=["tenants"],
    summary="Revoke every API key of a tenant (admin)",
)
def revoke_keys(tenant_id: Id, _: Authorized, db: Db):
    with db.begin() as session:
        crud.get_tenant(session=session, tenant_id=tenant_id)
        return {"revoked": crud.revoke_keys(session=session, tenant_id=tenant_id, now=now())}


@router.post(
    "/nodes/{node_id}/token",
    status_code=201,
    response_model=schemas.NodeToken,
    tags=["nodes"],
    summary="A new agent token for your node; the old one is refused at once",
)
def rotate_node_token(node_id: Id, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        node = crud.get_node(session=session, node_id=node_id, owner_id=tenant_id)
        return {"token": crud.rotate_node_token(session=session, node=node)}


@router.post(
    "/nodes/{node_id}/token/revoke",
    response_model=schemas.NodeResponse,
    tags=["nodes"],
    summary="Revoke a node's agent token (its owner, or the admin)",
)
def revoke_node_token(node_id: Id, caller: Authorized, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        node = crud.get_node(session=session, node_id=node_id, owner_id=owner)
        crud.revoke_node_token(session=session, node=node)
        return schemas.node_response(node)
