"""No free preemption, no free peek: the attacks on the running market, as tests.

3. A bid above a running job, cancelled before its takeover starts (or just after), ended the
   incumbent at its notice deadline and paid nothing. Now the takeover owes the notice's fee, a
   floor on what it pays in all (``market/notice_fee.py``): the notice cannot be taken back (the
   job has its SIGUSR1 and saves), so the bid that caused it pays for it, in either order.
4. A provider outbid a running one-node job so that its own idle node became the job's
   migration target, read the job's sealed environment from ``GET /nodes/{id}/allocations``
   (the warm replacement gave the target its job at the notice), then cancelled. Now a target
   is warmed only after a reclaim or a reserve's notice, never an outbid's: it gets the job when
   the move is real.

The pure rules run on a ``Market`` whose time the tests give it (``tick(now)``); the attacks run
as real tenants and providers against the real service on SQLite and PostgreSQL.
"""

from __future__ import annotations

import time

from conftest import start_service
from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    EndReason,
    Market,
    MarketConfig,
    Node,
    NodeState,
    PlacementKind,
)
from prefect_spotgpu.market.notice_fee import notice_fee
from test_security import SECRET, job, node_jobs
from test_service_api import bid, wait_event

A100 = "A100-80G"
FEE = notice_fee(outbid_prices=[1.0], reserve=0.9, max_price=2.0, gpus=8, notice_seconds=300)
"""8 GPUs for the 300 s notice at the outbid bid's 1.00/h: 0.666667."""


def test_the_fee_is_the_notice_at_the_price_outbid():
    assert FEE == 666_667  # 8 x 1.00 x 300 / 3600, rounded up to a whole micro

    def hour_of_one_gpu(outbid_price: float) -> int:  # node reserve 0.90, own maximum 2.00
        return notice_fee(
            outbid_prices=[outbid_price], reserve=0.9, max_price=2.0, gpus=1, notice_seconds=3600
        )

    assert hour_of_one_gpu(1.5) == 1_500_000
    assert hour_of_one_gpu(0.5) == 900_000  # at least the node's reserve
    assert hour_of_one_gpu(3.0) == 2_000_000  # never above its own maximum


# ---------------------------------------------------------------- the rule, on the market


def outbid() -> Market:
    """Bid 1 (8 GPUs at 1.00) runs on node 1 (reserve 0.90) from t=0; at t=10, bid 2 (8 at
    2.00) outbids it: bid 1 is noticed until t=310, bid 2 reserves node 1 (a takeover)."""
    m = Market(MarketConfig(notice_seconds=300))
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.9))
    m.add_bid(Bid(1, A100, 8, 1.0, region="eu-west", tenant_id=1))
    m.tick(0.0)
    m.add_bid(Bid(2, A100, 8, 2.0, region="eu-west", tenant_id=2, created_at=10.0))
    d = m.tick(10.0)
    assert [n.bid_id for n in d.notices] == [1]
    assert [(p.bid_id, p.kind) for p in d.placements] == [(2, PlacementKind.TAKEOVER)]
    return m


def alloc(m: Market, bid_id: int, status: AllocationStatus):
    return next(a for a in m.snapshot().allocations if a.bid_id == bid_id and a.status is status)


def paid_by(tenant: int, *results) -> int:
    """Micros charged to ``tenant`` by decisions and settlements (charges and notice fees)."""
    return sum(int(c.amount) for r in results for c in r.charges if c.tenant_id == tenant) + sum(
        f.amount for r in results for f in r.fees if f.tenant_id == tenant
    )


def test_a_challenger_that_cancels_before_its_takeover_starts_pays_the_notice():
    m = outbid()
    takeover = alloc(m, 2, AllocationStatus.RESERVED)
    assert takeover.notice_fee_owed == FEE
    settled = m.cancel_bid(2, 11.0)  # one second later: still the whole notice's fee
    assert [(f.allocation_id, f.tenant_id, f.amount) for f in settled.fees] == [
        (takeover.id, 2, FEE)
    ]
    assert paid_by(2, settled) == FEE
    # the notice stands (the job has its SIGUSR1): the incumbent saves and is preempted
    assert alloc(m, 1, AllocationStatus.NOTICED).deadline == 310.0


