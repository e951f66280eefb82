"""The worker's bid batcher (``worker/bid_batch.py``) against the real service: the bids of
many runs, placed from several threads and event loops at once, go out as a few
``POST /bids/batch`` requests, and each run still gets its own answer — a refused bid does not
sink the others."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from conftest import ADMIN_KEY, start_service
from prefect_spotgpu.api_client import async_api_client
from prefect_spotgpu.messages import BidRequest, BidResponse
from prefect_spotgpu.worker.bid_batch import BidBatcher, BidBatchers
from prefect_spotgpu.worker.market_api import MarketApi, MarketError


@pytest.fixture
def market(tmp_path):
    svc = start_service(f"sqlite:///{tmp_path / 'market.db'}", tmp_path / "home")
    yield svc
    svc.stop()


def key_of(client) -> str:
    return client.headers["Authorization"].split()[1]


def body(**more) -> BidRequest:
    terms = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0,
             "idempotency_key": uuid.uuid4().hex, **more}  # fmt: skip
    return BidRequest(**terms)


def place_from_threads(
    url: str, key: str, bodies: list[dict], batchers: BidBatchers, threads: int = 4
) -> list:
    """Each thread its own event loop and client, as a fan-out's children have: one
    worker's ``batchers``."""
    answers: list = [None] * len(bodies)

    def one_loop(indexes: list[int]) -> None:
        async def go():
            async with async_api_client(url, key) as http:
                api = MarketApi(http, batchers)

                async def place(i):
                    try:
                        answers[i] = await api.place(bodies[i])
                    except MarketError as exc:
                        answers[i] = exc

                await asyncio.gather(*(place(i) for i in indexes))

        asyncio.run(go())

    workers = [
        threading.Thread(target=one_loop, args=(list(range(t, len(bodies), threads)),))
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    return answers


def test_many_runs_bids_go_out_in_a_few_batches_each_answered_alone(market):
    alice, batchers = market.tenant(), BidBatchers()
    bodies = [body() for _ in range(40)]
    bodies[7] = body(job={"command": ["x"], "image": "evil/root:latest"})  # not in the catalogue
    answers = place_from_threads(market.base_url, key_of(alice), bodies, batchers)
    refused = answers[7]
    assert isinstance(refused, MarketError) and refused.status == 422
    assert "not in the market's catalogue" in str(refused) and "bids[" not in str(refused)
    placed = [a for i, a in enumerate(answers) if i != 7]
    assert all(isinstance(a, BidResponse) for a in placed), answers
    assert [a.idempotency_key for a in placed] == [
        b.idempotency_key for i, b in enumerate(bodies) if i != 7
    ]
    assert len({a.id for a in placed}) == 39
    (batcher,) = batchers.batchers.values()  # one market connection
    assert 1 <= batcher.requests <= 12  # not 40 requests
    again = place_from_threads(market.base_url, key_of(alice), bodies[:7], batchers)  # retried
    assert [a.id for a in again] == [a.id for a in placed[:7]]  # no bid twice
    batchers.close()  # its worker stops: the batcher's thread ends
    assert not batcher.thread.is_alive() and batchers.batchers == {}


def test_a_balance_that_covers_some_bids_answers_each_run_alone(market):
    admission = 1000 * 8 * (300 + 10 * 0.1) / 3600  # price x GPUs x the admission horizon
    mallory = market.tenant(credit=round(2.5 * admission, 6))
    bodies = [body(gpu_count=8, max_price=1000) for _ in range(6)]
    batcher = BidBatcher(market.base_url + "/api/v1", f"Bearer {key_of(mallory)}")

    async def go():
        return await asyncio.gather(*(batcher.place(b.body()) for b in bodies))

    codes = sorted(r.status_code for r in asyncio.run(go()))
    assert codes == [201, 201, 402, 402, 402, 402], codes
    assert ADMIN_KEY  # (the admin key set up the tenant)
