"""Many bids in one request (``POST /bids/batch``, ``service/bulk_bids.py``): all or none,
idempotent per bid, the bad item named by its index, and credit reserved for the whole batch,
against the real service on SQLite and PostgreSQL.

Both databases, because what a batch must hold is about locking and transactions: parallel
batches of one tenant queue on its row (PostgreSQL ``FOR UPDATE``; SQLite's write lock) and a
refused batch rolls back every row it began."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefect_spotgpu.market.credit import exposure_micros
from prefect_spotgpu.service.schemas.bids import MAX_BIDS_PER_BATCH
from test_credit import NOTICE, TICK


def a_bid(**more) -> dict:
    return {
        "gpu_model": "A100-80G",
        "region": "eu-west",
        "gpu_count": 1,
        "max_price": 1.0,
        "idempotency_key": uuid.uuid4().hex,
        **more,
    }


@pytest.fixture
def market(db_url, tmp_path):
    from conftest import start_service

    svc = start_service(db_url, tmp_path / "home", notice_seconds=NOTICE)
    yield svc
    svc.stop()


def test_a_batch_places_every_bid_in_order_and_a_retry_writes_nothing_more(market):
    owner = market.tenant()
    market.node(owner, gpus=8)
    market.node(owner, gpus=8)
    alice = market.tenant()
    image = alice.get("/images").json()[0]["name"]
    batch = [
        a_bid(gpu_count=2, labels={"shard": str(i)}, job={"command": ["x"], "env": {"S": "v"}})
        for i in range(5)
    ]
    batch.append(a_bid(gpu_count=4, node_count=2, job={"command": ["x"], "image": image}))
    batch.append(a_bid(idempotency_key=None))  # a key is recommended, not required
    placed = alice.post("/bids/batch", json={"bids": batch})
    assert placed.status_code == 201, placed.text
    body = placed.json()
    assert body["created"] == [True] * 7
    assert [b["labels"] for b in body["bids"][:5]] == [{"shard": str(i)} for i in range(5)]
    assert body["bids"][5]["node_count"] == 2 and len(body["bids"][5]["members"]) == 2
    assert all("env" not in (b["job"] or {}) for b in body["bids"])  # sealed, never echoed
    ids = [b["id"] for b in body["bids"]]
    assert len(alice.get("/bids").json()) == 8  # the gang is two rows

    retried = alice.post("/bids/batch", json={"bids": batch[:6]})  # every key found
    assert retried.status_code == 200, retried.text
    assert [b["id"] for b in retried.json()["bids"]] == ids[:6]
    assert retried.json()["created"] == [False] * 6
    partly = alice.post("/bids/batch", json={"bids": [batch[0], a_bid()]})
    assert partly.status_code == 201 and partly.json()["created"] == [False, True]
    assert partly.json()["bids"][0]["id"] == ids[0]
    assert len(alice.get("/bids").json()) == 9
    # what the batch wrote, the tick places: the two-GPU bids fill the first node's free GPUs
    market.wait_for(
        lambda: sum(a["status"] == "running" for a in alice.get("/allocations").json()) >= 5
    )


def test_one_bad_item_refuses_the_batch_by_its_index_and_writes_nothing(market):
    alice = market.tenant()
    earlier = a_bid()
    assert alice.post("/bids", json=earlier).status_code == 201
    cases = [
        # a loose number: pydantic's own 422, its loc holds the index
        ([a_bid(), a_bid(gpu_count=True)], 422, ["body", "bids", 1, "gpu_count"]),
        ([a_bid(), a_bid(), a_bid(tenant_id=1)], 422, ["body", "bids", 2, "tenant_id"]),
        ([a_bid(), a_bid(), a_bid(job={"command": ["x"], "image": "evil/root:latest"})], 422,
         "bids[2].job.image"),
        ([a_bid(), {**earlier, "max_price": 2.0}], 409, "bids[1].idempotency_key"),
        ([a_bid(idempotency_key="k"), a_bid(idempotency_key="k")], 422,
         "bids[1].idempotency_key"),
        ([a_bid(node_count=3)], 422, "bids[0].node_count"),  # no nodes for a gang of 3
        ([a_bid()] * (MAX_BIDS_PER_BATCH + 1), 422, ["body", "bids"]),
        ([], 422, ["body", "bids"]),
    ]  # fmt: skip
    for batch, status, where in cases:
        refused = alice.post("/bids/batch", json={"bids": batch})
        assert refused.status_code == status, (where, refused.text)
        detail = refused.json()
        if isinstance(where, list):
            assert detail["detail"][0]["loc"] == where, detail
        else:
            assert detail["field"] == where, detail  # a 422's detail is pydantic's shape
            assert detail["item"] == int(where.split("]")[0].removeprefix("bids[")), detail
            message = detail["detail"] if status != 422 else detail["detail"][0]["msg"]
            assert message.startswith(where.split(".")[0] + ": "), detail
        assert len(alice.get("/bids").json()) == 1, where  # nothing of the batch was written
    assert "evil" not in alice.get("/bids").text


def test_a_batch_reserves_credit_for_every_bid_and_parallel_batches_cannot_overspend(market):
    """The overspend attack with batches: ten batches of four bids at once, from a tenant whose
    credit covers six bids. Whole batches are refused (402 naming the batch), at most one
    batch's worth fits, and a refused batch writes nothing."""
    each = exposure_micros(max_price=50.0, gpus=8, seconds=NOTICE + 10 * TICK) / 1e6
    mallory = market.tenant(credit=round(6.5 * each, 6))
    too_many = [a_bid(gpu_count=8, max_price=50.0) for _ in range(7)]
    refused = mallory.post("/bids/batch", json={"bids": too_many})
    assert refused.status_code == 402, refused.text
    assert "does not cover these 7 bids" in refused.json()["detail"]
    assert mallory.get("/bids").json() == []

    key = mallory.headers["Authorization"].split()[1]
    clients = [market.client(key) for _ in range(10)]
    batches = [[a_bid(gpu_count=8, max_price=50.0) for _ in range(4)] for _ in range(10)]
    with ThreadPoolExecutor(10) as pool:
        answers = list(
            pool.map(lambda c, b: c.post("/bids/batch", json={"bids": b}), clients, batches)
        )
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] + [402] * 9, codes
    assert len(mallory.get("/bids").json()) == 4


def test_a_batch_counts_against_the_cap_on_open_bids(db_url, tmp_path):
    from conftest import start_service

    svc = start_service(db_url, tmp_path / "home", max_open_bids_per_tenant=5)
    try:
        alice = svc.tenant()
        assert (
            alice.post("/bids/batch", json={"bids": [a_bid() for _ in range(3)]}).status_code == 201
        )
        over = alice.post("/bids/batch", json={"bids": [a_bid() for _ in range(3)]})
        assert over.status_code == 409, over.text
        assert "these 3 bids would add 3, and the operator's cap is 5" in over.json()["detail"]
        assert len(alice.get("/bids").json()) == 3
    finally:
        svc.stop()


def test_a_batch_never_touches_another_tenants_bids(market):
    alice, mallory = market.tenant(), market.tenant()
    mine = a_bid()
    first = alice.post("/bids/batch", json={"bids": [mine]}).json()["bids"][0]
    # the same key from another tenant is that tenant's own new bid, never alice's
    theirs = mallory.post("/bids/batch", json={"bids": [mine]})
    assert theirs.status_code == 201 and theirs.json()["bids"][0]["id"] != first["id"]
    assert market.client().post("/bids/batch", json={"bids": [a_bid()]}).status_code == 401
    assert [b["id"] for b in alice.get("/bids").json()] == [first["id"]]
