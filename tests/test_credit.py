"""Credit is reserved, not chased: hostile buyers against the real service, on real SQLite and
real PostgreSQL (docs/operators/security.md; docs/operators/architecture.md#design-7;
``service/credit.py``, ``market/credit.py``).

The services here give a 2 s notice (ticks of 0.1 s), so a bid reserves its maximum price x GPUs
x 3 s at admission and keeps 2.2 s of it while it runs: a tenant's whole life out of credit
fits in a few seconds.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import start_service
from prefect_spotgpu.market.credit import BidExposure, credit_holds, exposure_micros
from test_service_api import wait_event

NOTICE = 2.0
TICK = 0.1  # conftest's


@pytest.fixture
def market(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home", notice_seconds=NOTICE)
    yield svc
    svc.stop()


def a_bid(client, gpu_count=8, max_price=1.0, **more):
    body = {"gpu_model": "A100-80G", "gpu_count": gpu_count, "max_price": max_price}
    return client.post("/bids", json={**body, "region": "eu-west", **more})


def admission(price: float, gpus: int) -> float:
    """What a bid reserves at admission here, in units."""
    return exposure_micros(max_price=price, gpus=gpus, seconds=NOTICE + 10 * TICK) / 1e6


def balance(client) -> float:
    return client.get("/me").json()["balance"]


# ---------------------------------------------------------------- the pure rules


def test_the_running_bids_keep_their_notice_and_the_newest_waiting_bids_go_first():
    running = BidExposure(1, 500, running=True)
    waiting = [BidExposure(2, 300, running=False), BidExposure(3, 100, running=False)]
    assert credit_holds(available=1000, bids=[running, *waiting]).held == ()
    assert credit_holds(available=850, bids=[running, *waiting]).held == (3,)
    # the older one does not fit: the newer one, which would, does not jump it
    assert credit_holds(available=750, bids=[running, *waiting]).held == (2, 3)
    all_of_them = credit_holds(available=500, bids=[running, *waiting])
    assert all_of_them.held == (1, 2, 3) and all_of_them.notice_running


# ---------------------------------------------------------------- admission


def test_a_bid_the_balance_does_not_cover_is_a_402_naming_both_and_writes_nothing(market):
    mallory = market.tenant(credit=0.01)
    refused = a_bid(mallory, gpu_count=8, max_price=1000)
    assert refused.status_code == 402, refused.text
    body = refused.json()
    assert body["field"] == "max_price"
    assert "balance 0.010000" in body["detail"]
    assert f"needs {admission(1000, 8):.6f}" in body["detail"]
    assert mallory.get("/bids").json() == []  # no partial write
    assert balance(mallory) == 0.01


@pytest.mark.slow
def test_forty_parallel_bids_spend_only_the_credit_there_is(market):
    """The measured attack: a tenant posts 40 bids of 8 GPUs at 1000 per GPU-hour at once, on
    nodes whose reserve is 999. Its credit covers exactly two; the others are refused, the
    two run, are noticed when only their notice is left, and the balance never goes below
    minus one tick's charges."""
    owner = market.tenant()
    for _ in range(3):
        market.node(owner, gpus=8, reserve=999)
    each = admission(1000, 8)
    mallory = market.tenant(credit=round(2.5 * each, 6))  # two bids' worth, not three
    clients = [market.client(mallory.headers["Authorization"].split()[1]) for _ in range(40)]
    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(lambda c: a_bid(c, gpu_count=8, max_price=1000), clients))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] * 2 + [402] * 38, codes
    assert all("does not cover" in r.json()["detail"] for r in answers if r.status_code == 402)
    accepted = [r.json()["id"] for r in answers if r.status_code == 201]
    for bid_id in accepted:
        wait_event(mallory, f"/bids/{bid_id}/events", "allocated")
    one_tick = 2 * 8 * 1000 * TICK / 3600
    lowest = balance(mallory)
    for bid_id in accepted:
        notice = wait_event(mallory, f"/bids/{bid_id}/events", "noticed", timeout=20)
        assert notice["payload"]["reason"] == "out_of_credit"
        held = mallory.get(f"/bids/{bid_id}").json()
        assert held["status"] == "held" and held["hold_reason"].startswith("out of credit")
        ended = wait_event(mallory, f"/bids/{bid_id}/events", "preempted", timeout=20)
        assert ended["payload"]["reason"] == "notice deadline passed"  # noticed, not killed
        lowest = min(lowest, balance(mallory))
    market.flushed()
    lowest = min(lowest, balance(mallory))
    assert lowest >= -one_tick, (lowest, one_tick)
    assert all(a["status"] != "running" for a in mallory.get("/allocations").json())


