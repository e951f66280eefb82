"""The market service end to end over HTTP, on real SQLite and real PostgreSQL."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa


def events(client, path, after=0, timeout=5.0):
    response = client.get(path, params={"after": after, "timeout": timeout})
    assert response.status_code == 200, response.text
    return response.json()


def wait_event(client, path, kind, after=0, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page = events(client, path, after, timeout=deadline - time.monotonic())
        for event in page["events"]:
            if event["kind"] == kind:
                return event
        after = page["cursor"]
    raise AssertionError(f"no {kind} event on {path}")


def bid(client, **fields):
    body = {"gpu_model": "A100-80G", "gpu_count": 4, "max_price": 1.2, "region": "eu-west"}
    body.update(fields)
    response = client.post("/bids", json=body)
    assert response.status_code in (200, 201), response.text
    return response.json()


# ---------------------------------------------------------------- connections


def test_the_server_keeps_an_idle_connection_longer_than_a_client_reuses_one(tmp_path):
    """A client's pooled connection is never closed by the service just as the client sends on
    it ("Server disconnected without sending a response"): the service keeps an idle connection
    open for longer than httpx keeps one, in ``spotgpu server start`` and in the tests' servers.
    A raw connection idle past httpx's limit still gets its second answer."""
    import http.client
    from pathlib import Path

    import httpx

    from conftest import start_service
    from prefect_spotgpu.service.server import KEEP_ALIVE_SECONDS, uvicorn_config

    client_idle = httpx.Limits().keepalive_expiry  # (httpx's default: 5 s)
    assert 2 * client_idle <= KEEP_ALIVE_SECONDS
    assert uvicorn_config(None, "127.0.0.1", 1, "info").timeout_keep_alive == KEEP_ALIVE_SECONDS
    proxies = (Path(__file__).parent.parent / "docs" / "operators" / "tls.md").read_text()
    assert f"connection left idle for {KEEP_ALIVE_SECONDS} s" in " ".join(proxies.split())
    service = start_service(f"sqlite:///{tmp_path / 'market.db'}", tmp_path / "home")
    try:
        assert service.server.config.timeout_keep_alive == KEEP_ALIVE_SECONDS
        host, port = service.base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/api/v1/health")
            assert conn.getresponse().read()
            sock = conn.sock
            time.sleep(client_idle + 0.5)  # (uvicorn's own timer: only the wall clock shows it)
            conn.request("GET", "/api/v1/health")  # on the same connection, or it fails
            assert conn.getresponse().status == 200 and conn.sock is sock
        finally:
            conn.close()
    finally:
        service.stop()


# ---------------------------------------------------------------- auth and tenants


def test_tenants_keys_and_roles(service):
    alice = service.tenant("alice")
    assert alice.get("/me").json()["name"] == "alice"
    assert alice.get("/me").json()["balance"] == 10.0  # the starting credit
    assert service.client("sgk_not-a-key").get("/me").status_code == 401
    assert service.client().get("/me").status_code == 401
    assert alice.post("/tenants", json={"name": "eve"}).status_code == 403
    assert alice.get("/tenants").status_code == 403
    assert service.admin.get("/me").status_code == 403
    duplicate = service.admin.post("/tenants", json={"name": "alice"})
    assert duplicate.status_code == 409 and "taken" in duplicate.json()["detail"]


def test_a_tenant_sees_only_its_own_bids_and_nodes(service):
    alice, bob = service.tenant(), service.tenant()
    b = bid(alice)
    assert bob.get(f"/bids/{b['id']}").status_code == 404
    assert bob.post(f"/bids/{b['id']}/cancel").status_code == 404
    assert bob.patch(f"/bids/{b['id']}", json={"max_price": 9.0}).status_code == 404
    assert bob.get(f"/bids/{b['id']}/events").status_code == 404
    assert [x["id"] for x in bob.get("/bids").json()] == []
    node, _ = service.node(alice)
    assert bob.get(f"/nodes/{node['id']}").status_code == 404
    assert bob.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"}).status_code == 404
    service.grant_provider(bob)  # a provider, but not this node's
    assert bob.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"}).status_code == 404
    assert service.admin.get(f"/nodes/{node['id']}").status_code == 200


