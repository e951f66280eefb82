"""Prometheus metrics at /metrics, scraped from the real service and parsed, on real SQLite and
real PostgreSQL."""

from __future__ import annotations

import re
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from test_service_api import bid, wait_event
from test_service_webhooks import SECRET, Receiver


def scrape(service) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics``, by (sample name, labels)."""
    response = httpx.get(service.base_url + "/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples, name, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_metrics_report_the_market_the_tick_loop_and_the_api(service):
    alice, owner = service.tenant(), service.tenant()
    first, first_agent = service.node(owner, name="first", reserve=0.9)
    running = bid(alice, gpu_count=8, max_price=1.2)
    alloc = wait_event(alice, f"/bids/{running['id']}/events", "allocated")["allocation_id"]
    waiting = bid(alice, gpu_count=2, max_price=0.5)  # below every reserve: stays open
    service.node(owner, name="second", reserve=0.9)  # where the job migrates
    assert owner.patch(f"/nodes/{first['id']}", json={"state": "reclaimed"}).status_code == 200
    notice = wait_event(first_agent, f"/nodes/{first['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "reclaimed"
    report = {"epoch": notice["payload"]["epoch"], "outcome": "saved", "checkpoint_at": time.time()}
    saved = first_agent.post(f"/allocations/{alloc}/report", json=report)
    assert saved.status_code == 200, saved.text
    wait_event(alice, f"/bids/{running['id']}/events", "preempted")
    assert service.client().get("/no-such-route").status_code == 404

    # the quote the leader writes and the one /metrics reads must be of the same moment
    def settled():
        before = service.client().get("/prices").json()
        samples = scrape(service)
        after = service.client().get("/prices").json()
        ok = before == after and value(samples, "spotgpu_final_saves_total", outcome="ok") == 1
        ok = ok and value(samples, "spotgpu_pool_gpus_running", **pool) == 8
        return (after, samples) if ok else None

    pool = {"gpu_model": "A100-80G", "region": "eu-west", "capacity": "spot"}
    prices, samples = service.wait_for(settled, timeout=15)
    quote = next(q for q in prices if q["gpu_model"] == "A100-80G" and q["capacity"] == "spot")

    # market state, from the database
    assert value(samples, "spotgpu_pool_clearing_price", **pool) == quote["clearing_price"] == 0.9
    assert value(samples, "spotgpu_pool_gpus_free", **pool) == quote["gpus_free"] == 0
    assert value(samples, "spotgpu_pool_gpus_running", **pool) == quote["gpus_running"] == 8
    assert value(samples, "spotgpu_pool_gpus_total", **pool) == quote["gpus_total"]
    assert value(samples, "spotgpu_pool_waiting_bids", **pool) == quote["waiting_bids"] >= 1
    open_bids = alice.get("/bids", params={"status": "open"}).json()
    assert {b["id"] for b in open_bids} == {running["id"], waiting["id"]}
    assert value(samples, "spotgpu_bids", status="open") == 2
    assert value(samples, "spotgpu_bids", status="held") == 0

    # the tick loop
    ticks = value(samples, "spotgpu_tick_duration_seconds_count")
    assert ticks > 0 and value(samples, "spotgpu_tick_duration_seconds_sum") > 0
    assert value(samples, "spotgpu_tick_duration_seconds_bucket", le="+Inf") == ticks
    assert value(samples, "spotgpu_notices_total", reason="reclaimed") == 1
    assert value(samples, "spotgpu_notices_total", reason="outbid") == 0
    assert value(samples, "spotgpu_final_saves_total", outcome="ok") == 1
    assert value(samples, "spotgpu_final_saves_total", outcome="failed") == 0
    service.wait_for(  # and keeps counting them
        lambda: value(scrape(service), "spotgpu_tick_duration_seconds_count") > ticks
    )

    # the API, by route template
    def requests(method, route, status):
        labels = {"method": method, "route": route, "status": status}
        return value(samples, "spotgpu_http_request_duration_seconds_count", **labels) or 0

    assert requests("POST", "/api/v1/bids", "201") == 2
    assert requests("GET", "/api/v1/bids/{bid_id}/events", "200") >= 2
    assert requests("POST", "/api/v1/allocations/{allocation_id}/report", "200") == 1
    assert requests("PATCH", "/api/v1/nodes/{node_id}", "200") == 1
    assert requests("GET", "unmatched", "404") == 1
    routes = {
        dict(labels)["route"]
        for name, labels in samples
        if name == "spotgpu_http_request_duration_seconds_count"
    }
    assert "/metrics" not in routes
    assert not [r for r in routes if re.search(r"/\d+(/|$)", r)], routes  # templates, not ids


def test_webhook_deliveries_are_counted_by_outcome(service):
    receiver = Receiver(failures=1)
    try:
        alice, owner = service.tenant(), service.tenant()
        alice.put("/webhook", json={"url": receiver.url, "secret": SECRET})
        service.node(owner)
        bid(alice, gpu_count=2, max_price=1.0)

        def done():
            return [d for d in alice.get("/webhook/deliveries").json() if d["status"] != "pending"]

        delivered = service.wait_for(done, timeout=15)
        assert [d["status"] for d in delivered] == ["delivered"]
        samples = scrape(service)
        assert len(receiver.received) == delivered[0]["attempts"] == 2
        assert value(samples, "spotgpu_webhook_deliveries_total", outcome="failed") == 1
        assert value(samples, "spotgpu_webhook_deliveries_total", outcome="ok") == 1
    finally:
        receiver.close()