def test_a_gang_reserves_for_every_member_at_once(market):
    owner = market.tenant()
    market.node(owner, gpus=8)
    market.node(owner, gpus=8)
    alice = market.tenant(credit=round(1.5 * admission(5.0, 8), 6))
    gang = a_bid(alice, gpu_count=8, max_price=5.0, node_count=2)
    assert gang.status_code == 402, gang.text
    assert f"needs {admission(5.0, 16):.6f}" in gang.json()["detail"]
    assert alice.get("/bids").json() == []  # neither member written
    assert a_bid(alice, gpu_count=8, max_price=5.0).status_code == 201


def test_a_raised_price_reserves_the_raise(market):
    alice = market.tenant(credit=round(1.5 * admission(1.0, 8), 6))
    b = a_bid(alice, gpu_count=8, max_price=1.0).json()
    raised = alice.patch(f"/bids/{b['id']}", json={"max_price": 1000})
    assert raised.status_code == 402 and "does not cover this raise" in raised.json()["detail"]
    assert alice.get(f"/bids/{b['id']}").json()["max_price"] == 1.0
    assert alice.patch(f"/bids/{b['id']}", json={"max_price": 0.5}).status_code == 200
    assert alice.patch(f"/bids/{b['id']}", json={"max_price": 1.2}).status_code == 200