def test_a_node_token_acts_only_for_its_node(service):
    owner = service.tenant()
    x, x_agent = service.node(owner)
    y, _ = service.node(owner)
    assert x_agent.post(f"/nodes/{x['id']}/heartbeat", json={}).status_code == 200
    refused = x_agent.post(f"/nodes/{y['id']}/heartbeat", json={})
    assert refused.status_code == 403 and "not node" in refused.json()["detail"]
    assert x_agent.get(f"/nodes/{y['id']}/events").status_code == 403
    assert x_agent.get("/me").status_code == 403  # a node token is not a tenant key
    assert owner.post(f"/nodes/{x['id']}/heartbeat", json={}).status_code == 403


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"gpu_model": "B200"}, "gpu_model"),
        ({"gpu_count": 0}, "gpu_count"),
        ({"gpu_count": 17}, "gpu_count"),
        ({"max_price": -1}, "max_price"),
        ({"max_price": 0}, "max_price"),
        ({"region": "EU WEST!"}, "region"),
        ({"surprise": 1}, "surprise"),
        ({"window_start": "2026-01-01T00:00:00Z"}, None),
        (
            {
                "window_start": "9999-12-31T20:00:00-05:00",
                "window_end": "9999-12-31T23:00:00-05:00",
            },
            None,
        ),
        ({"deadline": "0001-01-01T00:00:00+05:00"}, None),
        ({"window_start": "2026-01-02T00:00:00Z", "window_end": "2026-01-01T00:00:00Z"}, None),
    ],
)
def test_bad_bids_get_422_naming_the_field_and_write_nothing(api, body, field):
    alice = api.tenant()
    full = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, **body}
    response = alice.post("/bids", json=full)
    assert response.status_code == 422, response.text
    if field is not None:
        assert any(field in err["loc"] for err in response.json()["detail"]), response.text
    assert alice.get("/bids").json() == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"labels": {"a\u0000": "b"}}, "labels"),
        ({"idempotency_key": "x\u0000y"}, "idempotency_key"),
        ({"region": "eu\u0000"}, "region"),
    ],
)
def test_nul_characters_are_422_not_500(service, body, field):
    alice = service.tenant()
    response = alice.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, **body}
    )
    assert response.status_code == 422, response.text
    assert any(field in err["loc"] for err in response.json()["detail"])
    service.grant_provider(alice)
    response = alice.post(
        "/nodes",
        json={
            "name": "n1",
            "gpu_model": "A100-80G",
            "region": "eu-west",
            "gpu_count": 8,
            "reserve_price": 1.0,
            "inventory": [{"x": "\u0000"}],
        },
    )
    assert response.status_code == 422


LONE = "\\ud800"  # JSON's escape of a lone surrogate: valid JSON, no UTF-8
BID = '"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0'


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (f'{{{BID}, "idempotency_key": "k{LONE}"}}', ["body", "idempotency_key"]),
        (f'{{{BID}, "labels": {{"a{LONE}": "b"}}}}', ["body", "labels"]),
        (f'{{{BID}, "labels": {{"a": "{LONE}"}}}}', ["body", "labels"]),
        (f'{{{BID}, "job": {{"command": ["echo", "{LONE}"]}}}}', ["body", "job", "command"]),
        (
            f'{{{BID}, "job": {{"command": ["x"], "checkpoint_url": "s3://b/{LONE}"}}}}',
            ["body", "job", "checkpoint_url"],
        ),
        (f'{{{BID}, "{LONE}": 1}}', ["body"]),  # a key: the object holding it is named
    ],
)
def test_lone_surrogates_are_422_naming_the_field_and_write_nothing(api, body, loc):
    alice = api.tenant()
    raw = {"content": body, "headers": {"content-type": "application/json"}}
    response = alice.post("/bids", **raw)
    assert response.status_code == 422, response.text
    errors = response.json()["detail"]
    assert any(err["loc"][: len(loc)] == loc for err in errors), errors
    batch = f'{{"bids": [{{{BID}}}, {{{BID}}}, {body}]}}'
    response = alice.post("/bids/batch", content=batch, headers=raw["headers"])
    assert response.status_code == 422, response.text
    assert any(
        err["loc"][:3] == ["body", "bids", 2] and err["loc"][3:] == loc[1:]
        for err in response.json()["detail"]
    ), response.text
    assert alice.get("/bids").json() == []


