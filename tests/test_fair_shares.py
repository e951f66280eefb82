"""Fair shares, tested as the attacker: no tenant or anonymous client can slow the others.

The pure limits (``service/fairness.py``) in milliseconds; then the real service on SQLite and
PostgreSQL: a tenant over its long-poll cap and an address over its stream cap get 429 with
``Retry-After`` while the others are served, an anonymous estimate flood is rationed, a
forecast is fitted once per bar, and waiting long-polls cost the database O(1), not O(N),
while still waking within a tick of an event (on a replica that does not lead too).
"""

from __future__ import annotations

import doctest
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import uvicorn

from conftest import ADMIN_KEY, Service, one_database, start_service
from prefect_spotgpu.cli.stack import free_port
from prefect_spotgpu.service import fairness
from prefect_spotgpu.service.errors import TooManyRequests
from prefect_spotgpu.service.fairness import (
    CAP_RETRY_SECONDS,
    SlotCaps,
    TokenBuckets,
    take_all,
    take_or_refuse,
)
from prefect_spotgpu.service.models import PriceBar
from prefect_spotgpu.service.server import uvicorn_config

# ---------------------------------------------------------------- the pure limits


def test_the_docstring_examples_run():
    assert doctest.testmod(fairness).failed == 0 and doctest.testmod(fairness).attempted > 0


def test_slot_caps_count_per_key_and_give_back_what_they_gave():
    caps = SlotCaps(limit=2)
    assert [caps.take("a"), caps.take("a"), caps.take("a")] == [True, True, False]
    assert caps.take("b")  # another key has its own slots
    caps.give_back("a")
    assert caps.take("a") and not caps.take("a")
    for _ in range(5):  # giving back more than was taken never makes room beyond the cap
        caps.give_back("b")
    assert caps.held == {"a": 2}
    assert caps.take("b") and caps.take("b") and not caps.take("b")
    unlimited = SlotCaps(limit=0)
    assert all(unlimited.take("a") for _ in range(1000))
    with pytest.raises(ValueError):
        SlotCaps(limit=-1)


def test_several_caps_are_taken_all_or_none():
    callers, addresses = SlotCaps(limit=3), SlotCaps(limit=2)
    assert take_all([(callers, "t1"), (addresses, "10.0.0.1")]) is None
    assert take_all([(callers, "t2"), (addresses, "10.0.0.1")]) is None
    assert take_all([(callers, "t3"), (addresses, "10.0.0.1")]) == 1  # the address is full
    assert callers.held == {"t1": 1, "t2": 1}  # t3's slot went back
    give_back = take_or_refuse([(callers, "t1"), (addresses, "10.0.0.2")], what="x", names="ab")
    give_back()
    give_back()  # once only
    assert callers.held == {"t1": 1, "t2": 1} and addresses.held == {"10.0.0.1": 2}
    with pytest.raises(TooManyRequests) as refused:
        take_or_refuse(
            [(callers, "t1"), (addresses, "10.0.0.1")],
            what="long-polls",
            names=("caller", "client address"),
        )
    assert refused.value.status_code == 429 and refused.value.retry_after == CAP_RETRY_SECONDS
    assert "client address" in refused.value.message and "at most 2" in refused.value.message


