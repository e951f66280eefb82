"""FastAPI dependencies: the database, and who is calling (tenant, node agent or admin)."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.service import crud
from prefect_spotgpu.service.errors import Forbidden, Unauthorized

AUTH_CACHE_SECONDS = 30.0
"""How long a replica trusts a key it has looked up (keys are never reassigned)."""

bearer = HTTPBearer(auto_error=False, description="A tenant API key, node token or admin key.")


def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


Db = Annotated[sessionmaker[Session], Depends(get_sessions)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


@dataclass(frozen=True, slots=True)
class Caller:
    tenant_id: int | None = None
    node_id: int | None = None
    admin: bool = False


def _caller(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None,
    sessions: sessionmaker[Session],
) -> Caller:
    if credentials is None or not credentials.credentials:
        raise Unauthorized("missing credentials: send 'Authorization: Bearer <key>'")
    key = credentials.credentials
    if hmac.compare_digest(key.encode(), request.app.state.admin_key.encode()):
        return Caller(admin=True)
    cache = request.app.state.auth_cache
    hit = cache.get(key)
    if hit is not None and time.monotonic() - hit[1] < AUTH_CACHE_SECONDS:
        return hit[0]
    caller = _lookup(key, sessions)
    if len(cache) > 10_000:
        cache.clear()
    cache[key] = (caller, time.monotonic())
    return caller


def _lookup(key: str, sessions: sessionmaker[Session]) -> Caller:
    with sessions.begin() as session:
        if key.startswith("sgn_"):
            node = crud.node_for_token(session=session, token=key)
            if node is not None:
                return Caller(node_id=node.id)
        else:
            tenant = crud.tenant_for_key(session=session, key=key)
            if tenant is not None:
                return Caller(tenant_id=tenant.id)
    raise Unauthorized("unknown API key or token")


def current_tenant(request: Request, credentials: Credentials, sessions: Db) -> int:
    caller = _caller(request, credentials, sessions)
    if caller.tenant_id is None:
        raise Forbidden("this needs a tenant API key")
    return caller.tenant_id


def current_node(request: Request, credentials: Credentials, sessions: Db) -> int:
    caller = _caller(request, credentials, sessions)
    if caller.node_id is None:
        raise Forbidden("this needs a node agent token")
    return caller.node_id


def admin_only(request: Request, credentials: Credentials, sessions: Db) -> None:
    if not _caller(request, credentials, sessions).admin:
        raise Forbidden("this needs the admin key")


def tenant_or_admin(request: Request, credentials: Credentials, sessions: Db) -> Caller:
    caller = _caller(request, credentials, sessions)
    if caller.node_id is not None:
        raise Forbidden("this needs a tenant API key or the admin key")
    return caller


CurrentTenant = Annotated[int, Depends(current_tenant)]
CurrentNode = Annotated[int, Depends(current_node)]
AdminOnly = Annotated[None, Depends(admin_only)]
TenantOrAdmin = Annotated[Caller, Depends(tenant_or_admin)]