def test_a_nul_in_a_batch_item_is_named_by_its_index(api):
    alice = api.tenant()
    bid = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0}
    bad = {**bid, "job": {"command": ["echo", "a\u0000b"]}}
    response = alice.post("/bids/batch", json={"bids": [bid, bid, bad]})
    assert response.status_code == 422, response.text
    locs = [err["loc"] for err in response.json()["detail"]]
    assert ["body", "bids", 2, "job", "command"] in locs, locs
    assert alice.get("/bids").json() == []


def test_lone_surrogates_elsewhere_are_422_not_500(api):
    headers = {"content-type": "application/json"}
    name = api.admin.post("/tenants", content=f'{{"name": "t{LONE}"}}', headers=headers)
    assert name.status_code == 422 and name.json()["detail"][0]["loc"] == ["body", "name"]
    anonymous = api.client().post(
        "/estimate",
        content=f'{{"gpu_model": "A100{LONE}", "gpu_hours": 1.0, "max_price": 1.0, '
        '"deadline": "2030-01-01T00:00:00Z"}',
        headers=headers,
    )
    assert anonymous.status_code == 422, anonymous.text
    assert anonymous.json()["detail"][0]["loc"] == ["body", "gpu_model"]
    huge = api.admin.post("/tenants", content=f'{{"name": "{LONE * 100_000}"}}', headers=headers)
    assert huge.status_code == 422 and len(huge.text) < 10_000


