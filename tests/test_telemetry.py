"""What a node agent may say about its GPUs (``service/telemetry.py``): the agent's own shapes
pass, anything else is refused naming the field — as data here, and through the real service
(a 422, nothing stored)."""

from __future__ import annotations

import doctest
import json

import pytest
from pydantic import ValidationError

from conftest import one_database
from prefect_spotgpu.agent.discovery import discover_nvml, parse_declared, telemetry_nvml
from prefect_spotgpu.service import telemetry as schema
from prefect_spotgpu.service.schemas import Heartbeat, NodeCreate
from prefect_spotgpu.service.telemetry import GpuInventoryItem, Telemetry, public_gpus
from test_agent import FakeNvml

SCRIPT = "<img src=x onerror=alert(1)>"
HUGE = "x" * 5_000_000


def test_the_docstring_example_holds():
    assert doctest.testmod(schema).failed == 0


def test_what_the_agent_sends_is_valid():
    nvml = FakeNvml(["NVIDIA H200", "NVIDIA H200"])
    for gpus in (discover_nvml(nvml), parse_declared("A100-80G:16")):
        items = [GpuInventoryItem.model_validate(g.to_json()) for g in gpus]
        assert [i.model_dump(mode="json") for i in items] == [g.to_json() for g in gpus]
    readings = telemetry_nvml(FakeNvml(["NVIDIA H200", "NVIDIA H200"]))
    unread = [{"index": 0, "utilization": None, "memory_used_mb": None, "power_w": None,
               "temperature_c": None}]  # fmt: skip
    for body in (  # agent.heartbeat(): with NVML, with readings NVML could not take, declared
        {"jobs": 2, "declared": False, "gpus": readings},
        {"jobs": 0, "declared": False, "gpus": unread},
        {"jobs": 0, "declared": True},
    ):
        stored = Heartbeat.model_validate({"telemetry": body}).telemetry
        assert stored.model_dump(mode="json", exclude_none=True) == {
            k: v if k != "gpus" else [{n: x for n, x in g.items() if x is not None} for g in v]
            for k, v in body.items()
        }
    inventory = [g.to_json() for g in discover_nvml(nvml)]
    node = {"name": "n1", "gpu_model": "H200", "region": "eu-west", "gpu_count": 2,
            "reserve_price": 2.0, "inventory": inventory}  # fmt: skip
    assert NodeCreate.model_validate(node).inventory[1].uuid == "GPU-00000001"


@pytest.mark.parametrize(
    ("gpu", "field"),
    [
        ({"index": 0, "utilization": SCRIPT}, "utilization"),
        ({"index": 0, "utilization": HUGE}, "utilization"),
        ({"index": 0, "utilization": float("nan")}, "utilization"),
        ({"index": 0, "utilization": float("inf")}, "utilization"),
        ({"index": 0, "utilization": -1}, "utilization"),
        ({"index": 0, "utilization": 100.5}, "utilization"),
        ({"index": 0, "memory_used_mb": -1}, "memory_used_mb"),
        ({"index": 0, "memory_used_mb": 2**40}, "memory_used_mb"),
        ({"index": 0, "power_w": 1e9}, "power_w"),
        ({"index": 0, "temperature_c": 10_000}, "temperature_c"),
        ({"index": 0, "temperature_c": [1]}, "temperature_c"),
        ({"index": 16}, "index"),
        ({"index": -1}, "index"),
        ({"utilization": 5}, "index"),
        ({"index": 0, "name": "GPU 0"}, "name"),
        ({"index": 0, HUGE: 1}, HUGE),
    ],
    ids=lambda v: v[:30] if isinstance(v, str) else None,
)
def test_bad_gpu_readings_are_refused_naming_the_field(gpu, field):
    with pytest.raises(ValidationError) as caught:
        Telemetry.model_validate({"gpus": [gpu]})
    assert [e["loc"] for e in caught.value.errors()] == [("gpus", 0, field)]


def test_bad_telemetry_and_inventory_are_refused():
    for body, loc in (
        ({"jobs": -1}, ("jobs",)),
        ({"declared": SCRIPT}, ("declared",)),
        ({"gpus": [{"index": i} for i in range(17)]}, ("gpus",)),
        ({"gpus": [{"index": 1}, {"index": 1}]}, ("gpus",)),
        ({"gpus": {"index": 0}}, ("gpus",)),
        ({"html": SCRIPT}, ("html",)),
    ):
        with pytest.raises(ValidationError) as caught:
            Telemetry.model_validate(body)
        assert caught.value.errors()[0]["loc"] == loc, body
    good = parse_declared("A100-80G:1")[0].to_json()
    for change, loc in (
        ({"name": SCRIPT}, ("name",)),
        ({"name": '"><script>x</script>'}, ("name",)),
        ({"uuid": "a" * 101}, ("uuid",)),
        ({"driver": "535'"}, ("driver",)),
        ({"model": ""}, ("model",)),
        ({"memory_mb": -5}, ("memory_mb",)),
        ({"throttle_reasons": ["<b>"]}, ("throttle_reasons", 0)),
        ({"throttle_reasons": ["a"] * 33}, ("throttle_reasons",)),
        ({"owner": "me"}, ("owner",)),
    ):
        with pytest.raises(ValidationError) as caught:
            GpuInventoryItem.model_validate({**good, **change})
        assert caught.value.errors()[0]["loc"] == loc, change
    # plain names NVML reports pass: letters, digits, space, ._:()+/-
    for name in ("NVIDIA GeForce RTX 4090", "NVIDIA A100-SXM4-80GB", "Tesla V100 (PCIe/16GB)"):
        assert GpuInventoryItem.model_validate({**good, "name": name}).name == name


