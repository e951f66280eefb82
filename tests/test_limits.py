"""Every free-form input is bounded: labels, a job's environment, request bodies (413)."""

from __future__ import annotations

import json

from conftest import one_database
from helpers import post_streamed_oversized
from prefect_spotgpu.service.limits import MAX_BODY_BYTES

BID = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0}


def test_labels_and_job_environments_are_bounded(api):
    alice = api.tenant()
    for labels, field in (
        ({"k": "v" * 257}, "labels"),
        ({"k" * 64: "v"}, "labels"),
        ({"<img src=x>": "v"}, "labels"),
        ({f"k{i}": "v" for i in range(33)}, "labels"),
    ):
        response = alice.post("/bids", json={**BID, "labels": labels})
        assert response.status_code == 422, labels
        assert field in json.dumps(response.json()["detail"][0]["loc"])
    env = {f"A{i}": "v" * 30_000 for i in range(3)}
    response = alice.post("/bids", json={**BID, "job": {"command": ["x"], "env": env}})
    assert response.status_code == 422 and "at most 65536" in response.text
    assert "v" * 100 not in response.text  # the environment is never echoed
    ok = alice.post("/bids", json={**BID, "labels": {"team": "ml", "spotgpu.bid": "7"}})
    assert ok.status_code == 201
    assert [b["labels"] for b in alice.get("/bids").json()] == [{"team": "ml", "spotgpu.bid": "7"}]


@one_database("refused by validation before any query")
def test_a_body_over_the_limit_is_413_before_it_is_read(service):
    alice = service.tenant()
    huge = json.dumps({**BID, "labels": {"k": "v" * (MAX_BODY_BYTES + 10)}}).encode()
    response = alice.post("/bids", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and "larger than" in response.json()["detail"]

    streamed = post_streamed_oversized(service, alice.headers)
    assert streamed.status_code == 413
    telemetry = {"telemetry": {"gpus": [{"index": 0, "utilization": 1.0}], "x": "y" * 5_000_000}}
    _, agent = service.node(service.tenant(), gpus=1)
    node_id = agent.get("/nodes/me").json()["id"]
    assert agent.post(f"/nodes/{node_id}/heartbeat", json=telemetry).status_code == 413
    assert alice.get("/bids").json() == []  # nothing was written


def test_reads_never_wait_for_the_write_lock(service):
    """A writer holding SQLite's write lock (as the tick does while it commits) delays no GET:
    reading sessions take a snapshot, not the lock; on PostgreSQL they are READ ONLY."""
    import time

    from sqlalchemy import text

    alice = service.tenant()
    alice.post("/bids", json=BID)
    engine = service.app.state.engine
    with service.app.state.sessions.begin() as session:  # holds the write lock (SQLite)
        hold = text("UPDATE tenants SET spent_micros = spent_micros WHERE id = :id")
        session.execute(hold, {"id": 1})
        started = time.monotonic()
        for path in ("/bids", "/ledger", "/allocations", "/me"):
            assert alice.get(path).status_code == 200
        assert service.client().get("/prices").status_code == 200
        assert time.monotonic() - started < 2.0  # no busy wait of 30 s
    if engine.dialect.name == "postgresql":
        with service.app.state.reads.begin() as session:
            try:
                session.execute(text("UPDATE tenants SET spent_micros = spent_micros"))
            except Exception as exc:
                assert "read-only" in str(exc)
            else:
                raise AssertionError("a reading session wrote")


def test_a_refused_webhook_secret_is_never_echoed(api):
    alice = api.tenant()
    secret = "whsec_not-base64-but-secret!!"
    response = alice.put("/webhook", json={"url": "https://example.com/hook", "secret": secret})
    assert response.status_code == 422 and secret not in response.text