def test_non_finite_prices_and_huge_ids_are_422(service):
    alice = service.tenant()
    raw = '{"gpu_model": "A100-80G", "gpu_count": 1, "max_price": NaN}'
    response = alice.post("/bids", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert alice.get(f"/bids/{2**70}").status_code == 422
    assert alice.get("/bids/0").status_code == 422
    assert (
        alice.post(
            "/bids", content=b"not json", headers={"content-type": "application/json"}
        ).status_code
        == 422
    )
    owner = service.tenant()
    service.grant_provider(owner)
    response = owner.post(
        "/nodes",
        json={
            "name": "n",
            "gpu_model": "A100-80G",
            "region": "any",
            "gpu_count": 8,
            "reserve_price": 1.0,
        },
    )
    assert response.status_code == 422 and "region" in response.text


# ---------------------------------------------------------------- bids


def test_idempotent_bids(service):
    alice = service.tenant()
    first = alice.post(
        "/bids",
        json={
            "gpu_model": "A100-80G",
            "gpu_count": 2,
            "max_price": 1.0,
            "idempotency_key": "run-1",
        },
    )
    again = alice.post(
        "/bids",
        json={
            "gpu_model": "a100 80g",
            "gpu_count": 2,
            "max_price": 1.0,
            "idempotency_key": "run-1",
        },
    )
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    clash = alice.post(
        "/bids",
        json={
            "gpu_model": "A100-80G",
            "gpu_count": 2,
            "max_price": 2.0,
            "idempotency_key": "run-1",
        },
    )
    assert clash.status_code == 409 and clash.json()["field"] == "idempotency_key"
    assert len(alice.get("/bids").json()) == 1
    other = service.tenant()  # keys are per tenant
    assert (
        other.post(
            "/bids",
            json={
                "gpu_model": "A100-80G",
                "gpu_count": 2,
                "max_price": 2.0,
                "idempotency_key": "run-1",
            },
        ).status_code
        == 201
    )


def test_a_bid_is_allocated_and_the_worker_hears_within_a_second(service):
    alice = service.tenant()
    owner = service.tenant()
    node, agent = service.node(owner)
    t0 = time.monotonic()
    b = bid(alice)
    event = wait_event(alice, f"/bids/{b['id']}/events", "allocated", timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert event["payload"]["node_id"] == node["id"] and event["payload"]["status"] == "running"
    assigned = wait_event(agent, f"/nodes/{node['id']}/events", "allocated", timeout=2)
    assert assigned["allocation_id"] == event["allocation_id"]
    allocs = agent.get(f"/nodes/{node['id']}/allocations").json()
    assert [a["bid_id"] for a in allocs] == [b["id"]]


def test_a_long_poll_waits_and_returns_empty_on_timeout(service):
    alice = service.tenant()
    b = bid(alice)  # no node: it waits
    t0 = time.monotonic()
    page = events(alice, f"/bids/{b['id']}/events", timeout=0.6)
    assert page == {"events": [], "cursor": 0}
    assert 0.5 < time.monotonic() - t0 < 3


def test_reclaim_notice_save_ack_and_migration(service):
    alice, owner = service.tenant(), service.tenant()
    n1, agent1 = service.node(owner, name="first")
    b = bid(alice, gpu_count=8)
    alloc = wait_event(alice, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    n2, agent2 = service.node(owner, name="second")  # free capacity for the migration
    assert owner.patch(f"/nodes/{n1['id']}", json={"state": "reclaimed"}).status_code == 200
    notice = wait_event(agent1, f"/nodes/{n1['id']}/events", "noticed")
    assert notice["allocation_id"] == alloc
    assert notice["payload"]["reason"] == "reclaimed"
    assert notice["payload"]["deadline"] - notice["payload"]["at"] == pytest.approx(300)
    reserved = wait_event(alice, f"/bids/{b['id']}/events", "reserved")
    assert reserved["node_id"] == n2["id"]
    epoch = notice["payload"]["epoch"]
    stale = agent1.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch - 1, "outcome": "saved", "checkpoint_at": 1.0},
    )
    assert stale.status_code == 409 and "stale epoch" in stale.json()["detail"]
    wrong_node = agent2.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch, "outcome": "saved", "checkpoint_at": 1.0},
    )
    assert wrong_node.status_code == 404  # not its allocation: not even its existence
    ok = agent1.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch, "outcome": "saved", "checkpoint_at": time.time()},
    )
    assert ok.status_code == 200, ok.text
    wait_event(alice, f"/bids/{b['id']}/events", "preempted")
    started = wait_event(agent2, f"/nodes/{n2['id']}/events", "allocated")
    assert started["payload"]["placement"] == "promoted"
    statuses = {a["id"]: a["status"] for a in alice.get(f"/bids/{b['id']}/allocations").json()}
    assert statuses[alloc] == "preempted"
    assert sorted(statuses.values()) == ["preempted", "running"]


