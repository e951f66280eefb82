"""The small hardening: every number of every request body is strict (a boolean or a
string is a 422 naming the field), every answer carries the security headers (the body
limit's 413 too), and a node's agent may drain its own node, only its own."""

from __future__ import annotations

import json
import typing

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from conftest import one_database
from helpers import post_streamed_oversized
from prefect_spotgpu.protocol import REPORT_DETAIL_CHARS
from prefect_spotgpu.service import hardening
from prefect_spotgpu.service.api import ROUTES
from prefect_spotgpu.service.limits import MAX_BODY_BYTES

BID = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0}

# ---------------------------------------------------------------- strict numbers


def _types(annotation) -> typing.Iterator:
    """Every type an annotation is made of (unions, optionals, lists, Annotated, dicts)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        yield from _types(typing.get_args(annotation)[0])
    elif origin is not None:
        for arg in typing.get_args(annotation):
            yield from _types(arg)
    else:
        yield annotation


def _models(model: type[BaseModel], seen: set) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for kind in _types(field.annotation):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                _models(kind, seen)


def request_models() -> set[type[BaseModel]]:
    """Every model a request body of the API is made of, nested ones too (a heartbeat's
    telemetry, a bid's job)."""
    seen: set = set()
    for module in ROUTES:
        for route in module.router.routes:
            if isinstance(route, APIRoute) and route.body_field is not None:
                _models(route.body_field.field_info.annotation, seen)
    return seen


def numeric_fields() -> list[tuple[type[BaseModel], str, type]]:
    """(model, field, int or float) for every numeric field of every request model."""
    out = []
    for model in sorted(request_models(), key=lambda m: m.__name__):
        for name, field in model.model_fields.items():
            kinds = {k for k in _types(field.annotation) if k in (int, float)}
            if kinds:
                out.append((model, name, float if float in kinds else int))
    return out


def _errors_at(model: type[BaseModel], name: str, value) -> list[dict]:
    try:
        model.model_validate({name: value})
    except ValidationError as exc:
        return [e for e in exc.errors() if e["loc"][:1] == (name,)]
    return []


def test_the_walk_finds_the_numbers_of_every_body():
    found = {(m.__name__, name) for m, name, _ in numeric_fields()}
    assert {
        ("BidCreate", "max_price"),
        ("BidCreate", "gpu_count"),
        ("BidCreate", "node_count"),
        ("BidUpdate", "max_price"),
        ("NodeCreate", "reserve_price"),
        ("NodeCreate", "gpu_count"),
        ("NodeUpdate", "reserve_price"),
        ("CreditCreate", "amount"),
        ("TenantCreate", "starting_credit"),
        ("EstimateRequest", "gpu_hours"),
        ("EstimateRequest", "gpus"),
        ("AllocationReport", "epoch"),
        ("AllocationReport", "checkpoint_at"),
        ("AllocationReport", "step"),
        ("Telemetry", "jobs"),
        ("GpuTelemetry", "power_w"),
        ("GpuInventoryItem", "memory_mb"),
    } <= found


@pytest.mark.parametrize(
    ("model", "name", "kind"), numeric_fields(), ids=lambda v: getattr(v, "__name__", v)
)
def test_every_number_of_every_body_refuses_a_boolean_and_a_string(model, name, kind):
    for value in (True, False, "1", "2.5", "1e3"):
        errors = _errors_at(model, name, value)
        assert errors, f"{model.__name__}.{name} took {value!r}"
        assert errors[0]["type"] in ("int_type", "float_type"), errors
    if kind is float:  # JSON has no float/int distinction: 2 is a number
        assert not _errors_at(model, name, 2), f"{model.__name__}.{name} refused 2"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**BID, "max_price": True}, "max_price"),
        ({**BID, "max_price": "1"}, "max_price"),
        ({**BID, "gpu_count": True}, "gpu_count"),
        ({**BID, "gpu_count": "2"}, "gpu_count"),
        ({**BID, "node_count": "1"}, "node_count"),
    ],
)
def test_the_api_answers_a_boolean_or_a_string_number_with_a_422_naming_it(api, body, field):
    alice = api.tenant()
    response = alice.post("/bids", json=body)
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["detail"]] == [["body", field]]
    assert alice.get("/bids").json() == []


