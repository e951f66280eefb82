"""The replies the service's clients read are one set of models (``prefect_spotgpu.messages``):
the service answers with them, the agent and the worker parse them, and both ends of the wire
agree."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from pydantic import ValidationError

from conftest import one_database
from helpers import assignment, bid, bid_event, image, quote
from prefect_spotgpu import messages
from prefect_spotgpu.agent.credentials import CredentialError, obtain_node_token
from prefect_spotgpu.service import schemas
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration
from prefect_spotgpu.worker.market_api import MarketApi


def test_the_service_answers_with_the_models_its_clients_parse():
    for name in (
        "Assignment",
        "AllocationResponse",
        "EventsPage",
        "EventResponse",
        "BidResponse",
        "BidBatchResponse",
        "QuoteResponse",
        "NodeResponse",
        "NodeCreated",
        "NodeToken",
        "ImageResponse",
        "WebhookConfigResponse",
    ):
        assert getattr(schemas, name) is getattr(messages, name), name


def test_a_newer_services_extra_fields_are_ignored_and_an_older_ones_missing_defaults_kept():
    newer = assignment(3).model_dump() | {"new_field": 1}
    newer["job"] = {"command": ["python"], "env": {"A": "1"}, "resources": {"shm": "1g"}}
    parsed = messages.Assignment.model_validate(newer)
    assert parsed.job.command == ["python"] and parsed.job.env == {"A": "1"}
    older = {k: v for k, v in assignment(3).model_dump().items() if k not in ("rank", "gang")}
    older["job"] = {"command": ["python"]}  # no env, image or checkpoint_url yet
    parsed = messages.Assignment.model_validate(older)
    assert parsed.rank is None and parsed.gang is None and parsed.job.env == {}


def test_a_reply_without_a_field_the_agent_needs_fails_naming_it():
    reply = assignment(3).model_dump()
    del reply["epoch"]
    with pytest.raises(ValidationError, match="epoch"):
        messages.Assignment.model_validate(reply)
    with pytest.raises(ValidationError, match="cursor"):
        messages.EventsPage.model_validate({"events": []})


@pytest.mark.parametrize(
    ("model", "reply"),
    [
        (messages.BidResponse, bid(id=3).model_dump(mode="json")),
        (messages.QuoteResponse, quote("eu-west").model_dump(mode="json")),
    ],
    ids=["bid", "quote"],
)
def test_a_bid_or_a_quote_with_a_newer_services_extra_field_still_parses(model, reply):
    parsed = model.model_validate(reply | {"preemptible_until": "2027-01-01", "score": 0.5})
    assert parsed == model.model_validate(reply)
    assert not hasattr(parsed, "score")


def test_an_older_markets_bid_without_capacity_or_gangs_reads_with_the_defaults():
    older = bid(id=3).model_dump(mode="json")
    for field in ("capacity", "node_count", "gang_id", "members", "job"):
        del older[field]
    parsed = messages.BidResponse.model_validate(older)
    assert (parsed.capacity, parsed.node_count, parsed.members) == ("spot", 1, [])


@pytest.mark.parametrize(
    ("model", "reply", "missing"),
    [
        (messages.BidResponse, bid(id=3).model_dump(mode="json"), "max_price"),
        (messages.BidResponse, bid(id=3).model_dump(mode="json"), "status"),
        (messages.QuoteResponse, quote("eu-west").model_dump(mode="json"), "gpus_free"),
        (messages.QuoteResponse, quote("eu-west").model_dump(mode="json"), "reserve_price"),
    ],
)
def test_a_bid_or_a_quote_without_a_field_the_worker_needs_fails_naming_it(model, reply, missing):
    del reply[missing]
    with pytest.raises(ValidationError, match=missing):
        model.model_validate(reply)


def test_a_batch_reply_names_the_bid_and_the_field_it_lacks():
    placed = bid(id=3).model_dump(mode="json")
    del placed["gpu_model"]
    with pytest.raises(ValidationError, match=r"bids\.0\.gpu_model"):
        messages.BidBatchResponse.model_validate({"bids": [placed], "created": [True]})


# ---------------------------------------------------------- an event's payload, by its kind

NOTICE = {"allocation_id": 11, "bid_id": 7, "node_id": 1, "event": "noticed", "at": 1700.0,
          "reason": "outbid", "deadline": 1760.0, "epoch": 2}  # fmt: skip
"""A ``noticed`` event's payload as the service writes it (``TickWrites.event``)."""


