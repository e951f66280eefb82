"""Who may call what: every route's roles, in one table, checked by one dependency.

The market is strangers trading. The *operator* holds the admin key; a *tenant* (any buyer)
holds an API key and sees only its own bids, allocations, ledger and webhook; a *provider* is a
tenant the operator has allowed to register nodes (supply is vetted, buyers are anyone); a
*node* is an agent's token, which acts only for its own node. ``PUBLIC`` routes need no key.

``authorize`` runs before every route of the app (an app-wide dependency): it finds the route's
entry in ``ROUTE_ROLES``, authenticates the caller when the route is not public, and refuses
with 401 (no or unknown key) or 403 (a key of the wrong role). A route with no entry is refused
(fail closed), and ``check_route_table`` makes the app refuse to start with one.
``tests/test_roles.py`` walks the OpenAPI schema and calls every route as every role.

Keys are looked up on every request (one indexed read): a rotated or revoked key is refused
at once, on every replica.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine

from prefect_spotgpu.service import crud, queries
from prefect_spotgpu.service.errors import Forbidden, Unauthorized


class Role(StrEnum):
    PUBLIC = "public"  # anyone, no key
    TENANT = "tenant"  # any tenant's API key
    PROVIDER = "provider"  # a tenant's key, the tenant made a provider by the operator
    NODE = "node"  # a node agent's token
    ADMIN = "admin"  # the operator's admin key


P, T, V, N, A = Role.PUBLIC, Role.TENANT, Role.PROVIDER, Role.NODE, Role.ADMIN
API = "/api/v1"

ROUTE_ROLES: dict[tuple[str, str], frozenset[Role]] = {
    key: frozenset(roles)
    for key, roles in {
        # the operator
        ("POST", f"{API}/tenants"): {A},
        ("GET", f"{API}/tenants"): {A},
        ("POST", f"{API}/tenants/{{tenant_id}}/credits"): {A},
        ("PUT", f"{API}/tenants/{{tenant_id}}/provider"): {A},
        ("POST", f"{API}/tenants/{{tenant_id}}/keys"): {A},
        ("POST", f"{API}/tenants/{{tenant_id}}/keys/revoke"): {A},
        ("POST", f"{API}/nodes/{{node_id}}/token/revoke"): {T, A},  # its owner, even former
        ("POST", f"{API}/images"): {A},
        ("PUT", f"{API}/images/{{name}}"): {A},
        ("DELETE", f"{API}/images/{{name}}"): {A},
        # a tenant: itself, its bids, allocations, ledger and webhook
        ("GET", f"{API}/me"): {T},
        ("POST", f"{API}/me/key"): {T},
        ("POST", f"{API}/bids"): {T},
        ("POST", f"{API}/bids/batch"): {T},
        ("GET", f"{API}/bids"): {T},
        ("GET", f"{API}/bids/{{bid_id}}"): {T},
        ("PATCH", f"{API}/bids/{{bid_id}}"): {T},
        ("POST", f"{API}/bids/{{bid_id}}/cancel"): {T},
        ("GET", f"{API}/bids/{{bid_id}}/allocations"): {T},
        ("GET", f"{API}/bids/{{bid_id}}/events"): {T},
        ("GET", f"{API}/events"): {T},
        ("GET", f"{API}/allocations"): {T},
        ("GET", f"{API}/allocations/{{allocation_id}}"): {T},
        ("GET", f"{API}/ledger"): {T},
        ("PUT", f"{API}/webhook"): {T},
        ("GET", f"{API}/webhook"): {T},
        ("GET", f"{API}/webhook/deliveries"): {T},
        # a provider: its nodes (a tenant that is not one lists none)
        ("POST", f"{API}/nodes"): {V},
        ("GET", f"{API}/nodes"): {T, A},
        ("GET", f"{API}/nodes/{{node_id}}"): {T, A},
        ("PATCH", f"{API}/nodes/{{node_id}}"): {T, A},  # a former provider still drains
        ("POST", f"{API}/nodes/{{node_id}}/token"): {V},
        # a node's agent: only its own node and allocations
        ("GET", f"{API}/nodes/me"): {N},
        ("POST", f"{API}/nodes/{{node_id}}/heartbeat"): {N},
        ("POST", f"{API}/nodes/{{node_id}}/drain"): {N},
        ("POST", f"{API}/nodes/{{node_id}}/leave"): {N},
        ("POST", f"{API}/nodes/{{node_id}}/back"): {N},
        ("GET", f"{API}/nodes/{{node_id}}/allocations"): {N},
        ("GET", f"{API}/nodes/{{node_id}}/events"): {N},
        ("POST", f"{API}/allocations/{{allocation_id}}/report"): {N},
        # everyone: prices, the public market views, the dashboard, health and metrics
        ("GET", f"{API}/prices"): {P},
        ("GET", f"{API}/prices/{{gpu_model}}/{{region}}/history"): {P},
        ("GET", f"{API}/prices/{{gpu_model}}/{{region}}/hourly"): {P},
        ("GET", f"{API}/prices/{{gpu_model}}/{{region}}/forecast"): {P},
        ("POST", f"{API}/estimate"): {P},
        ("GET", f"{API}/market/nodes"): {P},
        ("GET", f"{API}/images"): {P},
        ("GET", f"{API}/market/depth/{{gpu_model}}/{{region}}"): {P},
        ("GET", f"{API}/stream"): {P},
        ("GET", f"{API}/health"): {P},
        ("GET", f"{API}/market"): {P},
        ("GET", "/metrics"): {P},
        ("GET", "/"): {P},
        ("GET", "/dashboard"): {P},
        ("GET", "/dashboard/{name}"): {P},
    }.items()
}
"""(method, route path) -> the roles that may call it."""

bearer = HTTPBearer(auto_error=False, description="A tenant API key, node token or admin key.")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: at most one of a tenant, a node or the admin (or nobody: public)."""

    tenant_id: int | None = None
    node_id: int | None = None
    admin: bool = False
    provider: bool = False

    @property
    def roles(self) -> frozenset[Role]:
        if self.admin:
            return frozenset({Role.ADMIN})
        if self.node_id is not None:
            return frozenset({Role.NODE})
        if self.tenant_id is not None:
            return frozenset({Role.TENANT, Role.PROVIDER} if self.provider else {Role.TENANT})
        return frozenset()


