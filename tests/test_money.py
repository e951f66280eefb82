"""Money is exact (whole micros, market/money.py), on real SQLite and PostgreSQL: over generated
market lives every tenant's balance is its credits minus its allocations' charges to the micro,
and a tick leader killed with SIGKILL again and again neither creates nor loses one."""

from __future__ import annotations

import random
import time

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ADMIN_KEY
from test_service_processes import Server, ticked

LEDGER = sa.text("""
    SELECT t.id, t.credits_micros, t.spent_micros,
           (SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_entries e
             WHERE e.tenant_id = t.id),
           (SELECT COALESCE(SUM(charged_micros), 0) FROM allocations a
             WHERE a.tenant_id = t.id)
    FROM tenants t ORDER BY t.id""")


def assert_exact_ledger(engine, service=None) -> None:
    """Stored totals equal the sums of their parts, and the API says the same, exactly."""
    with engine.connect() as connection:
        rows = connection.execute(LEDGER).all()
    for tenant_id, credits, spent, entries, charged in rows:
        assert isinstance(credits, int) and isinstance(spent, int)
        assert credits == entries, f"tenant {tenant_id}: credits {credits} != entries {entries}"
        assert spent == charged, f"tenant {tenant_id}: spent {spent} != charged {charged}"
    for client in getattr(service, "buyers", []):
        ledger = client.get("/ledger", params={"limit": 1000}).json()
        assert ledger["balance_micros"] == ledger["credits_micros"] - ledger["spent_micros"]
        assert ledger["balance"] == round(ledger["balance_micros"] / 1e6, 6)


op = st.one_of(
    st.tuples(
        st.just("bid"),
        st.integers(0, 2),
        st.sampled_from((1, 2, 4)),
        st.sampled_from((0.31, 0.333333, 0.5, 0.777777, 1.2)),
    ),
    st.tuples(st.just("cancel"), st.integers(0, 10**6)),
    st.tuples(st.just("reprice"), st.integers(0, 10**6), st.sampled_from((0.35, 0.9, 1.7))),
    st.tuples(st.just("credit"), st.integers(0, 2), st.sampled_from((0.000001, 0.1, 0.333333))),
    st.tuples(st.just("reserve"), st.sampled_from((0.3, 0.45, 0.6))),
    st.tuples(st.just("wait"), st.sampled_from((0.05, 0.3, 0.6))),
)


