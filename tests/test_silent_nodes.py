"""Silence is loss in every state (docs/operators/architecture.md#design-4): a node whose agent
stops heartbeating while live, draining or reclaimed is lost after the timeout; its allocations end
lost at once (a noticed one too: no waiting out its 300 s deadline), what was paid since the
last durable checkpoint is credited back (the silent seconds with it), and the bid resumes on
its reserved node. When the agent returns, the node is as its owner left it."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import start_service
from conftest import wait_for as wait
from prefect_spotgpu.service.clock import ManualClock
from test_agent import a_market, job_bid, read_log, start_agent, stop_agents
from test_service_api import wait_event

TIMEOUT = 30.0  # the market's default heartbeat timeout: its clock is the test's (no waiting)


@pytest.fixture
def market(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home", clock=ManualClock())
    assert svc.app.state.ticker.settings.heartbeat_timeout_seconds == TIMEOUT
    yield svc
    svc.stop()


@pytest.mark.parametrize("state", ["live", "draining", "reclaimed"])
def test_a_silent_node_is_lost_in_every_state_and_returns_as_its_owner_left_it(market, state):
    owner, alice = market.tenant(), market.tenant()
    node, agent = market.node(owner, gpus=8)
    response = alice.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 8, "max_price": 1.2, "region": "eu-west"},
    )
    bid = response.json()
    market.advance(0.2)
    alloc = wait_event(alice, f"/bids/{bid['id']}/events", "allocated")["allocation_id"]
    if state != "live":
        assert owner.patch(f"/nodes/{node['id']}", json={"state": state}).status_code == 200
        market.advance(0.2)
    if state == "reclaimed":
        wait_event(alice, f"/bids/{bid['id']}/events", "noticed")
    for _ in range(4):  # the agent beats every 10 s for a while: the node stays
        assert agent.post(f"/nodes/{node['id']}/heartbeat", json={}).status_code == 200
        market.advance(10.0, step=1.0)
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == state
    assert agent.post(f"/nodes/{node['id']}/heartbeat", json={}).status_code == 200
    silent_at = market.clock.time()  # the agent dies
    market.advance(TIMEOUT - 1, step=1.0)
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == state  # not yet
    market.advance(2.0, step=1.0)
    ended = wait_event(alice, f"/bids/{bid['id']}/events", "preempted", timeout=15)
    assert ended["payload"]["reason"] == "node lost"
    assert TIMEOUT <= ended["payload"]["at"] - silent_at <= TIMEOUT + 1  # not the notice's 300 s
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == "lost"
    allocation = alice.get(f"/allocations/{alloc}").json()
    assert allocation["status"] == "preempted"
    market.advance(1.0)  # (a charge flush)
    compensation = market.wait_for(
        lambda: [e for e in alice.get("/ledger").json()["entries"] if e["kind"] == "compensation"]
    )
    assert compensation[0]["allocation_id"] == alloc
    # no checkpoint was reported: everything it paid comes back, the silent seconds with it
    (charge,) = [c for c in alice.get("/ledger").json()["charges"] if c["allocation_id"] == alloc]
    assert compensation[0]["amount"] == charge["charged_amount"] > 0
    assert charge["charged_seconds"] >= 40 + TIMEOUT  # billed through the silence, credited
    agent.post(f"/nodes/{node['id']}/heartbeat", json={})  # the agent comes back
    market.advance(0.2)
    back = market.wait_for(
        lambda: (n := owner.get(f"/nodes/{node['id']}").json())["state"] != "lost" and n
    )
    assert back["state"] == state  # a reclaim or a drain outlives the agent's outage


@pytest.mark.slow
def test_an_agent_killed_right_after_a_reclaim_resumes_the_run_on_its_reserved_node(tmp_path):
    """Two real agents, a real job; the owner reclaims the node the job runs on and its agent
    is SIGKILLed at once, before it can report the final save. The node is lost after the
    heartbeat timeout (3 s), not after the notice (300 s); the run goes on on the node
    reserved for it at the notice, from its checkpoint; the lost seconds are compensated."""
    server, admin, owner_key, buyer_key = a_market(tmp_path, heartbeat_timeout=3)
    agents = {n: start_agent(server, owner_key, n, tmp_path) for n in ("a", "b")}
    try:
        nodes = wait(lambda: len(r := admin.get("/nodes").json()) == 2 and r, 30, "agents")
        by_id = {n["id"]: n["name"] for n in nodes}
        buyer = server.client(buyer_key)
        job_log = tmp_path / "job.jsonl"
        # the final save takes 5 s: the agent is killed before it can report it (an agent that
        # stops a job with SIGKILL the moment it acknowledges reports within milliseconds)
        bid = job_bid(buyer, 100000, job_log, tmp_path / "ckpt", SLOW_FINAL_SAVE="5")
        first = wait(lambda: [e for e in read_log(job_log) if "start" in e], 30, "job start")[0]
        wait(lambda: sum("step" in e for e in read_log(job_log)) >= 10, 30, "progress")
        (alloc,) = buyer.get(f"/bids/{bid['id']}/allocations").json()
        victim = alloc["node_id"]
        owner = server.client(owner_key)
        assert owner.patch(f"/nodes/{victim}", json={"state": "reclaimed"}).status_code == 200
        wait(
            lambda: buyer.get(f"/allocations/{alloc['id']}").json()["status"] == "noticed",
            10,
            "the notice",
        )
        agents[by_id[victim]].send_signal(signal.SIGKILL)
        killed_at = time.time()
        agents[by_id[victim]].wait(timeout=10)
        ended = wait(
            lambda: (
                (a := buyer.get(f"/allocations/{alloc['id']}").json())["status"] == "preempted"
                and a
            ),
            30,
            "the noticed allocation ended",
        )
        assert ended["end_reason"] == "node lost", ended
        assert admin.get(f"/nodes/{victim}").json()["state"] == "lost"
        second = wait(
            lambda: [e for e in read_log(job_log) if "start" in e and e["alloc"] != first["alloc"]],
            30,
            "the job on the reserved node",
        )[0]
        assert second["t"] - killed_at < 3 + 15, "resumed at once, not at the notice deadline"
        assert second["start"] > 0  # from its checkpoint
        (resumed,) = [
            a
            for a in buyer.get(f"/bids/{bid['id']}/allocations").json()
            if a["id"] == second["alloc"]
        ]
        assert resumed["node_id"] != victim
        entries = buyer.get("/ledger").json()["entries"]
        assert [e["allocation_id"] for e in entries if e["kind"] == "compensation"] == [alloc["id"]]
        buyer.post(f"/bids/{bid['id']}/cancel")
    finally:
        stop_agents(agents, server, tmp_path)