def test_outbid_incumbent_is_noticed(service):
    alice, bob, owner = service.tenant(), service.tenant(), service.tenant()
    _node, _agent = service.node(owner, gpus=8)
    low = bid(alice, gpu_count=8, max_price=1.0)
    wait_event(alice, f"/bids/{low['id']}/events", "allocated")
    high = bid(bob, gpu_count=8, max_price=2.0)
    notice = wait_event(alice, f"/bids/{low['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "outbid"
    wait_event(bob, f"/bids/{high['id']}/events", "reserved")
    quote = service.client().get("/prices").json()[0]
    assert quote["clearing_price"] == 1.0 and quote["on_demand_price"] == 2.1


def test_cancel_stops_the_job_and_finishes_the_allocation(service):
    alice, owner = service.tenant(), service.tenant()
    service.node(owner)
    b = bid(alice)
    alloc = wait_event(alice, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    assert alice.post(f"/bids/{b['id']}/cancel").json()["status"] == "cancelled"
    wait_event(alice, f"/bids/{b['id']}/events", "finished")
    assert alice.get(f"/allocations/{alloc}").json()["status"] == "finished"
    assert alice.patch(f"/bids/{b['id']}", json={"max_price": 3.0}).status_code == 409


def test_reprice_moves_a_waiting_bid_into_the_money(service):
    alice, owner = service.tenant(), service.tenant()
    service.node(owner, reserve=1.5)
    b = bid(alice, max_price=1.0)
    assert events(alice, f"/bids/{b['id']}/events", timeout=0.5)["events"] == []
    assert alice.patch(f"/bids/{b['id']}", json={"max_price": 1.6}).status_code == 200
    wait_event(alice, f"/bids/{b['id']}/events", "allocated")


# ---------------------------------------------------------------- ledger


def test_charges_roll_up_and_balances_agree(driven):
    alice, owner = driven.tenant(), driven.tenant()
    driven.node(owner, reserve=0.9)
    b = bid(alice, gpu_count=4, max_price=1.2)
    driven.advance(0.1)
    wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    driven.advance(20.0, step=1.0)  # 20 s of the market's time (the node's heartbeats' limit
    ledger = alice.get("/ledger").json()  # is 30), flushed
    charge = ledger["charges"][0]
    assert charge["charged_seconds"] == pytest.approx(20.0, abs=1.0)
    assert charge["charged_amount"] == pytest.approx(0.9 * 4 * charge["charged_seconds"] / 3600)
    assert ledger["spent"] == pytest.approx(charge["charged_amount"])
    assert ledger["balance"] == pytest.approx(10.0 - ledger["spent"])
    assert [e["kind"] for e in ledger["entries"]] == ["starting_credit"]


def test_a_release_pays_the_reserve_through_its_notice(driven):
    """A tenant lowering its running bid below the reserve gets its notice (the worker's
    release), but its job's last minutes are billed at the reserve: repricing in cycles
    cannot make the notices' minutes nearly free."""
    alice, owner = driven.tenant(), driven.tenant()
    driven.node(owner, reserve=0.9)
    b = bid(alice, gpu_count=4, max_price=1.2)
    driven.advance(0.1)
    wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    assert alice.patch(f"/bids/{b['id']}", json={"max_price": 0.0001}).status_code == 200
    driven.advance(0.1)
    notice = wait_event(alice, f"/bids/{b['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "below_reserve"
    driven.advance(20.0, step=1.0)  # 20 s of the notice run, and are billed
    (charge,) = alice.get("/ledger").json()["charges"]
    assert charge["charged_seconds"] >= 20.0
    assert charge["charged_amount"] == pytest.approx(
        0.9 * 4 * charge["charged_seconds"] / 3600, abs=2e-6
    )


def test_a_failed_final_save_is_compensated(driven):
    alice, owner = driven.tenant(), driven.tenant()
    node, agent = driven.node(owner)
    b = bid(alice, gpu_count=8, max_price=1.0)
    driven.advance(0.1)
    alloc = wait_event(alice, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": 1, "outcome": "checkpoint", "checkpoint_at": driven.clock.time()},
    )
    driven.advance(10.0, step=1.0)  # ten seconds paid since the durable checkpoint
    owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
    driven.advance(0.1)
    notice = wait_event(agent, f"/nodes/{node['id']}/events", "noticed")
    failed = agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": notice["payload"]["epoch"], "outcome": "save_failed", "cause": "storage"},
    )
    assert failed.status_code == 200
    driven.flushed()
    entry = driven.wait_for(
        lambda: [e for e in alice.get("/ledger").json()["entries"] if e["kind"] == "compensation"]
    )[0]
    assert entry["allocation_id"] == alloc
    assert "final save failed" in entry["reason"]
    assert entry["amount"] == pytest.approx(0.9 * 8 * 10.2 / 3600, abs=0.9 * 8 * 0.2 / 3600)
    ended = alice.get(f"/allocations/{alloc}").json()  # at once, not at the deadline
    assert ended["status"] == "preempted" and ended["end_reason"] == "final save failed (storage)"
    assert entry["amount"] <= ended["charged_amount"]  # never more than was paid


def test_a_lost_node_preempts_without_notice_and_compensates(db_url, tmp_path):
    from conftest import start_service

    svc = start_service(db_url, tmp_path / "home", heartbeat_timeout_seconds=1.0)
    try:
        alice, owner = svc.tenant(), svc.tenant()
        node, agent = svc.node(owner)
        b = bid(alice, gpu_count=8)
        wait_event(alice, f"/bids/{b['id']}/events", "allocated")
        preempted = wait_event(alice, f"/bids/{b['id']}/events", "preempted", timeout=10)
        assert preempted["payload"]["reason"] == "node lost"
        assert svc.admin.get(f"/nodes/{node['id']}").json()["state"] == "lost"
        entry = svc.wait_for(
            lambda: [
                e for e in alice.get("/ledger").json()["entries"] if e["kind"] == "compensation"
            ]
        )[0]
        assert "node lost" in entry["reason"]
        # the agent comes back: the node is live again, empty
        assert agent.post(f"/nodes/{node['id']}/heartbeat", json={}).json()["state"] == "live"
    finally:
        svc.stop()


# ---------------------------------------------------------------- prices


def test_prices_and_minute_history(service):
    alice, owner = service.tenant(), service.tenant()
    service.node(owner, reserve=0.9)
    bid(alice, gpu_count=8, max_price=1.5)
    bid(alice, gpu_count=8, max_price=1.1)  # loses: sets the price
    # a tick may see the first bid alone (price 0.9): wait for one that saw both
    quote = service.wait_for(
        lambda: [
            q
            for q in service.client().get("/prices").json()
            if q["gpus_running"] == 8 and q["waiting_bids"] == 1
        ]
    )[0]
    assert quote["clearing_price"] == 1.1
    bars = service.wait_for(
        lambda: [
            b
            for b in service.client().get("/prices/a100-80g/eu-west/history").json()
            if b["close"] == 1.1
        ]
    )
    assert bars[-1]["low"] <= bars[-1]["close"] <= bars[-1]["high"]
    assert service.client().get("/prices/B200/eu-west/history").status_code == 422


# ---------------------------------------------------------------- the gate


def test_the_gate_refuses_transitions_outside_its_rules(db_url):
    from prefect_spotgpu.market import AllocationStatus as S
    from prefect_spotgpu.service import gate
    from prefect_spotgpu.service.db import make_engine, make_sessionmaker, migrate
    from prefect_spotgpu.service.errors import Conflict, TransitionRejected

    assert gate.check_transition(S.RUNNING, S.NOTICED) is None
    assert "final" in gate.check_transition(S.PREEMPTED, S.RUNNING)
    assert "not allowed" in gate.check_transition(S.RESERVED, S.NOTICED)
    engine = make_engine(db_url)
    migrate(engine)
    with make_sessionmaker(engine).begin() as session, pytest.raises(TransitionRejected):
        gate.set_allocation_status(
            session=session, allocation_id=1, expected=S.FINISHED, to=S.RUNNING
        )
    with make_sessionmaker(engine).begin() as session, pytest.raises(Conflict):
        gate.set_allocation_status(
            session=session, allocation_id=999, expected=S.RUNNING, to=S.NOTICED
        )
    with engine.connect() as connection:
        tables = set(sa.inspect(connection).get_table_names())
    assert {"bids", "allocations", "ledger_entries", "events", "alembic_version"} <= tables
    engine.dispose()


def test_the_gate_fences_bid_and_node_status_as_it_fences_allocations(postgres_url, tmp_path):
    """A bid's or node's status that changed between a read and its write is a conflict (409),
    never overwritten; a transition off the tables is refused before any write. PostgreSQL
    only: the lost race needs a second writer that commits between the read and the
    compare-and-set, which SQLite's single writer cannot interleave."""
    from datetime import UTC, datetime

    from conftest import fresh_postgres_schema, start_service
    from prefect_spotgpu.market import NodeState
    from prefect_spotgpu.protocol import BidStatus
    from prefect_spotgpu.service import crud, gate
    from prefect_spotgpu.service.db import make_engine, make_sessionmaker
    from prefect_spotgpu.service.errors import Conflict, TransitionRejected
    from prefect_spotgpu.service.models import BidRow, NodeRow

    url, drop = fresh_postgres_schema(postgres_url)
    service = start_service(url, tmp_path / "home")
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    try:
        alice, owner = service.tenant(), service.tenant()
        node, _ = service.node(owner, gpus=1)
        b = bid(alice, gpu_count=1, max_price=1.0)
        with sessions.begin() as session, pytest.raises(TransitionRejected, match="final"):
            gate.set_bid_status(
                session=session, bid_id=b["id"], expected=BidStatus.FINISHED, to=BidStatus.OPEN
            )
        with sessions.begin() as session:
            row = session.get(BidRow, b["id"])
            assert row.status == BidStatus.OPEN
            with sessions.begin() as other:  # a writer commits between the read and the write
                other.execute(sa.update(BidRow).where(BidRow.id == b["id"]).values(status="held"))
            with pytest.raises(Conflict, match="changed"):
                crud.cancel_bid(session=session, bid=row, now=datetime.now(UTC))
        with sessions.begin() as session:
            found = session.get(NodeRow, node["id"])
            with sessions.begin() as other:
                other.execute(
                    sa.update(NodeRow).where(NodeRow.id == node["id"]).values(state="draining")
                )
            with pytest.raises(Conflict, match="no longer live"):
                gate.set_node_state(session=session, node=found, to=NodeState.RECLAIMED)
        assert alice.get(f"/bids/{b['id']}").json()["status"] == "held"  # nothing overwritten
    finally:
        service.stop()
        engine.dispose()
        drop()


def test_compensation_is_bounded_by_the_allocation_and_checkpoints_cannot_be_future(service):
    alice, owner = service.tenant(), service.tenant()
    node, agent = service.node(owner, gpus=1, reserve=0.5)
    b = bid(alice, gpu_count=1, max_price=1.0)
    alloc = wait_event(alice, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    future = agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": 1, "outcome": "checkpoint", "checkpoint_at": time.time() + 3600},
    )
    assert future.status_code == 422 and future.json()["field"] == "checkpoint_at"
    ancient = agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": 1, "outcome": "checkpoint", "checkpoint_at": 1.0},
    )  # 1970
    assert ancient.status_code == 422 and ancient.json()["field"] == "checkpoint_at"
    started = alice.get(f"/allocations/{alloc}").json()["started_at"]
    owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
    notice = wait_event(agent, f"/nodes/{node['id']}/events", "noticed")
    agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": notice["payload"]["epoch"], "outcome": "save_failed", "cause": "storage"},
    )
    entry = service.wait_for(
        lambda: [e for e in alice.get("/ledger").json()["entries"] if e["kind"] == "compensation"]
    )[0]
    assert entry["amount"] <= 1.0 * 1 * (time.time() - started + 5) / 3600  # not since 1970


