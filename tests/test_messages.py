"""The replies the service's clients read are one set of models (``prefect_spotgpu.messages``):
the service answers with them, the agent and the worker parse them, and both ends of the wire
agree."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from helpers import assignment, bid, quote
from prefect_spotgpu import messages
from prefect_spotgpu.service import schemas


def test_the_service_answers_with_the_models_its_clients_parse():
    assert schemas.Assignment is messages.Assignment
    assert schemas.AllocationResponse is messages.AllocationResponse
    assert schemas.EventsPage is messages.EventsPage
    assert schemas.EventResponse is messages.EventResponse
    assert schemas.BidResponse is messages.BidResponse
    assert schemas.BidBatchResponse is messages.BidBatchResponse
    assert schemas.QuoteResponse is messages.QuoteResponse


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


def test_a_real_node_reads_its_assignments_and_events_as_models(service, tmp_path):
    """The agent's own parsing, against the real service: the allocation of a bid on its node,
    then the page of events that started it."""
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
