"""Webhook deliveries: signed JSON POSTs to public destinations, retried with exponential backoff.

Deliveries are rows the tick writes in the same transaction as their event (an outbox,
``tick_writes.TickWrites.flush_events``); ``WebhookSender`` is their only sender. Its
dispatcher hands each of ``webhook_workers`` workers one tenant's due deliveries, never two
workers the same tenant, so a tenant's deliveries go out one at a time in event order, and a
slow or hanging receiver holds one worker, for one attempt's deadline
(``webhook_timeout_seconds``: DNS, connect, TLS, sending and the answer's status line together)
per attempt, and delays no other tenant. Every attempt is claimed with a compare-and-set on
``attempts`` (two replicas never send the same attempt twice); its outcome, a status code or an
error class and never what the destination answered, is written on the row the tenant reads.

**Signatures** follow the Standard Webhooks specification (https://www.standardwebhooks.com):
``webhook-id`` (the delivery id, the same on every retry), ``webhook-timestamp`` (unix seconds of
this attempt) and ``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``.
The HMAC key is the base64 after ``whsec_`` for a ``whsec_...`` secret, and the UTF-8 bytes of
any other secret, whose Standard Webhooks form is therefore ``"whsec_" + base64(secret)``
(:func:`standard_secret`). :func:`verify` refuses timestamps outside a replay window. A tenant's
secret is kept sealed (service/sealing.py); the sender opens it for each attempt, and nothing
else here keeps or logs it.

**Destinations** must be public: a URL whose host resolves to a loopback, private, link-local,
multicast, reserved or unspecified address (IPv4 or IPv6, IPv4 inside IPv6 included) is refused
at registration (:func:`check_destination`) and again at every attempt, which resolves the
host once, checks every address and connects to a checked one, sending the original ``Host``
and TLS server name (so a name rebound to an internal address after registration gets
nowhere). ``webhook_allow_private`` lifts this for local stacks and tests.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpcore
import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.protocol import DeliveryStatus
from prefect_spotgpu.service import gate
from prefect_spotgpu.service.metrics import ServiceMetrics
from prefect_spotgpu.service.models import EventRow, Tenant, WebhookDelivery
from prefect_spotgpu.service.sealing import Sealer, open_secret
from prefect_spotgpu.service.settings import ServiceSettings

logger = logging.getLogger("prefect_spotgpu.service.webhooks")

SECRET_PREFIX = "whsec_"
REPLAY_WINDOW_SECONDS = 300.0
USER_AGENT = "prefect-spotgpu-webhooks"
TURN_SECONDS = 1.0  # a tenant's turn on a worker: then tenants waiting longer go first

Resolver = Callable[..., list]  # socket.getaddrinfo's shape: (host, port, type=...) -> infos

# ---------------------------------------------------------------- signatures


def signing_key(secret: str) -> bytes:
    """The HMAC key of a webhook secret: the base64 after ``whsec_``, else the UTF-8 bytes."""
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    return secret.encode()


def standard_secret(secret: str) -> str:
    """The secret as a Standard Webhooks library takes it: ``whsec_<base64 of the key>``.

    >>> standard_secret("a-webhook-secret-of-some-length")
    'whsec_YS13ZWJob29rLXNlY3JldC1vZi1zb21lLWxlbmd0aA=='
    """
    if secret.startswith(SECRET_PREFIX):
        return secret
    return SECRET_PREFIX + base64.b64encode(secret.encode()).decode()


def check_secret(secret: str) -> str:
    """A tenant's secret: ``whsec_`` and the base64 of 24 to 64 bytes, or 16 to 200 characters
    of anything else (the key is then its UTF-8 bytes). Raises ``ValueError``."""
    if secret.startswith(SECRET_PREFIX):
        try:
            key = signing_key(secret)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret must be base64 after the prefix") from None
        if not 24 <= len(key) <= 64:
            raise ValueError("a whsec_ secret must encode 24 to 64 bytes")
    elif not 16 <= len(secret) <= 200:
        raise ValueError("a secret must be 16 to 200 characters (or whsec_ and base64)")
    return secret


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "{msg_id}.{timestamp}.{body}">``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(signing_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float | None = None,
    tolerance: float = REPLAY_WINDOW_SECONDS,
) -> bool:
    """Whether ``body`` and its ``webhook-*`` headers were signed with ``secret`` within
    ``tolerance`` seconds of ``now`` (either side: old deliveries are replays, future ones
    forged clocks). Header names are matched case-insensitively."""
    lowered = {k.lower(): v for k, v in headers.items()}
    msg_id = lowered.get("webhook-id")
    stamp = lowered.get("webhook-timestamp", "")
    signatures = lowered.get("webhook-signature")
    if not (msg_id and signatures and stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
        return False
    if abs((time.time() if now is None else now) - int(stamp)) > tolerance:
        return False
    expected = sign(secret, msg_id, int(stamp), body).encode()
    return any(hmac.compare_digest(expected, s.encode()) for s in signatures.split())


# ---------------------------------------------------------------- destinations

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NOT_GLOBAL_V4 = (ipaddress.ip_network("192.0.0.0/24"),)  # Python 3.11 calls part of it global


class DestinationRefused(httpcore.ConnectError):
    """A webhook destination this market does not send to (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether webhooks may connect to ``ip``: globally routable, and not loopback, private,
    link-local, multicast, reserved or unspecified; an IPv4 address inside an IPv6 one
    (mapped, 6to4, NAT64) is judged as itself."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public_address(ip.ipv4_mapped)
        embedded = ip.sixtofour or (
            ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None
        )
        if embedded is not None and not is_public_address(embedded):
            return False
    elif any(ip in net for net in _NOT_GLOBAL_V4):
        return False
    return ip.is_global and not (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _getaddrinfo(host: str, port: int, timeout: float, resolve: Resolver) -> list[str]:
    """``host``'s addresses, resolved on a helper thread so a stuck resolver costs at most
    ``timeout`` (the thread ends when the resolver gives up)."""
    try:
        return [str(ipaddress.ip_address(host))]  # a literal: nothing to resolve
    except ValueError:
        pass
    answer: dict = {}

    def lookup() -> None:
        try:
            answer["infos"] = resolve(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            answer["error"] = exc

    thread = threading.Thread(target=lookup, name="spotgpu-webhook-dns", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if thread.is_alive():
        raise httpcore.ConnectTimeout(f"resolving {host} took over {timeout:.1f}s")
    if "error" in answer:
        raise httpcore.ConnectError(f"{host} does not resolve")
    return list(dict.fromkeys(info[4][0] for info in answer["infos"]))


def resolve_destination(
    host: str,
    port: int,
    *,
    allow_private: bool,
    timeout: float,
    resolve: Resolver = socket.getaddrinfo,
) -> list[str]:
    """The addresses ``host`` resolves to, once, each checked: ``DestinationRefused`` when
    any is not public (unless ``allow_private``). Connect only to what this returns."""
    addresses = _getaddrinfo(host, port, timeout, resolve)
    if not addresses:
        raise httpcore.ConnectError(f"{host} does not resolve")
    if not allow_private:
        for address in addresses:
            if not is_public_address(ipaddress.ip_address(address.split("%")[0])):
                raise DestinationRefused("private address")
    return addresses


def check_destination(
    url: str,
    *,
    allow_private: bool,
    timeout: float = 3.0,
    resolve: Resolver = socket.getaddrinfo,
) -> None:
    """Registration's check of a webhook URL: http(s), and a host that resolves to public
    addresses only. Raises ``DestinationRefused`` (or ``httpcore.ConnectError`` when the
    host does not resolve)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DestinationRefused("not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    resolve_destination(
        parts.hostname, port, allow_private=allow_private, timeout=timeout, resolve=resolve
    )


# ---------------------------------------------------------------- one attempt


def _time_left(deadline: float, error: type[httpcore.TimeoutException]) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the attempt's deadline passed")
    return left


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read, write and handshake gets only what is left of the
    attempt's deadline, so the attempt as a whole is bounded, not each phase."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _time_left(self._deadline, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), 65536):
            chunk = buffer[start : start + 65536]
            self._stream.write(chunk, _time_left(self._deadline, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _time_left(self._deadline, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self._stream.start_tls(ssl_context, server_hostname, left), self._deadline
        )

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _PinnedBackend(httpcore.NetworkBackend):
    """Resolves the URL's host once, checks every address, and connects to a checked one;
    httpcore still sends the URL's host as ``Host`` and as the TLS server name (whose
    certificate is verified against it)."""

    def __init__(self, *, deadline: float, allow_private: bool, resolve: Resolver) -> None:
        self._deadline = deadline
        self._allow_private = allow_private
        self._resolve = resolve
        self._tcp = httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        def left() -> float:
            return _time_left(self._deadline, httpcore.ConnectTimeout)

        addresses = resolve_destination(
            host, port, allow_private=self._allow_private, timeout=left(), resolve=self._resolve
        )
        for address in addresses:
            try:
                stream = self._tcp.connect_tcp(address, port, left(), None, socket_options)
            except httpcore.ConnectError as exc:
                error = exc  # try the next address; raised when none connects
                continue
            return _DeadlineStream(stream, self._deadline)
        raise error

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise DestinationRefused("not a network address")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    timeout: float,
    allow_private: bool,
    ssl_context: ssl.SSLContext,
    resolve: Resolver = socket.getaddrinfo,
) -> int:
    """POST ``body`` to ``url`` once, within ``timeout`` seconds in all, and return the status
    code; the response body is never read. Raises ``DestinationRefused`` or another
    ``httpcore`` error. No redirects are followed."""
    deadline = time.monotonic() + timeout
    backend = _PinnedBackend(deadline=deadline, allow_private=allow_private, resolve=resolve)
    phases = dict.fromkeys(("connect", "read", "write", "pool"), timeout)
    with httpcore.ConnectionPool(ssl_context=ssl_context, network_backend=backend) as pool:
        extensions = {"timeout": phases}
        with pool.stream(
            "POST", url, headers=list(headers.items()), content=body, extensions=extensions
        ) as response:
            return response.status


_HTTP = httpcore.ProtocolError | httpcore.UnsupportedProtocol  # the destination's doing


def outcome_error(exc: Exception) -> str:
    """What an attempt's failure shows the tenant: a refusal's reason, else the error's class
    (never its message, which may quote what the destination said)."""
    if isinstance(exc, DestinationRefused):
        return f"refused: {exc.reason}"
    return type(exc).__name__


# ---------------------------------------------------------------- the sender


class WebhookSender:
    """Sends due deliveries: a dispatcher loop (``run``) and ``webhook_workers`` workers."""

    def __init__(
        self,
        settings: ServiceSettings,
        sessions: sessionmaker[Session],
        metrics: ServiceMetrics | None = None,
        *,
        resolve: Resolver = socket.getaddrinfo,
        reads: sessionmaker[Session] | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self.settings = settings
        self._sealer = sealer  # opens tenants' sealed secrets to sign (default: the settings')
        self.sessions = sessions
        self.reads = reads or sessions  # the poll is a read: never SQLite's write lock
        self.metrics = metrics or ServiceMetrics()
        self.resolve = resolve
        self.ssl_context = httpx.create_ssl_context()
        self._busy: set[int] = set()  # tenants with an attempt in flight from this replica
        self._turns: dict[int, float] = {}  # when each tenant's last turn on a worker ended
        self._lock = threading.Lock()
        self._wake = threading.Event()  # an attempt finished: its tenant may have more

    @property
    def sealer(self) -> Sealer:
        if self._sealer is None:
            self._sealer = Sealer(self.settings.resolved_secret_key())
        return self._sealer

    def run(self, stop: threading.Event) -> None:
        workers = self.settings.webhook_workers
        with ThreadPoolExecutor(workers, thread_name_prefix="spotgpu-webhook") as pool:
            while not stop.is_set():
                self._wake.clear()
                try:
                    started = self.dispatch(pool, workers, time.time())
                except Exception:
                    logger.exception("webhook dispatcher failed; retrying")
                    started = 0
                if not started:
                    self._wake.wait(0.25)

    def dispatch(self, pool: ThreadPoolExecutor, workers: int, now: float) -> int:
        """Hand each idle worker the due deliveries of one idle tenant (see :meth:`due`).
        Returns how many tenants' batches started."""
        with self._lock:
            busy = set(self._busy)
        if len(busy) >= workers:
            return 0
        batches = self.due(now, busy=busy, tenants=workers - len(busy))
        for tenant_id, batch in batches.items():
            with self._lock:
                self._busy.add(tenant_id)
            future = pool.submit(self.send, batch)
            future.add_done_callback(lambda f, tenant_id=tenant_id: self._finished(f, tenant_id))
        return len(batches)

    def due(
        self, now: float, *, busy: set[int], tenants: int, scan: int = 500
    ) -> dict[int, list[tuple[int, int]]]:
        """``{tenant id: [(delivery id, attempts), ...]}``: among the ``scan`` longest-waiting
        due deliveries of tenants outside ``busy``, those of up to ``tenants`` tenants, each
        tenant's in id (event) order. One range scan of the ``next_attempt_at`` index."""
        with self.reads.begin() as session:
            rows = session.execute(
                select(WebhookDelivery.id, WebhookDelivery.tenant_id, WebhookDelivery.attempts)
                .where(
                    WebhookDelivery.status == DeliveryStatus.PENDING.value,
                    WebhookDelivery.next_attempt_at <= now,
                    WebhookDelivery.tenant_id.not_in(busy),
                )
                .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                .limit(scan)
            ).all()
        batches: dict[int, list[tuple[int, int]]] = {}
        for delivery_id, tenant_id, attempts in rows:
            batches.setdefault(tenant_id, []).append((delivery_id, attempts))
        with self._lock:  # whose turn was longest ago (never: first); then whose rows are oldest
            chosen = sorted(batches, key=lambda tenant_id: self._turns.get(tenant_id, 0.0))
        return {tenant_id: sorted(batches[tenant_id]) for tenant_id in chosen[:tenants]}

    def send(self, batch: list[tuple[int, int]]) -> None:
        """One tenant's deliveries, in order, one at a time, until the batch or the tenant's
        turn (``TURN_SECONDS``) ends; what is left waits for its next turn."""
        turn_ends = time.monotonic() + TURN_SECONDS
        for delivery_id, attempts in batch:
            self.attempt(delivery_id, attempts)
            if time.monotonic() >= turn_ends:
                return

    def _finished(self, future: Future, tenant_id: int) -> None:
        with self._lock:
            self._busy.discard(tenant_id)
            self._turns[tenant_id] = time.monotonic()
        self._wake.set()
        if future.exception() is not None:
            logger.error("webhook delivery failed", exc_info=future.exception())

    def attempt(self, delivery_id: int, attempts: int) -> None:
        """One attempt of one delivery: claim it, POST it, write the outcome."""
        now = time.time()
        lease = now + max(30.0, 2 * self.settings.webhook_timeout_seconds)
        with self.sessions.begin() as session:  # claim this attempt (compare-and-set)
            claimed = session.execute(
                update(WebhookDelivery)
                .where(
                    WebhookDelivery.id == delivery_id,
                    WebhookDelivery.status == DeliveryStatus.PENDING.value,
                    WebhookDelivery.attempts == attempts,
                )
                .values(attempts=attempts + 1, next_attempt_at=lease)
                .execution_options(synchronize_session=False)
            ).rowcount
            if claimed != 1:
                return
            delivery = session.get(WebhookDelivery, delivery_id)
            event = session.get(EventRow, delivery.event_id)
            tenant = session.get(Tenant, delivery.tenant_id)
            url, sealed, payload = delivery.url, tenant.webhook_secret, event.payload
            event_kind, event_id = event.kind, event.id
        body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        code, error = None, None
        try:
            if not sealed:
                raise DestinationRefused("no secret to sign with")
            secret = open_secret(sealed, self.sealer)
            headers = {
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
                "X-SpotGPU-Event": event_kind,
                "X-SpotGPU-Event-Id": str(event_id),
                **signature_headers(secret, str(delivery_id), int(time.time()), body),
            }
            code = post(
                url,
                body,
                headers,
                timeout=self.settings.webhook_timeout_seconds,
                allow_private=self.settings.webhook_allow_private,
                ssl_context=self.ssl_context,
                resolve=self.resolve,
            )
            ok = 200 <= code < 300
            if not ok:
                error = f"HTTP {code}"
        except Exception as exc:  # any failure is this attempt's outcome, never the worker's
            ok, error = False, outcome_error(exc)
            if not isinstance(exc, httpcore.NetworkError | httpcore.TimeoutException | _HTTP):
                logger.exception("webhook delivery %s failed unexpectedly", delivery_id)
        self._record(delivery_id, attempts + 1, ok, code, error)

    def _record(self, delivery_id: int, done: int, ok: bool, code, error) -> None:
        self.metrics.observe_delivery(ok)
        now = time.time()
        if ok:
            status, next_at = DeliveryStatus.DELIVERED, now
        elif done >= self.settings.webhook_max_attempts:
            status, next_at = DeliveryStatus.FAILED, now
        else:
            status = DeliveryStatus.PENDING
            next_at = now + self.settings.webhook_backoff_seconds * 2 ** (done - 1)
        with self.sessions.begin() as session:
            recorded = gate.set_delivery_status(
                session=session,
                delivery_id=delivery_id,
                attempts=done,
                to=status,
                last_status_code=code,
                last_error=error,
                next_attempt_at=next_at,
                updated_at=datetime.now(UTC),
            )
        if not recorded:  # (its lease ran out and another attempt claimed it: that one records)
            logger.warning("webhook delivery %s: attempt %s was overtaken", delivery_id, done)