def _event(payload: dict) -> dict:
    return bid_event("noticed", 11).model_dump(mode="json") | {"payload": payload}


def test_an_events_payload_keeps_a_key_it_does_not_know_and_reads_as_written():
    """A newer service's key is kept (``extra="allow"``), the known ones read as fields; the
    payload dumps as it came, a field it lacks not added as null (what an older client that
    reads it as a mapping, or a Prefect event, gets)."""
    written = NOTICE | {"urgency": {"level": "high"}}
    page = messages.EventsPage.model_validate({"events": [_event(written)], "cursor": 1})
    payload = page.events[0].payload
    assert (payload.deadline, payload.epoch, payload.reason) == (1760.0, 2, "outbid")
    assert payload.at == 1700.0 and payload.detail is None and payload.placement is None
    assert payload.urgency == {"level": "high"} and payload.model_extra["allocation_id"] == 11
    assert page.model_dump(mode="json")["events"][0]["payload"] == written
    assert messages.EventsPage.model_validate_json(page.model_dump_json()) == page
    assert messages.EventResponse.model_validate(_event({})).payload.model_dump() == {}


@pytest.mark.parametrize(
    ("key", "value"),
    [("deadline", "soon"), ("epoch", 1.5), ("epoch", "two"), ("at", "now"),
     ("reason", ["outbid"]), ("detail", 404), ("placement", {"kind": "new"})],
)  # fmt: skip
def test_an_events_payload_key_of_the_wrong_type_fails_naming_it(key, value):
    with pytest.raises(ValidationError, match=rf"payload\.{key}\n") as e:
        messages.EventResponse.model_validate(_event(NOTICE | {key: value}))
    assert [error["loc"] for error in e.value.errors()] == [("payload", key)]
    with pytest.raises(ValidationError, match=rf"events\.0\.payload\.{key}\n"):
        messages.EventsPage.model_validate({"events": [_event({key: value})], "cursor": 1})


