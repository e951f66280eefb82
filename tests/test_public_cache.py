"""The anonymous market views are answered once per tick (service/public_cache.py): from memory
while the market has not moved, afresh as soon as this replica's tick changes it; never for a
request with a key, never an error."""

from __future__ import annotations

import pytest

from conftest import one_database, start_service
from prefect_spotgpu.service.public_cache import MAX_ENTRIES, PublicCache


@pytest.fixture
def cached(db_url, tmp_path):
    service = start_service(db_url, tmp_path / "home", public_cache_seconds=30)
    yield service
    service.stop()


def beat(agent, node, utilization: int) -> None:
    gpus = [{"index": 0, "utilization": utilization, "memory_used_mb": 1}]
    response = agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": {"gpus": gpus}})
    assert response.status_code == 200, response.text


def utilization(client, node) -> int | None:
    nodes = client.get("/market/nodes").json()
    gpus = next(n for n in nodes if n["id"] == node["id"])["gpus"]
    return gpus[0]["utilization"] if gpus else None


def a_cached_view(cached):
    """A node whose view anonymous readers have cached at 10 % while it now reports 90 %
    (telemetry is not a market move: the cached view stands); (owner, node, anonymous)."""
    owner = cached.tenant()
    node, agent = cached.node(owner, gpus=1, reserve=0.5)
    anonymous = cached.client()
    # the tick that takes the new node in moves the market (and writes its first quote):
    # wait for it, or it would refresh the view between the two beats
    cached.wait_for(lambda: anonymous.get("/prices").json())
    beat(agent, node, 10)
    cached.wait_for(lambda: utilization(anonymous, node) == 10)
    beat(agent, node, 90)
    return owner, node, anonymous


@one_database("the cache is an in-memory middleware in front of the routes")
def test_a_view_is_read_once_until_the_market_moves(cached):
    owner, node, anonymous = a_cached_view(cached)
    assert utilization(anonymous, node) == 10
    # a key is never served from the cache (nor cached)
    assert utilization(owner, node) == 90
    # a bid that wins moves the market: the next anonymous read is fresh
    buyer = cached.tenant()
    bid = buyer.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
    assert bid.status_code == 201
    cached.wait_for(lambda: utilization(anonymous, node) == 90)
    assert (
        next(n for n in anonymous.get("/market/nodes").json() if n["id"] == node["id"])["gpus_busy"]
        == 1
    )


@one_database("the cache is an in-memory middleware in front of the routes")
def test_errors_and_other_queries_are_not_answered_from_the_cache(cached):
    anonymous = cached.client()
    assert anonymous.get("/market/depth/nope/eu-west").status_code == 422
    owner = cached.tenant()
    cached.node(owner, gpus=2, reserve=0.5)
    cached.wait_for(lambda: anonymous.get("/prices").json())  # the first quote, once written
    for hours in (1, 2, 3):  # each query string is its own answer
        response = anonymous.get("/prices/A100-80G/eu-west/history", params={"hours": hours})
        assert response.status_code == 200
    assert anonymous.get("/market/depth/nope/eu-west").status_code == 422
    bad = anonymous.get("/prices/A100-80G/eu-west/history", params={"hours": -1})
    assert bad.status_code == 422
    # the hardening headers are on a cached answer too
    first, again = anonymous.get("/prices"), anonymous.get("/prices")
    assert first.json() == again.json()
    assert "frame-ancestors 'none'" in again.headers["content-security-policy"]


@one_database("the cache is an in-memory middleware in front of the routes")
def test_made_up_query_parameters_neither_cache_nor_evict(cached):
    """The attack: an anonymous caller varies a parameter no route declares (``?x=1``, ``?x=2``,
    ...) to fill the cache and evict everyone's answers. Such a read is answered from the
    database, uncached; the view everyone reads stays cached."""
    _, node, anonymous = a_cached_view(cached)
    for i in range(MAX_ENTRIES + 44):
        junk = anonymous.get("/market/nodes", params={"x": i})
        assert junk.status_code == 200
        assert next(n for n in junk.json() if n["id"] == node["id"])["gpus"][0]["utilization"] == 90
    assert utilization(anonymous, node) == 10  # still the cached answer: nothing evicted it
    declared = anonymous.get("/prices/A100-80G/eu-west/history", params={"hours": 2})
    assert declared.status_code == 200


def test_only_declared_parameters_are_cached():
    cache = PublicCache(None, 1.0, lambda: 0, lambda: frozenset({"hours", "capacity"}))

    def scope(query: bytes, headers=()):
        path = "/api/v1/prices/A100-80G/eu-west/history"
        return {"type": "http", "method": "GET", "path": path, "query_string": query,
                "headers": list(headers)}  # fmt: skip

    assert cache._cacheable(scope(b""))
    assert cache._cacheable(scope(b"hours=2&capacity=spot"))
    assert not cache._cacheable(scope(b"hours=2&x=1"))
    assert not cache._cacheable(scope(b"x"))
    assert not cache._cacheable(scope(b"hours=2", [(b"authorization", b"Bearer k")]))