ANONYMOUS = Caller()


def route_roles(request: Request) -> frozenset[Role]:
    route = request.scope.get("route")
    method = "GET" if request.method == "HEAD" else request.method
    path = getattr(route, "path", None)
    roles = ROUTE_ROLES.get((method, path))
    if roles is None:
        raise Forbidden(f"no role may call {method} {path}")  # fail closed
    return roles


def authorize(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    """The app-wide dependency: the caller, if the route's roles admit it; else 401/403.

    A plain ``def``: FastAPI runs it in its thread pool, where the key's look-up may block."""
    roles = route_roles(request)
    if Role.PUBLIC in roles:
        return ANONYMOUS
    if credentials is None or not credentials.credentials:
        raise Unauthorized("missing credentials: send 'Authorization: Bearer <key>'")
    caller = _identify(request, credentials.credentials)
    if not caller.roles & roles:
        raise Forbidden(f"this needs {_describe(roles)}")
    return caller


def _identify(request: Request, key: str) -> Caller:
    if hmac.compare_digest(key.encode(), request.app.state.admin_key.encode()):
        return Caller(admin=True)
    return _lookup(request.app.state.engine, key)


def _lookup(engine: Engine, key: str) -> Caller:
    """One indexed read outside any transaction (no write lock on SQLite, one round trip on
    PostgreSQL): the node of a token, or the tenant of a live key."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        if key.startswith("sgn_"):
            node_id = queries.find_node_by_token(
                connection=connection, token_hash=crud.hash_secret(key)
            )
            if node_id is not None:
                return Caller(node_id=node_id)
        else:
            tenant = queries.find_tenant_by_key(
                connection=connection, key_hash=crud.hash_secret(key)
            )
            if tenant is not None:
                return Caller(tenant_id=tenant.id, provider=bool(tenant.provider))
    raise Unauthorized("unknown or revoked API key or token")


def _describe(roles: frozenset[Role]) -> str:
    names = {
        Role.TENANT: "a tenant API key",
        Role.PROVIDER: "a provider's API key (the operator grants that role)",
        Role.NODE: "a node agent token",
        Role.ADMIN: "the admin key",
    }
    if Role.TENANT in roles:  # a provider is a tenant too
        roles = roles - {Role.PROVIDER}
    return " or ".join(names[r] for r in sorted(roles, key=list(Role).index))


def api_route_contexts(app: FastAPI) -> list:
    """The app's API routes, included routers flattened: each with its full ``path``,
    ``methods`` and ``dependant``."""
    try:  # FastAPI >= 0.130 includes routers lazily
        from fastapi.routing import iter_route_contexts
    except ImportError:  # pragma: no cover - older FastAPI: the routes are flat
        return [r for r in app.routes if isinstance(r, APIRoute)]
    return [c for c in iter_route_contexts(app.routes) if isinstance(c.route, APIRoute)]


def api_routes(app: FastAPI) -> set[tuple[str, str]]:
    """Every (method, path) the app's API routes answer."""
    contexts = api_route_contexts(app)
    return {(method, c.path) for c in contexts for method in c.methods if method != "HEAD"}


def check_route_table(app: FastAPI) -> None:
    """Refuse to build an app with a route that has no entry in ``ROUTE_ROLES``."""
    missing = sorted(api_routes(app) - set(ROUTE_ROLES))
    if missing:
        raise RuntimeError(f"routes without roles in service/roles.py: {missing}")