def test_a_challenger_that_ends_just_after_its_takeover_started_pays_the_notice_in_all():
    m = outbid()
    noticed = alloc(m, 1, AllocationStatus.NOTICED)
    acked = m.end_allocation(noticed.id, AllocationStatus.PREEMPTED, 20.0)  # a fast save
    started = m.tick(21.0)
    (takeover,) = started.promotions
    ran = [m.tick(t) for t in (22.0, 23.0, 24.0)]
    settled = m.cancel_bid(2, 24.5)
    assert paid_by(2, *ran, settled) - settled.fees[0].amount > 0  # what it ran counts
    assert paid_by(2, acked, started, *ran, settled) == FEE  # and the rest of the fee on top
    assert settled.fees[0].allocation_id == takeover


def test_a_challenger_that_runs_past_the_notice_pays_exactly_what_it_ran():
    m = outbid()
    m.end_allocation(alloc(m, 1, AllocationStatus.NOTICED).id, AllocationStatus.PREEMPTED, 20.0)
    results = [m.tick(t) for t in (21.0, 200.0, 400.0)]
    assert m.notice_fee_owed(results[0].promotions[0]) == 0  # its charges covered it
    settled = m.cancel_bid(2, 500.0)
    assert settled.fees == ()
    running = [c for r in (*results, settled) for c in r.charges if c.tenant_id == 2]
    assert sum(c.seconds for c in running) == 479.0  # from its start, at 21


def test_lowering_the_price_below_the_reserve_before_the_start_pays_the_notice():
    m = outbid()
    m.reprice_bid(2, 0.5)  # the PATCH: below node 1's reserve, its reservation is released
    d = m.tick(12.0)
    (ending,) = d.endings
    assert (ending.bid_id, ending.reason) == (2, EndReason.BELOW_RESERVE)
    assert paid_by(2, d) == FEE


def test_lowering_the_price_below_the_incumbents_is_no_way_round_the_fee():
    """Under the incumbent's price (not the reserve's): the takeover still starts, the
    incumbent, waiting again, outbids it back, and it saves at once; it pays the fee in all."""
    m = outbid()
    m.reprice_bid(2, 0.92)
    m.end_allocation(alloc(m, 1, AllocationStatus.NOTICED).id, AllocationStatus.PREEMPTED, 20.0)
    results = [m.tick(21.0)]  # it starts, and bid 1 (1.00 > 0.92 x 1.05) takes it back
    (notice,) = results[0].notices
    assert notice.bid_id == 2 and results[0].promotions == (notice.allocation_id,)
    results.append(m.end_allocation(notice.allocation_id, AllocationStatus.PREEMPTED, 21.5))
    assert paid_by(2, *results) == FEE


def test_a_node_that_ends_the_takeover_waives_the_fee():
    for state in (NodeState.RECLAIMED, NodeState.DRAINING, NodeState.LOST):
        m = outbid()
        m.upsert_node(Node(1, A100, "eu-west", 8, 0.9, state))
        d = m.tick(12.0)
        assert [e.bid_id for e in d.endings if e.bid_id == 2] == [2], state
        assert d.fees == (), state


def test_a_claim_on_gpus_someone_else_noticed_owes_nothing():
    """A reclaim notices bid 1; bid 2 claims the GPUs that notice frees: it noticed nobody."""
    m = Market(MarketConfig(notice_seconds=300))
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.9))
    m.add_bid(Bid(1, A100, 8, 1.0, region="eu-west", tenant_id=1))
    m.tick(0.0)
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.9, NodeState.RECLAIMED))
    m.tick(1.0)
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.9))  # the owner changes its mind
    m.add_bid(Bid(2, A100, 8, 2.0, region="eu-west", tenant_id=2, created_at=2.0))
    d = m.tick(2.0)
    assert [(p.bid_id, p.kind) for p in d.placements] == [(2, PlacementKind.TAKEOVER)]
    assert not d.notices
    assert alloc(m, 2, AllocationStatus.RESERVED).notice_fee_owed == 0
    assert m.cancel_bid(2, 3.0).fees == ()


def test_a_market_rebuilt_from_its_state_still_owes_the_fee():
    m = outbid()
    cold = Market.from_state(m.snapshot())  # a new tick leader
    assert alloc(cold, 2, AllocationStatus.RESERVED).notice_fee_owed == FEE
    assert cold.cancel_bid(2, 11.0).fees == m.cancel_bid(2, 11.0).fees


