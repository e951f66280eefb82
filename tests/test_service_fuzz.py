"""Schemathesis against the published OpenAPI schema: bounded, authenticated with each route's
own role (service/roles.py), zero 5xx; every JSON body is also sent again with a lone surrogate
in each of its strings and keys (valid JSON, no UTF-8)."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import ADMIN_KEY
from prefect_spotgpu.service.roles import ROUTE_ROLES, Role

ROLE_KEYS = {Role.ADMIN: "admin", Role.NODE: "node", Role.PROVIDER: "tenant", Role.TENANT: "tenant"}

pytestmark = pytest.mark.slow


def test_no_operation_answers_5xx(service):
    tenant = service.tenant()
    node, _ = service.node(tenant)
    keys = {
        "tenant": tenant.headers["Authorization"],
        "admin": f"Bearer {ADMIN_KEY}",
        "node": f"Bearer {node['token']}",
    }
    schema = schemathesis.openapi.from_url(service.base_url + "/openapi.json")
    failures: list[str] = []
    calls = 0
    operations = [result.ok() for result in schema.get_all_operations()]
    # the routes that revoke the callers' own keys and tokens go last
    operations.sort(key=lambda op: "/key" in op.path or "/token" in op.path)
    for operation in operations:
        roles = ROUTE_ROLES[(operation.method.upper(), operation.path)]
        role = next(
            (key for role, key in ROLE_KEYS.items() if role in roles), "tenant"
        )  # the route's own role: every call passes the authorization, reaching validation
        extra = {"timeout": 0} if operation.path.endswith("/events") else None
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(
                generation_mode=mode, headers={"Authorization": keys[role]}, query=extra
            )

            @settings(
                max_examples=25,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy)
            def run(case):
                nonlocal calls
                calls += 1
                responses = [(case.body, case.call(base_url=service.base_url, timeout=30))]
                if isinstance(case.body, dict | list):
                    body = _with_surrogates(case.body)
                    responses.append((body, _send(case, body, service.base_url)))
                for body, response in responses:
                    if response.status_code >= 500:
                        failures.append(
                            f"{case.method} {case.formatted_path} "
                            f"{response.status_code}: {response.text[:300]} body={body!r:.300}"
                        )

            try:
                run()
            except Unsatisfiable:  # e.g. no negative input exists for this operation
                continue
    assert calls > 200
    assert failures == [], "\n".join(failures[:10])


def _with_surrogates(value):
    """``value`` with a lone surrogate in each string and key (sent as JSON's ``\\ud800``)."""
    if isinstance(value, str):
        return value + "\ud800"
    if isinstance(value, dict):
        return {_with_surrogates(k): _with_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_surrogates(v) for v in value]
    return value


def _send(case, body, base_url: str):
    """The case's request with ``body`` as JSON text (``json.dumps`` escapes a lone surrogate
    as ``\\ud800``; schemathesis's own call re-validates the body and cannot encode one)."""
    request = case.as_transport_kwargs(base_url=base_url)
    for key in ("json", "data", "content"):
        request.pop(key, None)
    headers = {**request.pop("headers", {}), "content-type": "application/json"}
    return httpx.request(
        request["method"], request["url"], params=request.get("params"), headers=headers,
        content=json.dumps(body), timeout=30,
    )  # fmt: skip
