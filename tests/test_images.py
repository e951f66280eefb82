"""The operator's image catalogue on the real service (SQLite and PostgreSQL, over HTTP): who
may change it, what it refuses, what it does to bids, and the images nodes report. Tried as the
attacks it stops: a tenant who edits the catalogue, a job that names a registry the operator
never chose, a provider whose heartbeat lies or floods."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conftest import ADMIN_KEY, Service, one_database, start_service
from prefect_spotgpu.worker.config import SEEDED_IMAGES, SpotGPUJobConfiguration
from test_service_api import bid, events, wait_event

TORCH = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
MINE = {"reference": "registry.example.com/ml/train:1.0", "framework": "PyTorch 2.5.1"}


def job(image: str | None = None) -> dict:
    body: dict = {"command": ["python", "-m", "prefect_spotgpu.launch"], "env": {"A": "1"}}
    if image is not None:
        body["image"] = image
    return body


def error_field(response) -> str:
    detail = response.json()["detail"]
    return ".".join(str(p) for p in detail[0]["loc"][1:]) if isinstance(detail, list) else ""


@pytest.fixture(scope="module")
def sqlite_service(tmp_path_factory) -> Iterator[Service]:
    """One service on one SQLite database for this module's tables of bad input: each is
    refused by the request's validation, before the route opens a transaction (so on either
    database alike), and each case checks that it changed nothing."""
    home = tmp_path_factory.mktemp("bad-input")
    service = start_service(f"sqlite:///{home / 'market.db'}", home / "home")
    yield service
    service.stop()


# ---------------------------------------------------------------- the seeded catalogue


@one_database("a read of the seeded catalogue")
def test_anyone_reads_the_seeded_catalogue_of_published_images(service):
    catalogue = service.client().get("/images")  # no key
    assert catalogue.status_code == 200, catalogue.text
    entries = catalogue.json()
    assert [e["name"] for e in entries] == sorted(SEEDED_IMAGES)
    # bases without prefect-spotgpu: only a job's own command; the default form offers none
    assert [e["name"] for e in entries if e["runs_flows"]] == []
    form = SpotGPUJobConfiguration.model_json_schema()["properties"]["image"]["anyOf"][0]
    assert form["enum"] == ["process"]
    by_name = {e["name"]: e for e in entries}
    assert by_name["pytorch"]["reference"] == TORCH
    assert by_name["pytorch"]["cuda_version"] == "12.4"
    assert by_name["tensorrt"]["reference"].startswith("nvcr.io/nvidia/tensorrt:")
    for entry in entries:  # every reference is pinned to a published tag, none is ours
        assert entry["framework"] and entry["description"]
        assert ":" in entry["reference"].rsplit("/", 1)[-1], entry
        assert "spotgpu" not in entry["reference"], entry


# ---------------------------------------------------------------- only the operator changes it


def test_the_operator_adds_replaces_and_removes_images(service):
    admin = service.admin
    added = admin.post("/images", json={"name": "train", **MINE, "cuda_version": "12.4"})
    assert added.status_code == 201, added.text
    assert added.json()["reference"] == MINE["reference"]
    assert added.json()["runs_flows"] is False  # unless the operator says it runs flows
    again = admin.post("/images", json={"name": "train", **MINE})
    assert again.status_code == 409 and again.json()["field"] == "name"
    replaced = admin.put(
        "/images/train", json={**MINE, "reference": "registry.example.com/ml/train:1.1"}
    )
    assert replaced.status_code == 200 and replaced.json()["reference"].endswith(":1.1")
    created = admin.put(
        "/images/render", json={**MINE, "framework": "Blender 4.2", "runs_flows": True}
    )
    assert created.status_code == 201 and created.json()["runs_flows"] is True
    names = [e["name"] for e in service.client().get("/images").json()]
    assert {"train", "render"} <= set(names) and names == sorted(names)
    assert admin.delete("/images/train").status_code == 204
    gone = admin.delete("/images/train")
    assert gone.status_code == 404 and "train" in gone.json()["detail"]
    assert "train" not in [e["name"] for e in service.client().get("/images").json()]
    process = admin.put("/images/process", json=MINE)
    assert process.status_code == 422 and process.json()["field"] == "name"


@one_database("roles are decided with the caller's key, before any write")
def test_a_tenant_or_a_node_cannot_change_the_catalogue(service):
    mallory = service.tenant()
    _, agent = service.node(service.tenant())
    evil = {"name": "pytorch", "reference": "evil.example.com/miner:1", "framework": "x"}
    for client, status in ((mallory, 403), (agent, 403), (service.client(), 401)):
        assert client.post("/images", json={**evil, "name": "miner"}).status_code == status
        assert client.put("/images/pytorch", json=evil).status_code == status
        assert client.delete("/images/pytorch").status_code == status
    pytorch = [e for e in service.client().get("/images").json() if e["name"] == "pytorch"]
    assert pytorch[0]["reference"] == TORCH


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "Has Space", **MINE}, "name"),
        ({"name": "x" * 64, **MINE}, "name"),
        ({"name": "ok", **MINE, "reference": "registry.example.com/ml/train:1\n"}, "reference"),
        ({"name": "ok", **MINE, "reference": "registry.example.com/../../etc:1"}, "reference"),
        ({"name": "ok", **MINE, "reference": "Registry/UPPER:1"}, "reference"),
        ({"name": "ok", **MINE, "reference": "r/" + "a" * 600}, "reference"),
        ({"name": "ok", **MINE, "framework": ""}, "framework"),
        ({"name": "ok", **MINE, "framework": "PyTorch\x1b[31m"}, "framework"),
        ({"name": "ok", **MINE, "cuda_version": "twelve"}, "cuda_version"),
        ({"name": "ok", **MINE, "description": "line one\nline two"}, "description"),
        ({"name": "ok", **MINE, "extra": 1}, "extra"),
        ({"name": "process", **MINE}, "name"),  # it means no container
        ({"name": "ok", **MINE, "runs_flows": "maybe"}, "runs_flows"),
    ],
)
def test_bad_catalogue_entries_get_422_naming_the_field_and_write_nothing(
    sqlite_service, body, field
):
    service = sqlite_service
    before = service.client().get("/images").json()
    response = service.admin.post("/images", json=body)
    assert response.status_code == 422, response.text
    assert error_field(response) == field, response.json()
    assert service.client().get("/images").json() == before


# ---------------------------------------------------------------- bids run catalogue images only


def test_a_bid_names_a_catalogue_image_by_name_or_reference_and_the_node_gets_the_reference(
    service,
):
    alice = service.tenant(credit=100)
    node, agent = service.node(service.tenant())
    by_name = bid(alice, gpu_count=1, job=job("pytorch"))
    by_reference = bid(alice, gpu_count=1, job=job(TORCH))
    process = bid(alice, gpu_count=1, job=job())
    for b in (by_name, by_reference, process):
        wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    jobs = {a["bid_id"]: a["job"] for a in agent.get(f"/nodes/{node['id']}/allocations").json()}
    assert jobs[by_name["id"]]["image"] == TORCH
    assert jobs[by_reference["id"]]["image"] == TORCH
    assert "image" not in jobs[process["id"]] or jobs[process["id"]]["image"] is None


@pytest.mark.parametrize(
    "image",
    [
        "ghcr.io/attacker/miner:latest",  # a registry the operator never chose
        "169.254.169.254:80/latest/meta-data:1",  # the cloud's metadata service, as a registry
        "127.0.0.1:2375/x:1",  # the node's own Docker API
        "no-such-name",
    ],
)
def test_a_bid_with_an_image_outside_the_catalogue_is_refused_naming_job_image(service, image):
    mallory = service.tenant(credit=100)
    refused = mallory.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.2, "job": job(image)}
    )
    assert refused.status_code == 422, refused.text
    assert refused.json()["field"] == "job.image"
    message = refused.json()["detail"][0]["msg"]
    assert "not in the market's catalogue" in message and "pytorch" in message
    assert mallory.get("/bids").json() == []  # nothing written


def test_a_removed_image_refuses_new_bids_but_placed_bids_keep_theirs(service):
    admin = service.admin
    assert admin.post("/images", json={"name": "train", **MINE}).status_code == 201
    alice = service.tenant(credit=100)
    placed = bid(alice, gpu_count=1, job=job("train"))
    assert admin.delete("/images/train").status_code == 204
    refused = alice.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.2, "job": job("train")},
    )
    assert refused.status_code == 422 and refused.json()["field"] == "job.image"
    node, agent = service.node(service.tenant())
    wait_event(alice, f"/bids/{placed['id']}/events", "allocated")
    jobs = {a["bid_id"]: a["job"] for a in agent.get(f"/nodes/{node['id']}/allocations").json()}
    assert jobs[placed["id"]]["image"] == MINE["reference"]


# ---------------------------------------------------------------- what nodes hold


def test_placement_prefers_the_node_that_reported_the_image(service):
    owner = service.tenant()
    first, first_agent = service.node(owner, gpus=4)
    second, second_agent = service.node(owner, gpus=4)
    beat = second_agent.post(f"/nodes/{second['id']}/heartbeat", json={"images": [TORCH, TORCH]})
    assert beat.status_code == 200 and beat.json()["images"] == [TORCH]
    assert owner.get(f"/nodes/{second['id']}").json()["images"] == [TORCH]
    assert first_agent.post(f"/nodes/{first['id']}/heartbeat", json={}).json()["images"] is None
    alice = service.tenant(credit=100)
    plain = bid(alice, gpu_count=4, job=job())
    allocated = wait_event(alice, f"/bids/{plain['id']}/events", "allocated")
    assert allocated["node_id"] == first["id"]  # no image: the lowest id, as before
    alice.post(f"/bids/{plain['id']}/cancel")
    service.wait_for(
        lambda: not first_agent.get(f"/nodes/{first['id']}/allocations").json(), timeout=10
    )
    torch = bid(alice, gpu_count=4, job=job("pytorch"))
    allocated = wait_event(alice, f"/bids/{torch['id']}/events", "allocated")
    assert allocated["node_id"] == second["id"]  # an equal fit that needs no pull


@pytest.mark.parametrize(
    "images",
    [
        ["pytorch/pytorch:2.5.1"] * 501,
        ["bad\nreference:1"],
        ["../../etc/passwd"],
        ["a" * 10_000],
        "pytorch/pytorch:2.5.1",
    ],
)
def test_a_hostile_heartbeat_is_422_naming_images_and_writes_nothing(sqlite_service, images):
    service = sqlite_service
    owner = service.tenant()
    node, agent = service.node(owner)
    response = agent.post(f"/nodes/{node['id']}/heartbeat", json={"images": images})
    assert response.status_code == 422, response.text
    assert error_field(response).startswith("images"), response.json()
    assert owner.get(f"/nodes/{node['id']}").json()["images"] is None


# ---------------------------------------------------------------- an image pull's progress


def test_an_image_pull_is_progress_on_the_bid_not_a_change(service):
    alice = service.tenant(credit=100)
    node, agent = service.node(service.tenant())
    b = bid(alice, gpu_count=1, job=job("pytorch"))
    allocated = wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    alloc = agent.get(f"/nodes/{node['id']}/allocations").json()[0]
    line = f"pulling {TORCH}: 1.2 of 3.4 GB (35 %), 4 of 12 layers done"
    report = {"epoch": alloc["epoch"], "outcome": "pulling", "detail": line}
    assert agent.post(f"/allocations/{alloc['id']}/report", json=report).status_code == 200
    pulled = wait_event(alice, f"/bids/{b['id']}/events", "pulling", after=allocated["id"])
    assert pulled["payload"]["detail"] == line and pulled["node_id"] == node["id"]
    assert alice.get(f"/allocations/{alloc['id']}").json()["status"] == "running"
    hostile = {**report, "detail": "<script>\r\nSet-Cookie: x"}
    refused = agent.post(f"/allocations/{alloc['id']}/report", json=hostile)
    assert refused.status_code == 422 and error_field(refused) == "detail"
    stale = agent.post(f"/allocations/{alloc['id']}/report", json={**report, "epoch": 99})
    assert stale.status_code == 409
    later = events(alice, f"/bids/{b['id']}/events", after=pulled["id"], timeout=1)["events"]
    assert [e["kind"] for e in later] == []


# ---------------------------------------------------------------- a cold rebuild keeps them


def test_the_rebuilt_market_knows_bid_and_node_images(service, db_url):
    from sqlalchemy.orm import Session

    from prefect_spotgpu.service.db import make_engine
    from prefect_spotgpu.service.market_rows import load_market
    from prefect_spotgpu.service.settings import ServiceSettings

    owner = service.tenant()
    node, agent = service.node(owner, gpu_model="H100-80G")
    agent.post(f"/nodes/{node['id']}/heartbeat", json={"images": [TORCH]})
    alice = service.tenant(credit=100)
    waiting = bid(alice, gpu_count=1, max_price=0.5, job=job("pytorch"))  # under the reserve
    settings = ServiceSettings(db_url=db_url, admin_key=ADMIN_KEY)
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            state = load_market(session=session, settings=settings).snapshot()
    finally:
        engine.dispose()
    assert {n.id: n.images for n in state.nodes}[node["id"]] == frozenset({TORCH})
    assert {b.id: b.image for b in state.bids}[waiting["id"]] == TORCH