def test_a_token_bucket_allows_a_burst_then_its_rate_and_says_how_long_to_wait():
    buckets = TokenBuckets(burst=3, per_second=2.0)
    assert [buckets.take("a", now=100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a", now=100.0) == pytest.approx(0.5)  # half a second to a token
    assert buckets.take("a", now=100.25) == pytest.approx(0.25)  # a refused take costs none
    assert buckets.take("a", now=100.5) == 0.0
    assert buckets.take("b", now=100.5) == 0.0  # another key: its own burst
    assert [buckets.take("a", now=1000.0) for _ in range(4)][-1] > 0  # refills to the burst
    assert all(TokenBuckets(burst=1, per_second=0).take("a", now=0.0) == 0 for _ in range(99))


def test_a_token_bucket_remembers_a_bounded_number_of_keys():
    buckets = TokenBuckets(burst=1, per_second=0.001, max_keys=3)
    for key in range(100):
        buckets.take(key, now=0.0)
    assert list(buckets.buckets) == [97, 98, 99]
    assert buckets.take(99, now=0.0) > 0  # the recent ones are still empty
    with pytest.raises(ValueError):
        TokenBuckets(burst=0, per_second=1.0)


# ---------------------------------------------------------------- long-polls


def poll_in_background(
    client: httpx.Client, path: str, timeout: float, results: list, read_timeout: float = 30
):
    def run():
        try:
            response = client.get(path, params={"timeout": timeout}, timeout=timeout + read_timeout)
            results.append(response.status_code)
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def held(service: Service, caps: str, key) -> int:
    return getattr(service.app.state.fair_shares, caps).held.get(key, 0)


@pytest.fixture
def capped(db_url, tmp_path):
    service = start_service(
        db_url, tmp_path / "home", long_polls_per_caller=3, streams_per_address=2
    )
    yield service
    service.stop()


@pytest.mark.slow
@one_database("caps, buckets and the forecast cache are in memory")
def test_a_tenant_over_its_long_poll_cap_gets_429_while_another_tenant_polls(capped):
    hostile, victim = capped.tenant(), capped.tenant()
    bid = hostile.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
    assert bid.status_code == 201, bid.text
    results: list = []
    paths = ["/events", "/events", f"/bids/{bid.json()['id']}/events"]  # a bid's is its tenant's
    threads = [poll_in_background(hostile, path, 8.0, results) for path in paths]
    key = ("tenant", hostile.tenant_id)
    capped.wait_for(lambda: held(capped, "long_polls_by_caller", key) == 3)
    for path in paths:
        refused = hostile.get(path, params={"timeout": 1})
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        body = refused.json()
        assert "too many long-polls" in body["detail"] and body["retry_after"] >= 1
    started = time.monotonic()
    answered = victim.get("/events", params={"timeout": 0.5})
    assert answered.status_code == 200 and answered.json() == {"events": [], "cursor": 0}
    assert time.monotonic() - started < 5
    for thread in threads:
        thread.join(timeout=20)
    assert results == [200, 200, 200]  # the held polls answered at their timeout
    assert held(capped, "long_polls_by_caller", key) == 0  # and gave their slots back
    assert hostile.get("/events", params={"timeout": 0}).status_code == 200


@pytest.mark.slow
@one_database("caps, buckets and the forecast cache are in memory")
def test_a_client_that_goes_away_gives_its_long_poll_slots_back(capped):
    hostile = capped.tenant()
    results: list = []
    leaving = httpx.Client(base_url=hostile.base_url, headers=hostile.headers)
    threads = [poll_in_background(leaving, "/events", 30.0, results, -29.5) for _ in range(3)]
    for thread in threads:  # each client read times out at 0.5 s and closes its connection
        thread.join(timeout=10)
    leaving.close()
    assert results == ["ReadTimeout"] * 3
    key = ("tenant", hostile.tenant_id)
    capped.wait_for(lambda: held(capped, "long_polls_by_caller", key) == 0, timeout=5)
    assert hostile.get("/events", params={"timeout": 0}).status_code == 200


@pytest.mark.slow
@one_database("caps, buckets and the forecast cache are in memory")
def test_one_address_over_its_long_poll_cap_is_refused_whatever_its_keys(db_url, tmp_path):
    service = start_service(db_url, tmp_path / "home", long_polls_per_address=2)
    try:
        tenants = [service.tenant() for _ in range(3)]
        results: list = []
        threads = [poll_in_background(t, "/events", 3.0, results) for t in tenants[:2]]
        service.wait_for(lambda: held(service, "long_polls_by_address", "127.0.0.1") == 2)
        refused = tenants[2].get("/events", params={"timeout": 1})
        assert refused.status_code == 429 and "client address" in refused.json()["detail"]
        assert held(service, "long_polls_by_caller", ("tenant", tenants[2].tenant_id)) == 0
        for thread in threads:
            thread.join(timeout=20)
        assert results == [200, 200]
    finally:
        service.stop()


# ---------------------------------------------------------------- streams


@pytest.mark.slow
@one_database("caps, buckets and the forecast cache are in memory")
def test_anonymous_streams_beyond_the_cap_get_429(capped):
    url = capped.base_url + "/api/v1/stream"
    with (
        httpx.Client(timeout=10) as a,
        httpx.Client(timeout=10) as b,
        a.stream("GET", url) as first,
        b.stream("GET", url) as second,
    ):
        held_open = [live.iter_lines() for live in (first, second)]  # (closed when dropped)
        for live, lines in zip((first, second), held_open, strict=True):
            assert live.status_code == 200 and next(lines).startswith("event: market")
        with httpx.stream("GET", url, timeout=10) as refused:
            assert refused.status_code == 429  # (a stream served instead: fail, never read)
            refused.read()
        assert int(refused.headers["Retry-After"]) >= 1
        assert "too many streams" in refused.json()["detail"]
        assert refused.headers["content-type"].startswith("application/json")
        once = httpx.get(url, params={"once": True}, timeout=10)  # one read, no slot held
        assert once.status_code == 200 and once.text.startswith("event: market")
    # the closed streams gave their slots back: a new one is served
    capped.wait_for(lambda: held(capped, "streams_by_address", "127.0.0.1") == 0, timeout=5)
    once = httpx.get(url, params={"once": True}, timeout=10)
    assert once.status_code == 200 and once.text.startswith("event: market")
    # every stream sends the one message read for this market version
    snapshot = capped.app.state.stream_snapshot
    reads = snapshot.reads
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda _: httpx.get(url, params={"once": True}).text, range(2)))
    assert texts[0].startswith("event: market") and snapshot.reads - reads <= 2


