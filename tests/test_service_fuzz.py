"""Schemathesis against the published OpenAPI schema: bounded, authenticated with each route's
own role (service/roles.py), zero 5xx; every JSON body is also sent again with a lone surrogate
in each of its strings and keys (valid JSON, no UTF-8). Each case goes to the service on SQLite
and on PostgreSQL."""

from __future__ import annotations

import json

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import ADMIN_KEY, fresh_postgres_schema, start_service
from prefect_spotgpu.api_client import tls
from prefect_spotgpu.service.roles import ROUTE_ROLES, Role

DATABASES = ("sqlite", "postgresql")  # the order of ``markets``
ROLE_KEYS = {Role.ADMIN: "admin", Role.NODE: "node", Role.PROVIDER: "tenant", Role.TENANT: "tenant"}

pytestmark = pytest.mark.slow


@pytest.fixture
def markets(tmp_path, postgres_url):
    """The service on SQLite and on PostgreSQL side by side: each case, generated once, goes to
    both (the generation is most of a case's cost), so one run covers both databases."""
    url, drop = fresh_postgres_schema(postgres_url)
    started = []
    try:
        started.append(start_service(f"sqlite:///{tmp_path / 'market.db'}", tmp_path / "sqlite"))
        started.append(start_service(url, tmp_path / "postgresql"))
        yield started
    finally:
        for market in started:
            market.stop()
        drop()


def keys_of(market) -> dict[str, str]:
    """The Authorization header of each role's caller on ``market``."""
    tenant = market.tenant()
    node, _ = market.node(tenant)
    return {
        "tenant": tenant.headers["Authorization"],
        "admin": f"Bearer {ADMIN_KEY}",
        "node": f"Bearer {node['token']}",
    }


def test_no_operation_answers_5xx(markets):
    keys = [keys_of(market) for market in markets]
    schema = schemathesis.openapi.from_url(markets[0].base_url + "/openapi.json")
    failures: list[str] = []
    calls = 0
    operations = [result.ok() for result in schema.get_all_operations()]
    # the routes that revoke the callers' own keys and tokens go last
    operations.sort(key=lambda op: "/key" in op.path or "/token" in op.path)
    with requests.Session() as session, httpx.Client(timeout=30, verify=tls()) as http:
        for operation in operations:
            roles = ROUTE_ROLES[(operation.method.upper(), operation.path)]
            role = next(
                (key for role, key in ROLE_KEYS.items() if role in roles), "tenant"
            )  # the route's own role: every call passes the authorization, reaching validation
            extra = {"timeout": 0} if operation.path.endswith("/events") else None
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                strategy = operation.as_strategy(
                    generation_mode=mode, headers={"Authorization": keys[0][role]}, query=extra
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
                    for database, market, key in zip(DATABASES, markets, keys, strict=True):
                        auth = {"Authorization": key[role]}  # noqa: B023 (run() runs at once)
                        for body, response in _responses(case, market, auth, session, http):
                            if response.status_code >= 500:
                                failures.append(
                                    f"{database}: {case.method} {case.formatted_path} "
                                    f"{response.status_code}: {response.text[:300]} "
                                    f"body={body!r:.300}"
                                )

                try:
                    run()
                except Unsatisfiable:  # e.g. no negative input exists for this operation
                    continue
    assert calls > 200
    assert failures == [], "\n".join(failures[:10])


def _responses(case, market, auth: dict[str, str], session, http: httpx.Client) -> list:
    """``(body, response)`` of the case sent to ``market`` as generated and, for a JSON body,
    again with a lone surrogate in each of its strings and keys."""
    call = case.call(base_url=market.base_url, session=session, headers=auth, timeout=30)
    sent = [(case.body, call)]
    if isinstance(case.body, dict | list):
        body = _with_surrogates(case.body)
        sent.append((body, _send(http, case, body, market, auth)))
    return sent


def _with_surrogates(value):
    """``value`` with a lone surrogate in each string and key (sent as JSON's ``\\ud800``)."""
    if isinstance(value, str):
        return value + "\ud800"
    if isinstance(value, dict):
        return {_with_surrogates(k): _with_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_surrogates(v) for v in value]
    return value


def _send(http: httpx.Client, case, body, market, auth: dict[str, str]):
    """The case's request to ``market`` with ``body`` as JSON text (``json.dumps`` escapes a
    lone surrogate as ``\\ud800``; schemathesis's own call re-validates the body and cannot
    encode one)."""
    request = case.as_transport_kwargs(base_url=market.base_url)
    for key in ("json", "data", "content"):
        request.pop(key, None)
    headers = {**request.pop("headers", {}), **auth, "content-type": "application/json"}
    return http.request(
        request["method"], request["url"], params=request.get("params"), headers=headers,
        content=json.dumps(body),
    )  # fmt: skip