@pytest.mark.parametrize("path", ["/tenants", "/nodes"])
def test_concurrent_creates_with_one_name_never_500(service, path):
    from concurrent.futures import ThreadPoolExecutor

    owner = service.tenant()
    service.grant_provider(owner)
    client = service.admin if path == "/tenants" else owner
    body = (
        {"name": "same"}
        if path == "/tenants"
        else {
            "name": "same",
            "gpu_model": "A100-80G",
            "region": "eu-west",
            "gpu_count": 8,
            "reserve_price": 1.0,
        }
    )
    with ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(lambda _: client.post(path, json=body).status_code, range(8)))
    assert codes == [201] + [409] * 7, codes


def test_validation_errors_never_echo_a_jobs_environment(api):
    buyer = api.tenant()
    response = buyer.post(
        "/bids",
        json={
            "gpu_model": "A100-80G",
            "gpu_count": 1,
            "max_price": 1.0,
            "window_start": "2026-01-01T00:00:00Z",  # no window_end: a body-level error
            "job": {"command": ["x"], "env": {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}},
        },
    )
    assert response.status_code == 422
    assert "s3cr3t-value" not in response.text
    response = buyer.post(
        "/bids",
        json={
            "gpu_model": "A100-80G",
            "gpu_count": 1,
            "max_price": 1.0,
            "job": {"command": ["x"], "env": {"BAD NAME": "s3cr3t-value"}},
        },
    )
    assert response.status_code == 422 and "s3cr3t-value" not in response.text