def test_a_takeover_outbid_in_the_tick_it_starts_is_promoted_then_noticed():
    """At t=310 bid 1's notice runs out and bid 2's takeover starts; bid 3, come a second
    before, outbids it in that same tick. The decision holds both (the promotion, then the
    notice): the service writes them in that order (the attack below)."""
    m = outbid()
    m.add_bid(Bid(3, A100, 8, 5.0, region="eu-west", tenant_id=3, created_at=309.0))
    d = m.tick(310.0)
    takeover = d.promotions[0]
    assert [(n.allocation_id, n.bid_id) for n in d.notices] == [(takeover, 2)]
    assert alloc(m, 2, AllocationStatus.NOTICED).id == takeover


# ---------------------------------------------------------------- the attacks, on the service


def test_an_outbid_cancelled_before_its_takeover_starts_pays_the_notice(service):
    alice, mallory, owner = service.tenant(), service.tenant(), service.tenant()
    service.node(owner, gpus=8, reserve=0.9)
    victim = bid(alice, gpu_count=8, max_price=1.0)
    wait_event(alice, f"/bids/{victim['id']}/events", "allocated")
    attack = bid(mallory, gpu_count=8, max_price=2.0)
    wait_event(alice, f"/bids/{victim['id']}/events", "noticed")
    reserved = wait_event(mallory, f"/bids/{attack['id']}/events", "reserved")
    takeover = f"/allocations/{reserved['allocation_id']}"
    assert mallory.get(takeover).json()["notice_fee_micros"] == FEE
    assert mallory.post(f"/bids/{attack['id']}/cancel").status_code == 200
    wait_event(mallory, f"/bids/{attack['id']}/events", "released")
    service.wait_for(lambda: mallory.get("/ledger").json()["spent_micros"] == FEE)
    charge = next(c for c in mallory.get("/ledger").json()["charges"])
    assert (charge["status"], charge["charged_micros"]) == ("released", FEE)


def test_an_outbid_cancelled_just_after_its_takeover_started_pays_the_notice(service):
    alice, mallory, owner = service.tenant(), service.tenant(), service.tenant()
    node, agent = service.node(owner, gpus=8, reserve=0.9)
    victim = bid(alice, gpu_count=8, max_price=1.0)
    wait_event(alice, f"/bids/{victim['id']}/events", "allocated")
    attack = bid(mallory, gpu_count=8, max_price=2.0)
    notice = wait_event(agent, f"/nodes/{node['id']}/events", "noticed")
    saved = {"epoch": notice["payload"]["epoch"], "outcome": "saved", "checkpoint_at": time.time()}
    assert agent.post(f"/allocations/{notice['allocation_id']}/report", json=saved).is_success
    started = wait_event(mallory, f"/bids/{attack['id']}/events", "allocated")
    assert started["payload"]["placement"] == "promoted"
    assert mallory.post(f"/bids/{attack['id']}/cancel").status_code == 200  # at once
    wait_event(mallory, f"/bids/{attack['id']}/events", "finished")
    service.wait_for(lambda: mallory.get("/ledger").json()["spent_micros"] == FEE)
    ran = mallory.get(f"/allocations/{started['allocation_id']}").json()
    assert ran["status"] == "finished" and ran["charged_seconds"] > 0  # what it ran, in it


