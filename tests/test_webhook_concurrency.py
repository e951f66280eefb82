"""One slow receiver delays nobody else: deliveries go out from a bounded pool, one in flight
per tenant, and each attempt has one deadline for all of it."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time

import httpcore
import pytest
import sqlalchemy as sa

from prefect_spotgpu.service.webhooks import post
from test_service_webhooks import SECRET, Receiver


class Silent:
    """A TCP endpoint on loopback that accepts connections and never answers, or answers one
    byte of a status line every ``drip`` seconds. Counts the connections open at once."""

    def __init__(self, drip: float | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        self.drip = drip
        self.accepted = 0
        self.open = 0
        self.most_open = 0
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
                self.open += 1
                self.most_open = max(self.most_open, self.open)
                self.connections.append(connection)
            threading.Thread(target=self._hold, args=(connection,), daemon=True).start()

    def _hold(self, connection: socket.socket) -> None:
        connection.settimeout(self.drip)
        try:
            while True:
                try:
                    if not connection.recv(65536):
                        break  # the sender gave up and closed
                except TimeoutError:
                    connection.send(b"H")  # one byte of "HTTP/1.1 200 OK", forever
        except OSError:
            pass
        with self.lock:
            self.open -= 1

    def close(self) -> None:
        with self.lock:
            for sock in [self.listener, *self.connections]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
                sock.close()


@pytest.fixture
def silent():
    endpoint = Silent()
    yield endpoint
    endpoint.close()


def test_a_hanging_receiver_does_not_delay_another_tenants_notice(service, silent):
    receiver = Receiver(failures=0)
    try:
        hanging, bob, rival, owner = (service.tenant() for _ in range(4))
        assert hanging.put("/webhook", json={"url": silent.url, "secret": SECRET}).is_success
        assert bob.put("/webhook", json={"url": receiver.url, "secret": SECRET}).is_success
        service.node(owner, region="eu-west")
        service.node(owner, region="us-east")
        spot = {"gpu_model": "A100-80G", "max_price": 1.0}
        bob.post("/bids", json={**spot, "gpu_count": 4, "region": "us-east"})
        service.wait_for(lambda: receiver.events("allocated"), timeout=15)
        for _ in range(3):  # three allocations whose webhooks hang
            hanging.post("/bids", json={**spot, "gpu_count": 2, "region": "eu-west"})
        service.wait_for(lambda: silent.accepted >= 1, timeout=15)  # one is hanging now
        rival.post("/bids", json={**spot, "gpu_count": 8, "region": "us-east", "max_price": 3.0})
        notice = service.wait_for(lambda: receiver.events("noticed"), timeout=15)[0]
        payload = json.loads(notice["body"])
        assert payload["reason"] == "outbid"
        assert notice["at"] - payload["at"] < 2.0  # within 2 s of its tick
        assert silent.open == 1  # still hanging: one attempt of that tenant's in flight
        assert silent.most_open == 1  # never more than one at a time for a tenant
        pending = [d for d in hanging.get("/webhook/deliveries").json() if d["attempts"] == 0]
        assert len(pending) >= 2  # its later deliveries wait their turn
    finally:
        receiver.close()


def test_an_attempt_has_one_deadline_however_the_receiver_drips():
    dripping = Silent(drip=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(httpcore.ReadTimeout):
            post(
                dripping.url,
                b"{}",
                {"Content-Type": "application/json"},
                timeout=1.0,
                allow_private=True,
                ssl_context=ssl.create_default_context(),
            )
        assert time.monotonic() - started < 1.5
    finally:
        dripping.close()


def test_a_hanging_receivers_attempt_ends_at_the_deadline(db_url, tmp_path, silent):
    from conftest import start_service

    svc = start_service(db_url, tmp_path / "home", webhook_timeout_seconds=1.0)
    try:
        alice, owner = svc.tenant(), svc.tenant()
        alice.put("/webhook", json={"url": silent.url, "secret": SECRET})
        svc.node(owner)
        alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
        timed_out = svc.wait_for(
            lambda: [d for d in alice.get("/webhook/deliveries").json() if d["last_error"]],
            timeout=10,
        )[0]
        assert timed_out["last_error"] == "ReadTimeout" and timed_out["status"] == "pending"
    finally:
        silent.close()
        svc.stop()


def test_a_tenants_deliveries_arrive_in_event_order(service):
    receiver = Receiver(failures=0)
    try:
        alice, owner = service.tenant(), service.tenant()
        alice.put("/webhook", json={"url": receiver.url, "secret": SECRET})
        service.node(owner, gpus=8)
        for _ in range(6):
            alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
        service.wait_for(lambda: len(receiver.received) >= 6, timeout=15)
        ids = [int(r["headers"]["X-SpotGPU-Event-Id"]) for r in receiver.received]
        assert ids == sorted(ids) and len(set(ids)) == 6
    finally:
        receiver.close()


def test_the_dispatcher_skips_a_busy_tenants_backlog_and_takes_turns(db_url):
    from datetime import UTC, datetime

    from prefect_spotgpu.service.db import make_engine, make_sessionmaker, migrate
    from prefect_spotgpu.service.models import WebhookDelivery
    from prefect_spotgpu.service.settings import ServiceSettings
    from prefect_spotgpu.service.webhooks import WebhookSender

    engine = make_engine(db_url)
    try:
        migrate(engine)
        sessions = make_sessionmaker(engine)
        now = time.time()

        def row(tenant_id, next_at):
            return {
                "tenant_id": tenant_id,
                "event_id": 1,
                "url": "http://example.test/",
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": next_at,
                "updated_at": datetime.now(UTC),
            }

        with sessions.begin() as session:  # tenant 1: a backlog of 600, then a retry due last
            session.execute(sa.insert(WebhookDelivery), [row(1, now - 100)] * 600)
            session.execute(sa.insert(WebhookDelivery), [row(2, now - 50), row(1, now - 10)])
            session.execute(sa.insert(WebhookDelivery), [row(3, now + 60)])  # not due yet
        sender = WebhookSender(ServiceSettings(db_url=db_url), sessions)
        # tenant 1 busy: its backlog ahead does not hide tenant 2
        assert list(sender.due(now, busy={1}, tenants=8)) == [2]
        # a tenant's batch is in id order (its first attempts in event order)
        first = sender.due(now, busy=set(), tenants=8)
        assert list(first) == [1] and first[1] == sorted(first[1]) and len(first[1]) == 500
        # among tenants in view, whose turn was longest ago goes first
        sender._turns[1] = time.monotonic()
        assert list(sender.due(now, busy=set(), tenants=1, scan=700)) == [2]
    finally:
        engine.dispose()
