"""Webhooks go only to public destinations: refused at registration (a 422 naming ``url``) and
again at every delivery, which connects to the address it checked; what a destination
answers is never stored, only its status code."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import pytest
import sqlalchemy as sa

from prefect_spotgpu.service.models import Tenant, WebhookDelivery
from prefect_spotgpu.service.webhooks import (
    DestinationRefused,
    check_destination,
    is_public_address,
    post,
)
from test_service_webhooks import SECRET, Receiver

PUBLIC = "93.184.215.14"  # never contacted: no event is sent there


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # carrier-grade NAT
        "192.0.0.8",
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "::",
        "::1",
        "fe80::1",
        "fc00::1",
        "ff02::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "2001:db8::1",
    ],
)
def test_internal_addresses_are_not_public(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are(address):
    assert is_public_address(ipaddress.ip_address(address))


def _resolver(*answers: str):
    """A resolver (socket.getaddrinfo's shape) answering ``answers[i]`` on its i-th call."""
    calls: list[str] = []

    def resolve(host, port, type=0):
        address = answers[min(len(calls), len(answers) - 1)]
        calls.append(host)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]

    resolve.calls = calls
    return resolve


def _post(url, *, allow_private, resolve, ssl_context=None):
    return post(
        url,
        b"{}",
        {"Content-Type": "application/json"},
        timeout=5.0,
        allow_private=allow_private,
        ssl_context=ssl_context or ssl.create_default_context(),
        resolve=resolve,
    )


def test_a_delivery_connects_to_the_address_it_checked_with_the_original_host():
    receiver = Receiver(failures=0)
    try:
        port = receiver.server.server_address[1]
        url = f"http://hooks.example.test:{port}/hook"
        resolve = _resolver("127.0.0.1")
        assert _post(url, allow_private=True, resolve=resolve) == 204
        assert resolve.calls == ["hooks.example.test"]  # resolved once, then that address
        assert receiver.received[0]["headers"]["Host"] == f"hooks.example.test:{port}"

        with pytest.raises(DestinationRefused, match="private address"):
            _post(url, allow_private=False, resolve=_resolver("127.0.0.1"))
        # a name that answers a public address to the check and a private one after it
        rebinding = _resolver(PUBLIC, "127.0.0.1")
        check_destination(url, allow_private=False, resolve=rebinding)
        with pytest.raises(DestinationRefused):
            _post(url, allow_private=False, resolve=rebinding)

        # one private address among public ones is enough to refuse
        def mixed(host, port, type=0):
            return [
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC, port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port)),
            ]

        with pytest.raises(DestinationRefused):
            check_destination(url, allow_private=False, resolve=mixed)
        assert len(receiver.received) == 1
    finally:
        receiver.close()


def _certificate(tmp_path, host: str) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def test_https_to_a_pinned_address_sends_the_name_and_verifies_its_certificate(tmp_path):
    host = "hooks.example.test"
    certfile, keyfile = _certificate(tmp_path, host)
    server_names: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(certfile, keyfile)
    tls.sni_callback = lambda _sock, name, _ctx: server_names.append(name)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        trusting = ssl.create_default_context(cafile=certfile)
        url = f"https://{host}:{port}/hook"
        assert _post(url, allow_private=True, resolve=_resolver("127.0.0.1"), ssl_context=trusting)
        assert server_names == [host]
        # the same address under another name: its certificate does not match
        with pytest.raises(httpcore.ConnectError):
            _post(
                f"https://other.example.test:{port}/hook",
                allow_private=True,
                resolve=_resolver("127.0.0.1"),
                ssl_context=trusting,
            )
    finally:
        server.shutdown()


REFUSED_URLS = [
    "http://127.0.0.1:8080/hook",
    "http://localhost/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.0.0.5/",
    "http://172.16.0.1/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://0.0.0.0/",
    "http://224.0.0.1/",
    "http://2130706433/",  # 127.0.0.1, in decimal
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:a9fe:a9fe]/",  # 169.254.169.254, IPv4-mapped
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://[2002:7f00:1::1]/",
    "http://does-not-exist.invalid/",
]


def test_registration_refuses_internal_destinations_by_default(db_url, tmp_path):
    from conftest import start_service

    svc = start_service(db_url, tmp_path / "home", webhook_allow_private=False)
    try:
        alice = svc.tenant()
        for url in REFUSED_URLS:
            response = alice.put("/webhook", json={"url": url, "secret": SECRET})
            assert response.status_code == 422, (url, response.text)
            assert response.json()["field"] == "url", url
        assert alice.get("/webhook").json() == {"url": None, "has_secret": False}
        for url in (f"http://{PUBLIC}/hook", "https://[2606:4700:4700::1111]/hook"):
            response = alice.put("/webhook", json={"url": url, "secret": SECRET})
            assert response.status_code == 200, (url, response.text)
    finally:
        svc.stop()


def test_a_delivery_to_an_address_that_turned_internal_is_refused(db_url, tmp_path):
    """As when a name passes the registration check and is then pointed at a private
    address: the delivery checks the address it connects to."""
    from conftest import start_service

    receiver = Receiver(failures=0)
    svc = start_service(db_url, tmp_path / "home", webhook_allow_private=False)
    engine = sa.create_engine(db_url)
    try:
        alice, owner = svc.tenant(), svc.tenant()
        put = alice.put("/webhook", json={"url": f"http://{PUBLIC}/hook", "secret": SECRET})
        assert put.status_code == 200
        with engine.begin() as connection:  # the name now answers the receiver's address
            connection.execute(
                sa.update(Tenant)
                .where(Tenant.id == alice.tenant_id)
                .values(webhook_url=receiver.url)
            )
        svc.node(owner)
        alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
        refused = svc.wait_for(
            lambda: [d for d in alice.get("/webhook/deliveries").json() if d["last_error"]],
            timeout=15,
        )[0]
        assert refused["url"] == receiver.url
        assert refused["last_error"] == "refused: private address"
        assert refused["last_status_code"] is None
        assert receiver.received == []
    finally:
        engine.dispose()
        svc.stop()
        receiver.close()


def test_only_the_status_code_of_an_answer_is_kept(service, db_url):
    leak = b"root:x:0:0:root:/root:/bin/bash internal-only"
    receiver = Receiver(failures=100, failure_body=leak)
    engine = sa.create_engine(db_url)
    try:
        alice, owner = service.tenant(), service.tenant()
        alice.put("/webhook", json={"url": receiver.url, "secret": SECRET})
        service.node(owner)
        alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
        failed = service.wait_for(
            lambda: [d for d in alice.get("/webhook/deliveries").json() if d["last_error"]],
            timeout=15,
        )[0]
        assert failed["last_status_code"] == 500 and failed["last_error"] == "HTTP 500"
        # rows written before bodies stopped being kept show only their status
        with engine.begin() as connection:
            connection.execute(
                sa.update(WebhookDelivery)
                .where(WebhookDelivery.id == failed["id"])
                .values(last_error="HTTP 500: " + leak.decode())
            )
        log = alice.get("/webhook/deliveries")
        assert log.json()[0]["last_error"] == "HTTP 500"
        assert "root" not in log.text
    finally:
        engine.dispose()
        receiver.close()