# ---------------------------------------------------------------- estimates and forecasts

REGIONS = ("eu-west", "us-east", "ap-south")


def store_minute_history(db_url: str, regions=REGIONS, days: int = 8) -> int:
    """Minute bars every 10 minutes for ``days`` in each region (cheap by night); the newest
    minute stored."""
    now_minute = int(time.time() // 60)
    minutes = np.arange(now_minute - days * 1440, now_minute - 1, 10)
    engine = sa.create_engine(db_url)
    with engine.begin() as connection:
        for i, region in enumerate(regions):
            price = np.where(((minutes // 60 + 8 * i) % 24) < 9, 0.9, 1.5)
            connection.execute(
                sa.insert(PriceBar),
                [
                    {
                        "gpu_model": "A100-80G",
                        "region": region,
                        "minute": int(m),
                        "open": p,
                        "high": p,
                        "low": p,
                        "close": p,
                    }
                    for m, p in zip(minutes, price, strict=True)
                ],
            )
    engine.dispose()
    return int(minutes[-1])


def add_bar(db_url: str, region: str, minute: int) -> None:
    engine = sa.create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(
            sa.insert(PriceBar),
            [
                {
                    "gpu_model": "A100-80G",
                    "region": region,
                    "minute": minute,
                    "open": 1.0,
                    "high": 1.0,
                    "low": 1.0,
                    "close": 1.0,
                }
            ],
        )
    engine.dispose()


ESTIMATE = {"gpu_model": "A100-80G", "region": "any", "gpu_hours": 8, "max_price": 1.2}


def estimate_body() -> dict:
    return {**ESTIMATE, "deadline": datetime.fromtimestamp(time.time() + 86400, UTC).isoformat()}


@pytest.mark.slow
@one_database("caps, buckets and the forecast cache are in memory")
def test_an_anonymous_estimate_flood_is_rationed_and_a_tenant_still_estimates(service, db_url):
    store_minute_history(db_url)
    anonymous = service.client()
    body = estimate_body()
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: anonymous.post("/estimate", json=body), range(30)))
    statuses = [r.status_code for r in codes]
    assert set(statuses) == {200, 429}, statuses
    settings = service.app.state.settings
    assert statuses.count(200) <= settings.anonymous_estimates_burst + 2  # + the refill
    refused = next(r for r in codes if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1 and "too many estimates" in refused.text
    # a key that is no key is anonymous still; a tenant's key has its own, larger share
    assert service.client("sgk_made-up").post("/estimate", json=body).status_code == 429
    tenant = service.tenant()
    answered = tenant.post("/estimate", json=body)
    assert answered.status_code == 200, answered.text
    assert [r["region"] for r in answered.json()["regions"]] != []


@pytest.mark.slow
@one_database("caps, buckets and the forecast cache are in memory")
def test_a_forecast_is_fitted_once_per_bar_and_the_any_region_estimate_reuses_it(driven, db_url):
    """On a clock that stands still (``driven``): the wall clock's minute moving on would slide
    the window past its oldest bar, a new fingerprint and a fit this test does not count."""
    service = driven
    newest = store_minute_history(db_url)
    tenant = service.tenant()
    forecasts = service.app.state.forecasts
    before = forecasts.computed
    first = tenant.post("/estimate", json=estimate_body())
    assert first.status_code == 200, first.text
    assert forecasts.computed - before == len(REGIONS)  # one fit per region
    for _ in range(3):
        again = tenant.post("/estimate", json=estimate_body())
        assert again.status_code == 200 and again.json()["regions"] == first.json()["regions"]
        one = tenant.post("/estimate", json={**estimate_body(), "region": "us-east"})
        assert one.status_code == 200
        forecast = tenant.get("/prices/A100-80G/eu-west/forecast", params={"days": 28})
        assert forecast.status_code == 200 and forecast.json()["history_hours"] > 100
    assert forecasts.computed - before == len(REGIONS)  # every answer from the same fits
    add_bar(db_url, "us-east", newest + 5)  # a new bar closes in one region
    assert tenant.post("/estimate", json=estimate_body()).status_code == 200
    assert forecasts.computed - before == len(REGIONS) + 1  # only that region is refitted
    add_bar(db_url, "sa-east", newest + 5)  # a new region's first bar
    regions = tenant.post("/estimate", json=estimate_body()).json()["regions"]
    assert {r["region"] for r in regions} == {*REGIONS, "sa-east"}
    assert forecasts.computed - before == len(REGIONS) + 2


def test_a_forecast_that_must_be_fitted_afresh_spends_the_anonymous_share(db_url, tmp_path):
    service = start_service(
        db_url, tmp_path / "home", anonymous_estimates_burst=2, public_cache_seconds=0
    )
    try:
        store_minute_history(db_url, regions=("eu-west",), days=3)
        anonymous = service.client()
        path = "/prices/A100-80G/eu-west/forecast"  # windows longer than the history stored
        assert anonymous.get(path, params={"days": 4}).status_code == 200
        for _ in range(5):  # answered from the fitted forecast: free
            assert anonymous.get(path, params={"days": 4}).status_code == 200
        assert anonymous.get(path, params={"days": 5}).status_code == 200
        refused = anonymous.get(path, params={"days": 6})  # a third fit: over the share
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert anonymous.get(path, params={"days": 4}).status_code == 200  # the fitted: free
    finally:
        service.stop()


# ---------------------------------------------------------------- the event watcher


def count_event_reads(engine) -> tuple[list, object]:
    """A list that grows by one per statement reading the ``events`` table, and the
    listener (to remove)."""
    reads: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany):
        text = " ".join(statement.split()).lower()
        if text.startswith("select") and "from events" in text:
            reads.append(text[:80])

    sa.event.listen(engine, "before_cursor_execute", before)
    return reads, before


def waiting_polls_cost(service: Service, tenants: list, polls: int, window: float) -> int:
    """Statements reading ``events`` while ``polls`` long-polls wait ``window`` seconds."""
    results: list = []
    threads = [
        poll_in_background(tenants[i % len(tenants)], "/events", window + 3, results)
        for i in range(polls)
    ]
    shares = service.app.state.fair_shares
    service.wait_for(lambda: sum(shares.long_polls_by_caller.held.values()) == polls)
    time.sleep(0.5)  # the polls' own first queries are done
    engine = service.app.state.engine
    reads, listener = count_event_reads(engine)
    try:
        time.sleep(window)
    finally:
        sa.event.remove(engine, "before_cursor_execute", listener)
    for thread in threads:
        thread.join(timeout=30)
    assert results == [200] * polls
    return len(reads)


@pytest.mark.slow
@one_database("the watcher is in memory and its one query is plain SQL on either database")
def test_waiting_long_polls_do_not_each_query_the_database(service):
    tenants = [service.tenant() for _ in range(3)]
    few = waiting_polls_cost(service, tenants, polls=2, window=2.0)
    many = waiting_polls_cost(service, tenants, polls=40, window=2.0)
    # before the watcher: every poll read its events twice a second (40 polls: 160 reads)
    assert many <= 8 and many <= few + 4, (few, many)


@pytest.mark.slow
def test_a_waiting_poll_answers_within_a_tick_of_the_event(service):
    buyer, owner = service.tenant(), service.tenant()
    service.node(owner, gpus=1, reserve=0.5)
    results: list = []
    answered_at: list[float] = []

    def poll():
        page = buyer.get("/events", params={"timeout": 20}, timeout=60)
        answered_at.append(time.monotonic())
        results.append(page.json())

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    key = ("tenant", buyer.tenant_id)
    service.wait_for(lambda: held(service, "long_polls_by_caller", key) == 1)
    service.wait_for(lambda: service.app.state.event_watch.waiting == 1)  # not querying
    placed = buyer.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1})
    assert placed.status_code == 201, placed.text
    placed_at = time.monotonic()
    thread.join(timeout=30)
    assert results and results[0]["events"][0]["kind"] == "allocated"
    assert answered_at[0] - placed_at < 3  # a tick (0.1 s) and the next one's commit


