"""Every route's roles, from the one table (service/roles.py), checked against the running app:
the table covers exactly the app's routes and OpenAPI operations, and a walk calls every route
as every kind of caller — anonymous, tenant, provider, node, admin — expecting 401/403 exactly
where the table says no."""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import ADMIN_KEY, one_database
from prefect_spotgpu.service.roles import ROUTE_ROLES, Role, api_routes

CALLERS = ("anonymous", "tenant", "provider", "node", "admin")
ADMITTED = {
    "anonymous": set(),
    "tenant": {Role.TENANT},
    "provider": {Role.TENANT, Role.PROVIDER},
    "node": {Role.NODE},
    "admin": {Role.ADMIN},
}
BODIES = {  # a well-formed body where one is needed, so an admitted caller reaches the route
    ("POST", "/api/v1/tenants"): None,  # created per call (unique name)
    ("POST", "/api/v1/tenants/{tenant_id}/credits"): {"amount": 1.0, "reason": "walk"},
    ("PUT", "/api/v1/tenants/{tenant_id}/provider"): {"provider": False},
    ("POST", "/api/v1/bids"): {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0},
    ("PATCH", "/api/v1/bids/{bid_id}"): {"max_price": 1.1},
    ("PATCH", "/api/v1/nodes/{node_id}"): {"state": "draining"},
    ("POST", "/api/v1/nodes/{node_id}/heartbeat"): {},
    ("POST", "/api/v1/nodes/{node_id}/drain"): {"reason": "walk"},
    ("POST", "/api/v1/allocations/{allocation_id}/report"): {"epoch": 1, "outcome": "failed"},
    ("PUT", "/api/v1/webhook"): {"url": None},
    ("POST", "/api/v1/estimate"): {"gpu_model": "A100-80G", "gpu_hours": 1.0},
}


@one_database("a route's roles are decided before any query")
def test_the_table_covers_exactly_the_apps_routes_and_schema(service):
    assert api_routes(service.app) == set(ROUTE_ROLES)
    schema = httpx.get(service.base_url + "/openapi.json").json()
    operations = {
        (method.upper(), path) for path, item in schema["paths"].items() for method in item
    }
    assert operations <= set(ROUTE_ROLES)
    assert all(roles for roles in ROUTE_ROLES.values())


def _callers(service) -> dict[str, tuple[httpx.Client, dict]]:
    """Fresh callers for one route (a route may rotate or revoke the caller's own key)."""
    tenant, provider = service.tenant(), service.tenant()
    node, node_client = service.node(provider, gpus=1)
    ids = {"tenant_id": 999_999, "bid_id": 999_999, "allocation_id": 999_999}
    anonymous = service.client()
    return {
        "anonymous": (anonymous, {**ids, "node_id": 999_999}),
        "tenant": (tenant, {**ids, "node_id": 999_999}),
        "provider": (provider, {**ids, "node_id": 999_999}),
        "node": (node_client, {**ids, "node_id": node["id"]}),  # its own node
        "admin": (service.client(ADMIN_KEY), {**ids, "node_id": 999_999}),
    }


@pytest.mark.slow
@one_database("a route's roles are decided before any query")
def test_every_route_answers_every_role_as_the_table_says(service):
    wrong = []
    for (method, path), roles in sorted(ROUTE_ROLES.items()):
        callers = _callers(service)
        for caller in CALLERS:
            client, ids = callers[caller]
            values = {**ids, "gpu_model": "A100-80G", "region": "eu-west", "name": "app.js"}
            url = service.base_url + re.sub(
                r"\{(\w+)\}", lambda m, v=values: str(v[m.group(1)]), path
            )
            body = BODIES.get((method, path))
            if (method, path) == ("POST", "/api/v1/tenants"):
                body = {"name": f"walk-{caller}-{len(wrong)}-{id(client)}"}
            params = {"timeout": 0} if path.endswith("/events") else None
            kwargs = {"params": params}
            if method in ("POST", "PUT", "PATCH"):
                kwargs["json"] = body if body is not None else {}
            if path.endswith("/stream"):
                with client.stream(method, url, **kwargs) as response:
                    status = response.status_code
            else:
                status = client.request(method, url, **kwargs).status_code
            admitted = Role.PUBLIC in roles or bool(ADMITTED[caller] & roles)
            expected = "admitted" if admitted else ("401" if caller == "anonymous" else "403")
            got = (
                "401" if status == 401 else "403" if status == 403 else "admitted"
            )  # an admitted caller may still get 404/409/422: not its object, not valid
            if got != expected or status >= 500:
                wrong.append(f"{method} {path} as {caller}: {status}, expected {expected}")
    assert wrong == [], "\n".join(wrong)