def test_stored_telemetry_is_checked_again_on_its_way_out():
    """A row stored before the schema (or by hand) never reaches the page unchecked."""
    legacy = {
        "gpus": [
            {"index": 0, "utilization": '100%"><img src=x onerror=alert(1)>'},
            {"index": 1, "utilization": 1e9},
            {"index": 2, "utilization": 55, "power_w": 300, "colour": "red"},
            {"index": 3, "utilization": 40, "memory_used_mb": 9000},
            "<script>",
        ]
    }
    assert public_gpus(legacy) == [
        {"index": 3, "utilization": 40.0, "memory_used_mb": 9000, "power_w": None,
         "temperature_c": None}
    ]  # fmt: skip
    for nothing in (None, {}, {"gpus": "x"}, {"gpus": None}, ["gpus"], "gpus"):
        assert public_gpus(nothing) == []


# ---------------------------------------------------------------- through the service

HOSTILE_TELEMETRY = [
    ({"gpus": [{"index": 0, "utilization": SCRIPT}]}, ["telemetry", "gpus", 0, "utilization"]),
    ({"gpus": [{"index": 0, "utilization": HUGE}]}, ["telemetry", "gpus", 0, "utilization"]),
    ({"gpus": [{"index": 0, "utilization": -3}]}, ["telemetry", "gpus", 0, "utilization"]),
    ({"gpus": [{"index": 0, "utilization": 101}]}, ["telemetry", "gpus", 0, "utilization"]),
    ({"gpus": [{"index": 0, "power_w": 1e12}]}, ["telemetry", "gpus", 0, "power_w"]),
    ({"gpus": [{"index": 0, "label": SCRIPT}]}, ["telemetry", "gpus", 0, "label"]),
    ({"note": HUGE}, ["telemetry", "note"]),
]


@one_database("validation and headers are decided before any query")
def test_hostile_telemetry_is_a_422_naming_the_field_and_is_not_stored(service):
    owner = service.tenant()
    node, agent = service.node(owner, gpus=2)
    good = {"jobs": 1, "declared": False, "gpus": [{"index": 0, "utilization": 40}]}
    response = agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": good})
    assert response.status_code == 200, response.text

    def stored() -> dict:
        return owner.get(f"/nodes/{node['id']}").json()["telemetry"]

    before = stored()
    assert before["gpus"] == [{"index": 0, "utilization": 40.0}]
    for body, loc in HOSTILE_TELEMETRY:
        response = agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": body})
        assert len(response.content) < 10_000  # the 5 MB string is not echoed back
        if HUGE in json.dumps(body):  # over the body limit: refused before it is read
            assert response.status_code == 413, response.text[:300]
            continue
        assert response.status_code == 422, response.text[:300]
        assert loc in [e["loc"][1:] for e in response.json()["detail"]], response.text[:300]
    for raw in ("NaN", "Infinity", "-Infinity"):  # JSON that Python's parser lets through
        body = '{"telemetry": {"gpus": [{"index": 0, "utilization": RAW}]}}'.replace("RAW", raw)
        response = agent.post(
            f"/nodes/{node['id']}/heartbeat",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422, response.text
        assert "utilization" in response.json()["detail"][0]["loc"]
    assert stored() == before
    shown = service.client().get("/market/nodes").json()
    assert [n["gpus"] for n in shown if n["id"] == node["id"]] == [
        [{"index": 0, "utilization": 40.0, "memory_used_mb": None, "power_w": None,
          "temperature_c": None}]
    ]  # fmt: skip


@one_database("validation and headers are decided before any query")
def test_hostile_inventory_is_a_422_naming_the_field(service):
    owner = service.tenant()
    service.grant_provider(owner)
    item = parse_declared("A100-80G:1")[0].to_json()
    cases = (({"name": SCRIPT}, "name"), ({"uuid": HUGE}, "uuid"), ({"uuid": "u" * 101}, "uuid"),
             ({"x": 1}, "x"))  # fmt: skip
    for change, field in cases:
        body = {"name": "n1", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 1,
                "reserve_price": 1.0, "inventory": [{**item, **change}]}  # fmt: skip
        response = owner.post("/nodes", json=body)
        if change.get("uuid") == HUGE:  # 5 MB: over the body limit, refused before it is read
            assert response.status_code == 413, response.text[:300]
            continue
        assert response.status_code == 422, response.text[:300]
        assert ["body", "inventory", 0, field] in [e["loc"] for e in response.json()["detail"]]
    assert owner.get("/nodes").json() == []