@pytest.mark.slow
def test_every_balance_is_credits_minus_charges_to_the_micro(service, db_url):
    buyers = [service.tenant(credit=c) for c in (10.0, 0.05, 0.003)]  # two run out of credit
    owner = service.tenant()
    node, _ = service.node(owner, gpus=8, reserve=0.3)
    service.buyers = buyers
    engine = sa.create_engine(db_url)
    bids: list[tuple[object, int]] = []

    @settings(
        max_examples=12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(life=st.lists(op, min_size=3, max_size=10))
    def a_market_life(life):
        for step in life:
            kind = step[0]
            if kind == "bid":
                client = buyers[step[1]]
                body = {"gpu_model": "A100-80G", "gpu_count": step[2], "max_price": step[3]}
                response = client.post("/bids", json=body)
                # a buyer whose balance does not cover the bid's reservation is refused
                assert response.status_code in (201, 402), response.text
                if response.status_code == 201:
                    bids.append((client, response.json()["id"]))
            elif kind == "cancel" and bids:
                client, bid_id = bids[step[1] % len(bids)]
                assert client.post(f"/bids/{bid_id}/cancel").status_code == 200
            elif kind == "reprice" and bids:
                client, bid_id = bids[step[1] % len(bids)]
                client.patch(f"/bids/{bid_id}", json={"max_price": step[2]})  # 409 once ended
            elif kind == "credit":
                response = service.admin.post(
                    f"/tenants/{buyers[step[1]].tenant_id}/credits",
                    json={"amount": step[2], "reason": "top-up"},
                )
                assert response.status_code == 201, response.text
            elif kind == "reserve":
                owner.patch(f"/nodes/{node['id']}", json={"reserve_price": step[1]})
            elif kind == "wait":
                time.sleep(step[1])
        service.flushed()
        assert_exact_ledger(engine, service)

    try:
        a_market_life()
    finally:
        engine.dispose()


def exact_bill(row, ms_less: int = 0) -> tuple[int, int]:
    """What an allocation owes from its start to ``charged_until`` at one constant price:
    ``(whole micros, the carry below one)`` (market/money.py)."""
    ms = round((row.charged_until - row.started_at) * 1000) - ms_less
    owed = round(row.price * 1_000_000) * row.gpu_count * ms
    return owed // 3_600_000, owed % 3_600_000


@pytest.mark.slow
def test_sigkill_of_the_tick_leader_neither_creates_nor_loses_a_micro(db_url, tmp_path):
    """One pool whose price is its reserve all along (no bid loses), so each allocation's
    exact bill is known; the leader is killed five times mid-life, at random moments."""
    server = Server(db_url, tmp_path)
    engine = sa.create_engine(db_url)
    rng = random.Random(7)
    try:
        with server.client(ADMIN_KEY) as admin:
            buyer = admin.post("/tenants", json={"name": "buyer", "starting_credit": 100}).json()
            owner = admin.post("/tenants", json={"name": "owner"}).json()
            admin.put(f"/tenants/{owner['id']}/provider", json={"provider": True})
        with server.client(owner["api_key"]) as client:
            for i in range(3):
                body = {
                    "name": f"n{i}",
                    "gpu_model": "RTX-4090",
                    "region": "eu-west",
                    "gpu_count": 8,
                    "reserve_price": 0.333333,
                }
                assert client.post("/nodes", json=body).status_code == 201
        with server.client(buyer["api_key"]) as client:
            ids = []
            for i in range(9):
                body = {"gpu_model": "RTX-4090", "gpu_count": 1 + i % 3, "max_price": 0.68}
                ids.append(client.post("/bids", json=body).json()["id"])
        for kill in range(5):
            time.sleep(rng.uniform(0.3, 2.5))
            server.kill()  # SIGKILL: mid-tick, mid-flush or idle
            server.log.close()
            server = Server(db_url, tmp_path)
            if kill == 2:
                with server.client(buyer["api_key"]) as client:
                    for bid_id in ids[:3]:  # three end: their last charge rounds up
                        assert client.post(f"/bids/{bid_id}/cancel").status_code == 200
        ticked(server, 10)  # the (new) leader ticks on, its charges flushed
        server.kill()
        with engine.connect() as connection:
            rows = connection.execute(
                sa.text(
                    "SELECT id, status, gpu_count, price, started_at, charged_until, "
                    "charged_micros, charge_carry FROM allocations ORDER BY id"
                )
            ).all()
        assert len(rows) == 9
        for row in rows:
            assert row.price == 0.333333
            micros, carry = exact_bill(row)
            if row.status == "running":
                assert (row.charged_micros, row.charge_carry) == (micros, carry), row
            else:  # ended: the exact bill, rounded up to a whole micro
                assert row.status == "finished", row
                # (its end time is exact; its last charge billed the whole milliseconds)
                rounded_up = {m + (c > 0) for m, c in (exact_bill(row, less) for less in (0, 1))}
                assert row.charged_micros in rounded_up, (row, rounded_up)
                assert row.charge_carry == 0
        assert sum(r.charged_micros for r in rows) > 0
        assert_exact_ledger(engine)
    finally:
        server.stop()
        engine.dispose()


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("credits", {"amount": 0.0000004, "reason": "r"}, "amount"),  # rounds to 0 micros
        ("bid", {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1e-9}, "max_price"),
    ],
)
def test_amounts_below_one_micro_are_422_and_write_nothing(service, path, body, field):
    alice = service.tenant()
    if path == "credits":
        response = service.admin.post(f"/tenants/{alice.tenant_id}/credits", json=body)
    else:
        response = alice.post("/bids", json=body)
    assert response.status_code == 422 and field in response.text, response.text
    assert "one micro" in response.text
    ledger = alice.get("/ledger").json()
    assert [e["kind"] for e in ledger["entries"]] == ["starting_credit"]
    assert alice.get("/bids").json() == []


def test_prices_and_credits_keep_six_decimals(service):
    alice = service.tenant(credit=0)
    response = service.admin.post(
        f"/tenants/{alice.tenant_id}/credits", json={"amount": 0.1234567, "reason": "r"}
    )
    assert response.json()["amount_micros"] == 123_457
    bid = alice.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0000004}
    ).json()
    assert bid["max_price"] == 1.0
    assert alice.get("/ledger").json()["balance_micros"] == 123_457