def test_a_leader_rebuilt_from_the_database_still_charges_the_fee(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home")
    try:
        alice, mallory, owner = svc.tenant(), svc.tenant(), svc.tenant()
        svc.node(owner, gpus=8, reserve=0.9)
        victim = bid(alice, gpu_count=8, max_price=1.0)
        wait_event(alice, f"/bids/{victim['id']}/events", "allocated")
        attack = bid(mallory, gpu_count=8, max_price=2.0)
        wait_event(mallory, f"/bids/{attack['id']}/events", "reserved")
        key = mallory.headers["Authorization"]
    finally:
        svc.stop()
    svc = start_service(db_url, tmp_path / "home")  # the market rebuilt cold from its rows
    try:
        mallory = svc.client(key.removeprefix("Bearer "))
        assert mallory.post(f"/bids/{attack['id']}/cancel").status_code == 200
        svc.wait_for(lambda: mallory.get("/ledger").json()["spent_micros"] == FEE)
    finally:
        svc.stop()


def test_a_providers_outbid_cannot_make_its_own_node_a_warm_target(service):
    """Mallory, a provider, registers an idle node of exactly Alice's size, then outbids the
    node Alice runs on with a bid her own node cannot hold: Alice's migration is reserved on
    Mallory's node. It is not given Alice's job before the move is real; Mallory's cancel
    pays the notice, and her drain (the peek's getaway) leaves her node having seen nothing."""
    alice, mallory, owner = service.tenant(), service.tenant(), service.tenant()
    service.node(owner, name="busy", gpus=8, reserve=0.9)
    victim = bid(alice, gpu_count=4, max_price=1.0, job=job(AWS_SECRET_ACCESS_KEY=SECRET))
    wait_event(alice, f"/bids/{victim['id']}/events", "allocated")
    trap, trap_agent = service.node(mallory, name="trap", gpus=4, reserve=0.9)
    attack = bid(mallory, gpu_count=8, max_price=2.0)  # fits only the busy node: Alice's
    notice = wait_event(alice, f"/bids/{victim['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "outbid"
    reserved = wait_event(alice, f"/bids/{victim['id']}/events", "reserved")
    assert reserved["node_id"] == trap["id"] and reserved["payload"]["placement"] == "migration"
    seen = trap_agent.get(f"/nodes/{trap['id']}/allocations")
    assert seen.status_code == 200 and SECRET not in seen.text
    assert node_jobs(trap_agent, trap["id"]) == {victim["id"]: None}  # no job before the move
    assert mallory.post(f"/bids/{attack['id']}/cancel").status_code == 200
    service.wait_for(lambda: mallory.get("/ledger").json()["spent_micros"] == FEE)
    assert mallory.patch(f"/nodes/{trap['id']}", json={"state": "draining"}).status_code == 200
    wait_event(alice, f"/bids/{victim['id']}/events", "released")
    seen = trap_agent.get(f"/nodes/{trap['id']}/allocations")
    assert SECRET not in seen.text and node_jobs(trap_agent, trap["id"]) == {}


def test_an_outbid_timed_to_the_start_of_a_takeover_does_not_stop_the_market(db_url, tmp_path):
    """A tenant who bids so that its bid reaches the market in the very tick a takeover starts
    (the notice's deadline is in the events: anyone can time it) had the takeover promoted and
    outbid in one tick; the tick wrote the notice before the promotion, failed on its own
    compare-and-set, rebuilt the same market and failed again, every tick: no bid placed, no
    notice ended, no charge written, for everyone, until a restart that failed the same way.
    Now the promotion is written first and the market goes on."""
    from prefect_spotgpu.service.clock import ManualClock

    market = start_service(db_url, tmp_path / "home", clock=ManualClock(), notice_seconds=2)
    try:
        owner, first, second, third = (market.tenant() for _ in range(4))
        market.node(owner, gpus=8, reserve=0.9)
        ran = bid(first, gpu_count=8, max_price=1.0)
        market.advance(0.1)
        wait_event(first, f"/bids/{ran['id']}/events", "allocated")
        takeover = bid(second, gpu_count=8, max_price=2.0)
        market.advance(0.1)
        wait_event(first, f"/bids/{ran['id']}/events", "noticed")
        reserved = wait_event(second, f"/bids/{takeover['id']}/events", "reserved")
        market.advance(1.0)  # the notice runs 2 s: 0.9 s are left
        attack = bid(third, gpu_count=8, max_price=5.0)
        ticks = market.app.state.ticker.ticks
        market.advance(1.5, step=1.5)  # one tick: the deadline, the promotion, the attack
        started = wait_event(second, f"/bids/{takeover['id']}/events", "allocated")
        assert started["allocation_id"] == reserved["allocation_id"]
        assert started["payload"]["placement"] == "promoted"
        noticed = wait_event(second, f"/bids/{takeover['id']}/events", "noticed")
        assert noticed["allocation_id"] == started["allocation_id"]
        assert noticed["payload"]["reason"] == "outbid"
        market.advance(0.3)
        assert market.app.state.ticker.ticks >= ticks + 4  # every tick since, done
        wait_event(third, f"/bids/{attack['id']}/events", "reserved")
    finally:
        market.stop()