def test_the_agent_reads_an_events_payload_by_its_fields(tmp_path):
    """``Agent.handle``: each event's epoch kept, a migration target started, a notice given
    its deadline and epoch, an end stopped; a notice without a deadline fails that event alone
    (the loop logs it and goes on), its epoch still kept."""
    from prefect_spotgpu.agent.agent import Agent
    from prefect_spotgpu.agent.discovery import parse_declared
    from prefect_spotgpu.agent.runners import ProcessRunner

    agent = Agent(market="http://market", token=None, runner=ProcessRunner(),
                  gpus=parse_declared("A100-80G:1"), declared=True, state_dir=tmp_path,
                  name="rack-1")  # fmt: skip
    calls = []
    agent.start = lambda alloc_id: calls.append(("start", alloc_id))
    agent.notice = lambda alloc_id, deadline, epoch: calls.append(
        ("notice", alloc_id, deadline, epoch)
    )
    agent.stop = lambda alloc_id, reason, grace=None: calls.append(("stop", alloc_id, grace))
    agent.handle(bid_event("reserved", 11, placement="takeover", epoch=1))  # starts when promoted
    agent.handle(bid_event("reserved", 12, placement="migration", epoch=1))
    agent.handle(bid_event("noticed", 12, deadline=1760.0, epoch=2, reason="outbid"))
    agent.handle(bid_event("preempted", 12, reason="notice deadline passed"))  # no epoch
    with pytest.raises(ValueError, match="no deadline"):
        agent.handle(bid_event("noticed", 13, epoch=4, reason="reclaimed"))
    assert calls == [("start", 12), ("notice", 12, 1760.0, 2), ("stop", 12, 0)]
    assert agent.epochs == {11: 1, 12: 2, 13: 4}


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_real_node_reads_its_assignments_and_events_as_models(service, tmp_path):
    """The agent's own parsing, against the real service: the allocation of a bid on its node,
    then the page of events that started it; a checkpoint report as the first agents sent it
    (no step) is accepted."""
    owner, buyer = service.tenant(), service.tenant()
    node, node_client = service.node(owner, gpus=1)
    placed = buyer.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, "region": "eu-west",
              "job": {"command": ["sleep", "60"], "env": {"SECRET": "s"}}},
    )  # fmt: skip
    placed.raise_for_status()
    placed = messages.BidResponse.model_validate(placed.json())  # what the worker reads
    assert placed.gpu_model == "A100-80G" and placed.job["env_names"] == ["SECRET"]

    def assigned():
        reply = node_client.get(f"/nodes/{node['id']}/allocations").json()
        return [messages.Assignment.model_validate(a) for a in reply]

    (alloc,) = service.wait_for(assigned, 20)
    assert alloc.status == "running" and alloc.job.command == ["sleep", "60"]
    assert alloc.job.env == {"SECRET": "s"} and alloc.checkpoint_key == f"bid-{alloc.bid_id}"
    assert alloc.bid_id == placed.id
    quotes = [messages.QuoteResponse.model_validate(q) for q in buyer.get("/prices").json()]
    assert [(q.region, q.gpus_total) for q in quotes if q.capacity == "spot"] == [("eu-west", 1)]
    page = node_client.get(f"/nodes/{node['id']}/events", params={"after": 0, "timeout": 1})
    events = messages.EventsPage.model_validate(page.json())
    assert [e.kind for e in events.events][:1] == ["allocated"]
    assert events.events[0].allocation_id == alloc.id and events.cursor >= events.events[0].id
    allocated = events.events[0].payload  # the service's payload, as it wrote it: no nulls added
    assert (allocated.placement, allocated.epoch, allocated.gpu_count) == ("new", 1, 1)
    assert "deadline" not in page.json()["events"][0]["payload"]
    older = {"epoch": alloc.epoch, "outcome": "checkpoint", "checkpoint_at": time.time()}
    reported = node_client.post(f"/allocations/{alloc.id}/report", json=older)  # no step
    assert reported.status_code == 200, reported.text
    assert messages.AllocationResponse.model_validate(reported.json()).id == alloc.id


NODE = {
    "id": 4,
    "owner_id": 2,
    "name": "rack-1",
    "gpu_model": "A100-80G",
    "region": "eu-west",
    "gpu_count": 8,
    "reserve_price": 0.9,
    "state": "live",
    "declared": False,
    "last_heartbeat_at": "2026-12-01T00:00:00Z",
}
"""A node's reply as an older market sent it: no capacity, inventory, telemetry, images,
address or runner terms yet."""


@pytest.mark.parametrize(
    ("model", "reply"),
    [
        (messages.NodeResponse, NODE),
        (messages.NodeCreated, NODE | {"token": "sgn_x"}),
        (messages.NodeToken, {"token": "sgn_x"}),
        (messages.ImageResponse, image("pytorch", "pytorch/pytorch:2.5.1").model_dump(mode="json")),
        (messages.WebhookConfigResponse, {"url": None, "has_secret": False}),
    ],
    ids=["node", "node-created", "node-token", "image", "webhook"],
)
def test_a_node_an_image_or_a_webhook_with_a_newer_services_extra_field_still_parses(model, reply):
    parsed = model.model_validate(reply | {"score": 0.5})
    assert parsed == model.model_validate(reply) and not hasattr(parsed, "score")


def test_an_older_markets_node_reads_with_the_defaults():
    node = messages.NodeResponse.model_validate(NODE)
    assert (node.capacity, node.runner, node.images, node.address) == ("spot", None, None, None)


