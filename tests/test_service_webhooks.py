"""Webhooks: signed POSTs to a real local receiver, retried with backoff, logged."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prefect_spotgpu.service.webhooks import sign, verify

SECRET = "a-webhook-secret-of-some-length"


class Receiver:
    """An HTTP endpoint on loopback that fails its first ``failures`` requests."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append({"headers": dict(self.headers), "body": body})
                failing = len(receiver.received) <= receiver.failures
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def receiver():
    r = Receiver(failures=1)
    yield r
    r.close()


def test_signature_round_trip():
    signature = sign(SECRET, "1700000000", b'{"a":1}')
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert verify(SECRET, "1700000000", b'{"a":1}', signature)
    assert not verify(SECRET, "1700000001", b'{"a":1}', signature)
    assert not verify("another-secret-value", "1700000000", b'{"a":1}', signature)


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
    headers = second["headers"]
    assert headers["X-SpotGPU-Event"] == "allocated"
    assert verify(
        SECRET, headers["X-SpotGPU-Timestamp"], second["body"], headers["X-SpotGPU-Signature"]
    )
    payload = json.loads(second["body"])
    assert payload["bid_id"] == bid["id"] and payload["event"] == "allocated"
    assert alice.get("/webhook").json()["has_secret"] is True


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
        assert failed["attempts"] == 3 and "ConnectError" in failed["last_error"]
    finally:
        svc.stop()
