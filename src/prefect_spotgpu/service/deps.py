"""FastAPI dependencies: the database, and who is calling (tenant, node agent or admin).

Authentication and the route's roles are checked once, by ``roles.authorize`` (an app-wide
dependency); these aliases only hand the route the caller it already admitted. They do no I/O,
so they are ``async``: FastAPI runs a plain ``def`` dependency in its thread pool, a hop each.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.service.errors import Forbidden
from prefect_spotgpu.service.roles import Caller, authorize


async def get_sessions(request: Request) -> sessionmaker[Session]:
    """The sessions of this request: reading ones for a GET (no write lock, read-only)."""
    if request.method in ("GET", "HEAD"):
        return request.app.state.reads
    return request.app.state.sessions


Db = Annotated[sessionmaker[Session], Depends(get_sessions)]
Authorized = Annotated[Caller, Depends(authorize)]


async def current_tenant(caller: Authorized) -> int:
    if caller.tenant_id is None:  # the route table admits only tenants here
        raise Forbidden("this needs a tenant API key")
    return caller.tenant_id


async def current_node(caller: Authorized) -> int:
    if caller.node_id is None:
        raise Forbidden("this needs a node agent token")
    return caller.node_id


CurrentTenant = Annotated[int, Depends(current_tenant)]
CurrentNode = Annotated[int, Depends(current_node)]
AdminOnly = Authorized  # the route table admits only the admin key
TenantOrAdmin = Authorized