def test_open_bids_are_capped_per_tenant(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home", max_open_bids_per_tenant=3)
    try:
        mallory, bob, owner = svc.tenant(credit=100), svc.tenant(credit=100), svc.tenant()
        for _ in range(4):
            svc.node(owner, gpus=1)
        ids = [a_bid(mallory, gpu_count=1).json()["id"] for _ in range(3)]
        over = a_bid(mallory, gpu_count=1)
        assert over.status_code == 409 and "cap is 3" in over.json()["detail"]
        gang = a_bid(bob, gpu_count=1, node_count=4)  # a gang counts each member
        assert gang.status_code == 409, gang.text
        assert a_bid(bob, gpu_count=1).status_code == 201  # another tenant is not affected
        mallory.post(f"/bids/{ids[0]}/cancel")
        assert a_bid(mallory, gpu_count=1).status_code == 201
    finally:
        svc.stop()


# ---------------------------------------------------------------- the tick


def test_a_job_whose_credit_runs_short_is_noticed_held_and_reopened_by_a_credit(market):
    owner = market.tenant()
    market.node(owner, gpus=8, reserve=0.9)
    poor = market.tenant(credit=round(admission(1.0, 8) + 0.002, 6))  # about 1 s of running
    b = a_bid(poor, gpu_count=8, max_price=1.0).json()
    wait_event(poor, f"/bids/{b['id']}/events", "allocated")
    notice = wait_event(poor, f"/bids/{b['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "out_of_credit"
    held = poor.get(f"/bids/{b['id']}").json()
    assert held["status"] == "held" and held["hold_reason"].startswith("out of credit")
    ended = wait_event(poor, f"/bids/{b['id']}/events", "preempted")  # its notice, paid
    assert ended["payload"]["reason"] == "notice deadline passed"
    market.flushed()
    assert balance(poor) >= -8 * 1.0 * TICK / 3600
    late = a_bid(poor, gpu_count=1, max_price=1.0)
    assert late.status_code == 402
    response = market.admin.post(
        f"/tenants/{poor.tenant_id}/credits", json={"amount": 5.0, "reason": "top-up"}
    )
    assert response.status_code == 201
    market.wait_for(lambda: poor.get(f"/bids/{b['id']}").json()["status"] == "open")
    again = wait_event(poor, f"/bids/{b['id']}/events", "allocated", after=ended["id"])
    assert again["allocation_id"] != ended["allocation_id"]


# ---------------------------------------------------------------- the property


@pytest.mark.slow
def test_no_balance_falls_below_one_ticks_charges_over_market_lives(db_url, tmp_path):
    """Generated market lives: tenants with small credits post bursts of parallel bids, raise
    prices, get top-ups, while owners reclaim nodes; at every read and at the end no balance
    is below minus one tick's charges of everything it could run at once."""
    svc = start_service(db_url, tmp_path / "home", notice_seconds=NOTICE)
    try:
        owner = svc.tenant()
        nodes = [svc.node(owner, gpus=8, reserve=0.5)[0] for _ in range(2)]
        step = st.one_of(
            st.tuples(
                st.just("burst"),
                st.integers(0, 2),
                st.integers(2, 8),
                st.sampled_from((1, 4, 8)),
                st.sampled_from((0.6, 5.0, 200.0)),
            ),
            st.tuples(st.just("raise"), st.integers(0, 2), st.sampled_from((2.0, 900.0))),
            st.tuples(st.just("credit"), st.integers(0, 2), st.sampled_from((0.01, 0.5))),
            st.tuples(st.just("reclaim"), st.integers(0, 1), st.booleans()),
            st.tuples(st.just("wait"), st.sampled_from((0.2, 0.8))),
        )

        @settings(
            max_examples=5,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(
            credits=st.lists(st.sampled_from((0.005, 0.05, 0.4)), min_size=3, max_size=3),
            life=st.lists(step, min_size=3, max_size=8),
        )
        def a_life(credits, life):
            buyers = [svc.tenant(credit=c) for c in credits]
            worst = [0.0] * 3  # one tick's charges at most: every GPU at its highest price
            posted: list[tuple[int, int]] = []
            for s in life:
                if s[0] == "burst":
                    who, n, gpus, price = s[1:]
                    key = buyers[who].headers["Authorization"].split()[1]
                    clients = [svc.client(key) for _ in range(n)]
                    with ThreadPoolExecutor(n) as pool:
                        answers = list(
                            pool.map(
                                lambda c, g=gpus, p=price: a_bid(c, gpu_count=g, max_price=p),
                                clients,
                            )
                        )
                    for r in answers:
                        assert r.status_code in (201, 402), r.text
                        if r.status_code == 201:
                            posted.append((who, r.json()["id"]))
                            worst[who] = max(worst[who], 16 * price)
                elif s[0] == "raise" and posted:
                    who, bid_id = posted[s[1] % len(posted)]
                    r = buyers[who].patch(f"/bids/{bid_id}", json={"max_price": s[2]})
                    assert r.status_code in (200, 402, 409), r.text
                    if r.status_code == 200:
                        worst[who] = max(worst[who], 16 * s[2])
                elif s[0] == "credit":
                    r = svc.admin.post(
                        f"/tenants/{buyers[s[1]].tenant_id}/credits",
                        json={"amount": s[2], "reason": "top-up"},
                    )
                    assert r.status_code == 201, r.text
                elif s[0] == "reclaim":
                    state = "reclaimed" if s[2] else "live"
                    owner.patch(f"/nodes/{nodes[s[1]]['id']}", json={"state": state})
                elif s[0] == "wait":
                    time.sleep(s[1])
                for who, b in enumerate(buyers):
                    assert balance(b) >= -worst[who] * TICK / 3600, (who, life)
            for n in nodes:
                owner.patch(f"/nodes/{n['id']}", json={"state": "live"})
            svc.wait_for(  # every notice runs out (ended at its deadline, or saved)
                lambda: all(
                    a["status"] != "noticed" for b in buyers for a in b.get("/allocations").json()
                ),
                NOTICE + 15,
            )
            svc.flushed()
            for who, b in enumerate(buyers):
                assert balance(b) >= -worst[who] * TICK / 3600, (who, balance(b), life)
                for _, bid_id in (p for p in posted if p[0] == who):
                    b.post(f"/bids/{bid_id}/cancel")

        a_life()
    finally:
        svc.stop()