@pytest.mark.parametrize(
    ("model", "reply", "missing"),
    [
        (messages.NodeResponse, NODE, "gpu_count"),
        (messages.NodeResponse, NODE, "gpu_model"),
        (messages.NodeCreated, NODE | {"token": "sgn_x"}, "token"),
        (messages.NodeCreated, NODE | {"token": "sgn_x"}, "id"),
        (messages.NodeToken, {"token": "sgn_x"}, "token"),
        (messages.ImageResponse, image("pytorch", "p/t:1").model_dump(mode="json"), "reference"),
        (messages.WebhookConfigResponse, {"url": None, "has_secret": False}, "url"),
    ],
)
def test_a_node_an_image_or_a_webhook_without_a_needed_field_fails_naming_it(model, reply, missing):
    reply = dict(reply)
    del reply[missing]
    with pytest.raises(ValidationError, match=missing):
        model.model_validate(reply)


def test_the_agent_names_the_field_a_registration_reply_lacks():
    """A market whose reply lacks the node's token: the agent's ``CredentialError`` (what
    ``spotgpu agent`` prints) names it, not a ``KeyError``."""

    def market(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, json=NODE)  # a node, but no token

    client = httpx.Client(transport=httpx.MockTransport(market), base_url="http://market")
    with pytest.raises(CredentialError, match="registration does not parse as NodeCreated") as e:
        registration = messages.NodeRegistration(name="rack-1", gpu_model="A100-80G", region="r",
                                                 gpu_count=1)  # fmt: skip
        obtain_node_token(client, "http://market", registration)
    assert "\ntoken\n" in str(e.value) and "\nid\n" not in str(e.value)


def test_the_worker_reads_the_catalogue_and_its_webhook_as_models():
    """``MarketApi.images()`` is typed entries (``catalogue_image`` reads them); the webhook
    already set is not PUT again, another one is."""
    entry = image("train", "ghcr.io/me/train:1").model_dump(mode="json") | {"licence": "MIT"}
    put = []

    def market(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            put.append(request.content)
            return httpx.Response(200, json={"url": "https://x.test/new", "has_secret": False})
        if request.url.path == "/images":
            return httpx.Response(200, json=[entry])
        return httpx.Response(200, json={"url": "https://x.test/hook", "has_secret": True})

    async def talk():
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(market), base_url="http://market"
        ) as http:
            api = MarketApi(http)
            await api.set_webhook("https://x.test/hook")
            await api.set_webhook("https://x.test/new")
            return await api.images()

    catalogue = asyncio.run(talk())
    assert [type(e) for e in catalogue] == [messages.ImageResponse] and len(put) == 1
    assert SpotGPUJobConfiguration(image="train").catalogue_image(catalogue) == entry["reference"]


# ------------------------------------------------- what an agent sends: old ones still parse


def test_an_older_agents_registration_and_heartbeat_are_accepted(api):
    """An agent from before runner terms, addresses and image lists: it registers with what
    it had then and heartbeats with telemetry alone; the replies parse as the agent reads
    them."""
    owner = api.tenant()
    api.grant_provider(owner)
    registration = {"name": "old-agent", "gpu_model": "A100-80G", "region": "eu-west",
                    "gpu_count": 1, "reserve_price": 0.9}  # fmt: skip
    created = owner.post("/nodes", json=registration)
    assert created.status_code == 201, created.text
    node = messages.NodeCreated.model_validate(created.json())
    agent = api.client(node.token)
    for body in (
        {"telemetry": {"jobs": 0, "gpus": [{"index": 0, "utilization": 5, "power_w": 60.0}]}},
        {"telemetry": {"jobs": 0, "declared": True}},
        {},
    ):
        beat = agent.post(f"/nodes/{node.id}/heartbeat", json=body)
        assert beat.status_code == 200, (body, beat.text)
        assert messages.NodeResponse.model_validate(beat.json()).runner is None
    me = messages.NodeResponse.model_validate(agent.get("/nodes/me").json())
    assert (me.id, me.gpu_count, me.gpu_model) == (node.id, 1, "A100-80G")