def test_an_integer_is_a_price_and_a_credit(service):
    alice = service.tenant()
    placed = alice.post("/bids", json={**BID, "max_price": 2})
    assert placed.status_code == 201, placed.text
    assert placed.json()["max_price"] == 2.0
    assert alice.patch(f"/bids/{placed.json()['id']}", json={"max_price": 3}).status_code == 200
    credit = service.admin.post(
        f"/tenants/{alice.tenant_id}/credits", json={"amount": 5, "reason": "whole units"}
    )
    assert credit.status_code in (200, 201), credit.text
    refused = service.admin.post(
        f"/tenants/{alice.tenant_id}/credits", json={"amount": True, "reason": "no"}
    )
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "amount"]


# ---------------------------------------------------------------- security headers


def assert_hardened(response: httpx.Response) -> None:
    assert response.headers.get("content-security-policy") == hardening.CSP, response.headers
    assert response.headers.get("x-content-type-options") == "nosniff"
    assert response.headers.get("x-frame-options") == "DENY"
    assert response.headers.get("referrer-policy") == "no-referrer"


@one_database("validation and headers are decided before any query")
def test_every_answer_carries_the_security_headers_the_413_too(service):
    alice = service.tenant()
    huge = json.dumps({**BID, "labels": {"k": "v" * (MAX_BODY_BYTES + 10)}}).encode()
    by_length = alice.post("/bids", content=huge, headers={"content-type": "application/json"})
    assert by_length.status_code == 413
    assert_hardened(by_length)

    streamed = post_streamed_oversized(service, alice.headers)
    assert streamed.status_code == 413 and "content-length" not in streamed.request.headers
    assert_hardened(streamed)
    missing = alice.get("/no-such-route")
    assert missing.status_code == 404
    assert_hardened(missing)
    invalid = alice.post("/bids", json={**BID, "gpu_count": "2"})
    assert invalid.status_code == 422
    assert_hardened(invalid)
    wrong_method = alice.delete("/prices")
    assert wrong_method.status_code == 405
    assert_hardened(wrong_method)
    assert alice.get("/bids").json() == []


# ---------------------------------------------------------------- an agent drains its node


def test_a_nodes_agent_drains_its_own_node_and_no_other(service):
    owner = service.tenant()
    node, agent = service.node(owner, gpus=1)
    other, other_agent = service.node(owner, gpus=1)
    path = f"/nodes/{node['id']}/drain"
    too_long = "x" * (REPORT_DETAIL_CHARS + 1)
    for bad in ({}, {"reason": ""}, {"reason": too_long}, {"reason": "a\nb"}):
        response = agent.post(path, json=bad)
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["loc"][:2] == ["body", "reason"]
    assert other_agent.post(path, json={"reason": "not mine"}).status_code == 403
    assert owner.post(path, json={"reason": "an owner uses PATCH"}).status_code == 403
    assert service.client().post(path, json={"reason": "anyone"}).status_code == 401
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == "live"
    drained = agent.post(path, json={"reason": "3 jobs in a row could not start: EACCES"})
    assert drained.status_code == 200, drained.text
    assert drained.json()["state"] == "draining"
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == "draining"
    assert owner.get(f"/nodes/{other['id']}").json()["state"] == "live"
    # its owner offers it again; an agent never undoes the owner's reclaim
    assert owner.patch(f"/nodes/{node['id']}", json={"state": "live"}).json()["state"] == "live"
    owner.patch(f"/nodes/{other['id']}", json={"state": "reclaimed"})
    again = other_agent.post(f"/nodes/{other['id']}/drain", json={"reason": "late"})
    assert again.status_code == 200 and again.json()["state"] == "reclaimed"