# ---------------------------------------------------------------- on-demand capacity


def test_on_demand_capacity_is_sold_at_the_on_demand_price_and_never_to_spot_bids(service):
    alice, bob, owner = service.tenant(), service.tenant(), service.tenant()
    od_node, _ = service.node(owner, region="us-east", gpus=4, capacity="on_demand")
    assert od_node["capacity"] == "on_demand" and od_node["reserve_price"] == 2.1
    spot = bid(alice, gpu_count=4, max_price=5.0, region="any")  # outbids nothing: no spot node
    od = bid(bob, gpu_count=4, capacity="on_demand", max_price=None, region="any")
    assert od["capacity"] == "on_demand" and od["max_price"] == 2.1
    placed = wait_event(bob, f"/bids/{od['id']}/events", "allocated")
    assert placed["node_id"] == od_node["id"]
    assert events(alice, f"/bids/{spot['id']}/events", timeout=0.5)["events"] == []
    # a second on-demand buyer waits; it never evicts the first
    late = bid(alice, gpu_count=4, capacity="on_demand", max_price=3.0, region="any")
    assert late["max_price"] == 2.1  # pays the on-demand price, not its cap
    service.ticked(10)  # ten ticks of a market that could evict it
    later = events(bob, f"/bids/{od['id']}/events", after=placed["id"], timeout=0.2)
    assert later["events"] == []  # no notice
    quotes = {(q["region"], q["capacity"]): q for q in service.client().get("/prices").json()}
    assert quotes[("us-east", "on_demand")]["clearing_price"] == 2.1
    assert quotes[("us-east", "on_demand")]["waiting_bids"] == 1


