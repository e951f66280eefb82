"""The replies the service's clients read are one set of models (``prefect_spotgpu.messages``):
the service answers with them, the agent parses them, and both ends of the wire agree."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from helpers import assignment
from prefect_spotgpu import messages
from prefect_spotgpu.service import schemas


def test_the_service_answers_with_the_models_its_clients_parse():
    assert schemas.Assignment is messages.Assignment
    assert schemas.AllocationResponse is messages.AllocationResponse
    assert schemas.EventsPage is messages.EventsPage
    assert schemas.EventResponse is messages.EventResponse


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


def test_a_real_node_reads_its_assignments_and_events_as_models(service, tmp_path):
    """The agent's own parsing, against the real service: the allocation of a bid on its node,
    then the page of events that started it."""
    owner, buyer = service.tenant(), service.tenant()
    node, node_client = service.node(owner, gpus=1)
    buyer.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, "region": "eu-west",
              "job": {"command": ["sleep", "60"], "env": {"SECRET": "s"}}},
    ).raise_for_status()  # fmt: skip

    def assigned():
        reply = node_client.get(f"/nodes/{node['id']}/allocations").json()
        return [messages.Assignment.model_validate(a) for a in reply]

    (alloc,) = service.wait_for(assigned, 20)
    assert alloc.status == "running" and alloc.job.command == ["sleep", "60"]
    assert alloc.job.env == {"SECRET": "s"} and alloc.checkpoint_key == f"bid-{alloc.bid_id}"
    page = node_client.get(f"/nodes/{node['id']}/events", params={"after": 0, "timeout": 1})
    events = messages.EventsPage.model_validate(page.json())
    assert [e.kind for e in events.events][:1] == ["allocated"]
    assert events.events[0].allocation_id == alloc.id and events.cursor >= events.events[0].id
