"""Webhooks: Standard Webhooks-signed POSTs to a real local receiver, retried with backoff,
logged (a status code or an error class, never a body)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from standardwebhooks.webhooks import Webhook

from prefect_spotgpu.service.webhooks import standard_secret, verify

SECRET = "a-webhook-secret-of-some-length"


class Receiver:
    """An HTTP endpoint on loopback that fails its first ``failures`` requests (a 500 whose
    body is ``failure_body``)."""

    def __init__(self, failures: int, failure_body: bytes = b"") -> None:
        self.failures = failures
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append(
                    {"headers": dict(self.headers), "body": body, "at": time.time()}
                )
                failing = len(receiver.received) <= receiver.failures
                self.send_response(500 if failing else 204)
                if failing and failure_body:
                    self.send_header("Content-Length", str(len(failure_body)))
                self.end_headers()
                if failing and failure_body:
                    self.wfile.write(failure_body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.received if json.loads(r["body"])["event"] == kind]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver(failures=1)
    yield r
    r.close()


def test_events_are_posted_signed_and_retried(service, receiver):
    alice, owner = service.tenant(), service.tenant()
    refused = alice.put("/webhook", json={"url": receiver.url})
    assert refused.status_code == 422 and refused.json()["field"] == "secret"
    response = alice.put("/webhook", json={"url": receiver.url, "secret": SECRET})
    assert response.json() == {"url": receiver.url, "has_secret": True}
    service.node(owner)
    bid = alice.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 2, "max_price": 1.0}
    ).json()
    delivered = service.wait_for(
        lambda: [d for d in alice.get("/webhook/deliveries").json() if d["status"] == "delivered"],
        timeout=15,
    )[0]
    assert delivered["attempts"] == 2  # the receiver failed the first one
    assert delivered["last_status_code"] == 204
    first, second = receiver.received[:2]
    assert first["body"] == second["body"]  # the same event, retried
    headers = {k.lower(): v for k, v in second["headers"].items()}
    assert headers["x-spotgpu-event"] == "allocated"
    assert "x-spotgpu-signature" not in headers and "x-spotgpu-timestamp" not in headers
    # the delivery id, the same on every attempt; each attempt signed at its own time
    assert headers["webhook-id"] == first["headers"]["webhook-id"] == str(delivered["id"])
    assert abs(int(headers["webhook-timestamp"]) - second["at"]) <= 2
    for attempt in (first, second):
        Webhook(standard_secret(SECRET)).verify(attempt["body"], attempt["headers"])
        assert verify(SECRET, attempt["headers"], attempt["body"])
    payload = json.loads(second["body"])
    assert payload["bid_id"] == bid["id"] and payload["event"] == "allocated"
    assert alice.get("/webhook").json()["has_secret"] is True


def test_a_standard_webhooks_secret_signs_deliveries(service, receiver):
    alice, owner = service.tenant(), service.tenant()
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the spec's example secret
    bad = alice.put("/webhook", json={"url": receiver.url, "secret": "whsec_not base64!"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "secret"]
    assert alice.put("/webhook", json={"url": receiver.url, "secret": secret}).status_code == 200
    service.node(owner)
    alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
    service.wait_for(lambda: len(receiver.received) >= 2, timeout=15)  # a failure, then 204
    for attempt in receiver.received[:2]:
        assert Webhook(secret).verify(attempt["body"], attempt["headers"])["event"] == "allocated"


def test_a_dead_endpoint_is_given_up_after_the_last_attempt(db_url, tmp_path):
    from conftest import start_service

    svc = start_service(db_url, tmp_path / "home", webhook_max_attempts=3)
    try:
        alice, owner = svc.tenant(), svc.tenant()
        alice.put(
            "/webhook", json={"url": "http://127.0.0.1:9/nothing-listens-here", "secret": SECRET}
        )
        svc.node(owner)
        alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
        failed = svc.wait_for(
            lambda: [d for d in alice.get("/webhook/deliveries").json() if d["status"] == "failed"],
            timeout=20,
        )[0]
        assert failed["attempts"] == 3 and failed["last_error"] == "ConnectError"
    finally:
        svc.stop()