def test_an_on_demand_job_is_released_with_a_notice_billed_at_the_on_demand_price(driven):
    """The worker moves a run back to spot by lowering its on-demand bid: the job gets the
    usual notice and saves; its minutes are billed at the on-demand price to the end."""
    alice, owner = driven.tenant(), driven.tenant()
    driven.node(owner, gpus=4, capacity="on_demand")
    b = bid(alice, gpu_count=4, capacity="on_demand", max_price=None)
    driven.advance(0.1)
    wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    assert alice.patch(f"/bids/{b['id']}", json={"max_price": 0.0001}).status_code == 200
    driven.advance(0.1)
    notice = wait_event(alice, f"/bids/{b['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "below_reserve"
    driven.advance(20.0, step=1.0)
    (charge,) = alice.get("/ledger").json()["charges"]
    assert charge["charged_seconds"] >= 20.0
    assert charge["charged_amount"] == pytest.approx(
        2.1 * 4 * charge["charged_seconds"] / 3600, abs=2e-6
    )
    refused = alice.patch(f"/bids/{b['id']}", json={"max_price": 2.2})
    assert refused.status_code == 409 and "on-demand price 2.1" in refused.json()["detail"]
    back = alice.patch(f"/bids/{b['id']}", json={"max_price": 2.1})  # placed again at 2.1
    assert back.status_code == 200 and back.json()["max_price"] == 2.1


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"capacity": "reserved"}, "capacity", "spot"),
        ({"max_price": None}, None, "max_price is required for spot capacity"),
        ({"capacity": "on_demand", "max_price": 1.0}, None, "on-demand price 2.1"),
    ],
)
def test_bad_capacity_bids_get_422(api, body, field, words):
    alice = api.tenant()
    full = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, **body}
    response = alice.post("/bids", json=full)
    assert response.status_code == 422 and words in response.text, response.text
    if field is not None:
        assert any(field in err["loc"] for err in response.json()["detail"]), response.text
    assert alice.get("/bids").json() == []


def test_on_demand_prices_cannot_be_changed(service):
    alice, owner = service.tenant(), service.tenant()
    node, _ = service.node(owner, capacity="on_demand")
    refused = owner.patch(f"/nodes/{node['id']}", json={"reserve_price": 1.0})
    assert refused.status_code == 409 and "on-demand" in refused.json()["detail"]
    b = bid(alice, capacity="on_demand", max_price=None)
    refused = alice.patch(f"/bids/{b['id']}", json={"max_price": 5.0})
    assert refused.status_code == 409 and "on-demand" in refused.json()["detail"]
    spot_node = owner.post(
        "/nodes",
        json={"name": "nores", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 1},
    )
    assert spot_node.status_code == 422 and "reserve_price is required" in spot_node.text