def test_an_older_agents_report_parses(api):
    """A report with only what the first agents sent (no cause, step or detail) gets past the
    body's validation: the route answers for the allocation (this node holds none), never a
    422. (Accepted on a real allocation: ``test_a_real_node_reads_...`` below.)"""
    _, agent = api.node(api.tenant(), gpus=1)
    for body in (
        {"epoch": 1, "outcome": "finished"},
        {"epoch": 1, "outcome": "checkpoint", "checkpoint_at": time.time()},
    ):
        response = agent.post("/allocations/999999/report", json=body)
        assert response.status_code == 404, response.text
        assert schemas.AllocationReport.model_validate(body).cause is None


def _refused_fields(response: httpx.Response) -> list[list]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["detail"]]


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"outcome": "finished"}, ["body", "epoch"]),
        ({"epoch": 1}, ["body", "outcome"]),
        ({"epoch": "1", "outcome": "finished"}, ["body", "epoch"]),
        ({"epoch": 1, "outcome": "exploded"}, ["body", "outcome"]),
        ({"epoch": 1, "outcome": "saved", "step": -1}, ["body", "step"]),
        ({"epoch": 1, "outcome": "failed", "why": "newer"}, ["body", "why"]),
    ],
    ids=["no-epoch", "no-outcome", "string-epoch", "unknown-outcome", "bad-step", "unknown"],
)
def test_a_malformed_report_is_422_naming_the_field(api, body, loc):
    _, agent = api.node(api.tenant(), gpus=1)
    assert _refused_fields(agent.post("/allocations/999999/report", json=body)) == [loc]


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"telemetry": {"jobs": "many"}}, ["body", "telemetry", "jobs"]),
        ({"telemetry": {"gpus": [{"utilization": 5}]}}, ["body", "telemetry", "gpus", 0, "index"]),
        ({"address": "169.254.0.1"}, ["body", "address"]),
        ({"runner": "podman"}, ["body", "runner"]),
        ({"gpu_clocks": [1, 2]}, ["body", "gpu_clocks"]),
    ],
    ids=["bad-jobs", "gpu-without-index", "link-local-address", "unknown-runner", "unknown"],
)
def test_a_malformed_heartbeat_is_422_naming_the_field(api, body, loc):
    """What ``agent.heartbeat.send_heartbeat`` reads to send again without a field a market
    older than the agent refuses."""
    node, agent = api.node(api.tenant(), gpus=1)
    assert _refused_fields(agent.post(f"/nodes/{node['id']}/heartbeat", json=body)) == [loc]


@pytest.mark.parametrize(
    ("service_model", "shared"),
    [
        ("BidCreate", "BidRequest"),
        ("JobSpec", "JobSpec"),
        ("NodeCreate", "NodeRegistration"),
        ("Heartbeat", "Heartbeat"),
        ("AllocationReport", "AllocationReport"),
    ],
)
def test_each_request_the_service_takes_is_the_shared_model_with_its_checks(service_model, shared):
    """The service declares the shared request models as its own (subclasses adding its
    checks): the same fields, so a client never sends a field the service does not know (it
    forbids unknown ones), and the OpenAPI schema is the contract."""
    service, client = getattr(schemas, service_model), getattr(messages, shared)
    assert issubclass(service, client)
    assert set(service.model_fields) == set(client.model_fields)
    assert service.model_config.get("extra") == "forbid"


def test_a_bid_body_holds_only_what_it_sets():
    """``BidRequest.body()``: a field left unset is not sent (an older market, which forbids
    unknown fields, never sees ``min_node_count`` unless the bid needs it)."""
    job = messages.JobSpec(command=["python", "x.py"])
    body = messages.BidRequest(gpu_model="A100-80G", gpu_count=2, max_price=1.2, job=job).body()
    assert "min_node_count" not in body and "deadline" not in body
    assert body["job"] == {"command": ["python", "x.py"], "env": {}}
