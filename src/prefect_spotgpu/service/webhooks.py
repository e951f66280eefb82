"""Webhook deliveries: HMAC-SHA256-signed JSON POSTs, retried with exponential backoff.

Deliveries are rows written in the same transaction as their event (an outbox). A sender loop
claims due rows one at a time with a compare-and-set on ``attempts``, so two replicas never
send the same attempt twice, and logs every attempt's outcome on the row the tenant can read.

Receivers verify ``X-SpotGPU-Signature: sha256=<hex>``, the HMAC-SHA256 of
``<X-SpotGPU-Timestamp>.<raw body>`` with the tenant's webhook secret (see :func:`sign`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from datetime import UTC, datetime

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.service.metrics import ServiceMetrics
from prefect_spotgpu.service.models import EventRow, Tenant, WebhookDelivery
from prefect_spotgpu.service.settings import ServiceSettings

logger = logging.getLogger("prefect_spotgpu.service.webhooks")


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


class WebhookSender:
    def __init__(
        self,
        settings: ServiceSettings,
        sessions: sessionmaker[Session],
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.metrics = metrics or ServiceMetrics()
        self.client = httpx.Client(timeout=5.0, follow_redirects=False)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                sent = self.send_due(time.time())
            except Exception:
                logger.exception("webhook sender failed; retrying")
                sent = 0
            if not sent:
                stop.wait(0.25)
        self.client.close()

    def send_due(self, now: float, limit: int = 50) -> int:
        with self.sessions.begin() as session:
            due = list(
                session.execute(
                    select(WebhookDelivery.id, WebhookDelivery.attempts)
                    .where(
                        WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now
                    )
                    .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                    .limit(limit)
                )
            )
        for delivery_id, attempts in due:
            self._attempt(delivery_id, attempts)
        return len(due)

    def _attempt(self, delivery_id: int, attempts: int) -> None:
        now = time.time()
        with self.sessions.begin() as session:  # claim this attempt (compare-and-set)
            claimed = session.execute(
                update(WebhookDelivery)
                .where(
                    WebhookDelivery.id == delivery_id,
                    WebhookDelivery.status == "pending",
                    WebhookDelivery.attempts == attempts,
                )
                .values(attempts=attempts + 1, next_attempt_at=now + 30.0)
                .execution_options(synchronize_session=False)
            ).rowcount
            if claimed != 1:
                return
            delivery = session.get(WebhookDelivery, delivery_id)
            event = session.get(EventRow, delivery.event_id)
            tenant = session.get(Tenant, delivery.tenant_id)
            url, secret, payload = delivery.url, tenant.webhook_secret or "", event.payload
            event_kind, event_id = event.kind, event.id
        body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        stamp = str(int(now))
        code, error = None, None
        try:
            response = self.client.post(
                url,
                content=body,
                headers={
                    "Content-Type": "application/json",
                    "User-Agent": "prefect-spotgpu-webhooks",
                    "X-SpotGPU-Event": event_kind,
                    "X-SpotGPU-Event-Id": str(event_id),
                    "X-SpotGPU-Delivery": str(delivery_id),
                    "X-SpotGPU-Timestamp": stamp,
                    "X-SpotGPU-Signature": sign(secret, stamp, body),
                },
            )
            code = response.status_code
            ok = 200 <= code < 300
            if not ok:
                error = f"HTTP {code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"[:500]
        self.metrics.observe_delivery(ok)
        done = attempts + 1
        if ok:
            status, next_at = "delivered", now
        elif done >= self.settings.webhook_max_attempts:
            status, next_at = "failed", now
        else:
            status = "pending"
            next_at = time.time() + self.settings.webhook_backoff_seconds * 2 ** (done - 1)
        with self.sessions.begin() as session:
            session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == delivery_id)
                .values(
                    status=status,
                    last_status_code=code,
                    last_error=error,
                    next_attempt_at=next_at,
                    updated_at=datetime.now(UTC),
                )
                .execution_options(synchronize_session=False)
            )