@pytest.mark.slow
def test_a_replica_that_does_not_lead_wakes_its_polls_too(service, db_url, tmp_path):
    """A second replica without a tick loop: its waiting poll learns of the leader's event
    from its watcher's own reads (every half second)."""
    replica = start_follower(db_url, tmp_path / "replica")
    try:
        buyer, owner = service.tenant(), service.tenant()
        service.node(owner, gpus=1, reserve=0.5)
        follower = replica.client(buyer.headers["Authorization"].removeprefix("Bearer "))
        results: list = []
        thread = poll_in_background(follower, "/events", 20.0, results)
        key = ("tenant", buyer.tenant_id)
        replica.wait_for(lambda: held(replica, "long_polls_by_caller", key) == 1)
        placed = buyer.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1})
        assert placed.status_code == 201
        placed_at = time.monotonic()
        thread.join(timeout=30)
        assert results == [200] and time.monotonic() - placed_at < 5
        assert replica.app.state.event_watch.reads >= 1
    finally:
        replica.stop()


def start_follower(db_url: str, home) -> Service:
    """A replica on the same database that never ticks (``run_ticker`` off)."""
    from prefect_spotgpu.service.api import create_app
    from prefect_spotgpu.service.settings import ServiceSettings

    settings = ServiceSettings(
        db_url=db_url, home=home, admin_key=ADMIN_KEY, run_ticker=False, tick_seconds=0.1
    )
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True, name=f"replica-{uuid.uuid4()}")
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the replica did not start"
        time.sleep(0.02)
    return Service(f"http://127.0.0.1:{port}", app, server, thread)
