"""Runners and images meet through the real service, on real SQLite and PostgreSQL: nodes say
how they run jobs (registration and heartbeats), the market places a bid only where it can run
as asked, and a bid no node serves is held with a reason naming it, until one does."""

from __future__ import annotations

import pytest

from conftest import one_database
from test_images import TORCH, job
from test_service_api import bid, wait_event

PROCESS_HELD = "no node can run it: the A100-80G nodes in eu-west run jobs as host processes"


def allocated_node(client, b) -> int:
    return wait_event(client, f"/bids/{b['id']}/events", "allocated")["node_id"]


def test_image_bids_go_to_docker_nodes_and_process_bids_to_process_nodes(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    process, _ = service.node(owner, gpus=4, reserve=0.5, runner="process")
    docker, _ = service.node(owner, gpus=4, reserve=0.9, runner="docker")
    imaged = bid(alice, job=job(TORCH))
    plain = bid(alice, job=job())
    assert allocated_node(alice, imaged) == docker["id"]  # not the cheaper process node
    assert allocated_node(alice, plain) == process["id"]
    listed = {n["id"]: n for n in owner.get("/nodes").json()}
    assert (
        listed[docker["id"]]["runner"] == "docker" and listed[process["id"]]["runner"] == "process"
    )


def test_a_bid_no_node_serves_is_held_naming_why_and_opens_when_one_does(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    service.node(owner, gpus=4, runner="process")
    imaged = bid(alice, job=job(TORCH))
    held = service.wait_for(
        lambda: (b := alice.get(f"/bids/{imaged['id']}").json())["status"] == "held" and b
    )
    assert held["hold_reason"].startswith(PROCESS_HELD), held["hold_reason"]
    assert "--runner docker" in held["hold_reason"]
    # the owner restarts another host's agent as a Docker node: the bid opens and runs there
    docker, agent = service.node(owner, gpus=4, runner="process")
    response = agent.post(f"/nodes/{docker['id']}/heartbeat", json={"runner": "docker"})
    assert response.status_code == 200, response.text
    assert allocated_node(alice, imaged) == docker["id"]
    assert alice.get(f"/bids/{imaged['id']}").json()["status"] == "open"


def test_a_docker_node_serves_bids_without_an_image_only_with_a_default_image(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    node, agent = service.node(owner, gpus=4, runner="docker")
    plain = bid(alice, job=job())
    held = service.wait_for(
        lambda: (b := alice.get(f"/bids/{plain['id']}").json())["status"] == "held" and b
    )
    assert "without a default image" in held["hold_reason"], held["hold_reason"]
    body = {"runner": "docker", "default_image": TORCH}
    assert agent.post(f"/nodes/{node['id']}/heartbeat", json=body).status_code == 200
    assert allocated_node(alice, plain) == node["id"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"runner": "podman"}, "runner"),
        ({"runner": "process", "default_image": TORCH}, "default_image"),
        ({"default_image": TORCH}, "default_image"),
    ],
)
@one_database("validation and headers are decided before any query")
def test_a_bad_runner_is_a_422_naming_the_field_and_changes_nothing(service, body, field):
    owner = service.tenant()
    node, agent = service.node(owner, gpus=2, runner="docker")
    response = agent.post(f"/nodes/{node['id']}/heartbeat", json=body)
    assert response.status_code == 422 and field in response.text, response.text
    assert owner.get("/nodes").json()[0]["runner"] == "docker"
    service.grant_provider(owner)
    refused = owner.post(
        "/nodes",
        json={"name": "x", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 1,
              "reserve_price": 0.9, **body},
    )  # fmt: skip
    assert refused.status_code == 422 and field in refused.text


def test_one_node_cannot_say_another_nodes_runner(service):
    owner, mallory = service.tenant(), service.tenant()
    node, _ = service.node(owner, gpus=2, runner="docker")
    _, other_agent = service.node(mallory, gpus=2, runner="process")
    response = other_agent.post(f"/nodes/{node['id']}/heartbeat", json={"runner": "process"})
    assert response.status_code in (403, 404)
    assert owner.get("/nodes").json()[0]["runner"] == "docker"


def test_bids_held_until_a_node_serves_them_still_reserve_credit(service):
    """As a hostile buyer would try: image bids into a pool of process nodes are held, so each
    next one would pass admission, and all would open at once when a Docker node comes. They
    reserve credit while held: the balance covers them, or the next bid is a 402."""
    owner = service.tenant()
    service.node(owner, gpus=4, runner="process")
    # one 4-GPU bid at 1.2 over the admission horizon (notice + 10 ticks: 301 s) is ~0.40
    mallory = service.tenant(credit=1.0)
    first = bid(mallory, job=job(TORCH))
    second = bid(mallory, job=job(TORCH))
    for b in (first, second):
        service.wait_for(lambda b=b: mallory.get(f"/bids/{b['id']}").json()["status"] == "held")
    refused = mallory.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 4, "max_price": 1.2, "region": "eu-west",
              "job": job(TORCH)},
    )  # fmt: skip
    assert refused.status_code == 402, refused.text
