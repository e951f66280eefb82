"""Webhook signatures are Standard Webhooks signatures: what the market signs, the
``standardwebhooks`` package (PyPI) verifies, and the other way round; old and future
timestamps are refused."""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from prefect_spotgpu.service.webhooks import (
    check_secret,
    sign,
    signature_headers,
    signing_key,
    standard_secret,
    verify,
)

PLAIN = "a-webhook-secret-of-some-length"
WHSEC = "whsec_" + base64.b64encode(bytes(range(32))).decode()
BODY = b'{"allocation_id":7,"event":"noticed"}'


@pytest.mark.parametrize("secret", [PLAIN, WHSEC])
def test_the_package_verifies_what_the_market_signs(secret):
    now = int(time.time())
    headers = signature_headers(secret, "42", now, BODY)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(standard_secret(secret)).verify(BODY, headers) == {
        "allocation_id": 7,
        "event": "noticed",
    }
    assert verify(secret, headers, BODY)


@pytest.mark.parametrize("secret", [PLAIN, WHSEC])
def test_the_market_verifies_what_the_package_signs(secret):
    now = datetime.now(UTC)
    signature = Webhook(standard_secret(secret)).sign("msg_1", now, BODY.decode())
    headers = {
        "Webhook-Id": "msg_1",  # header names in any case
        "Webhook-Timestamp": str(int(now.timestamp())),
        "Webhook-Signature": f"v1,bm90LXRoaXMtb25l {signature}",  # several: any one matches
    }
    assert verify(secret, headers, BODY)


def test_a_plain_secret_is_its_utf8_bytes_in_base64_after_whsec():
    assert signing_key(PLAIN) == PLAIN.encode()
    assert standard_secret(PLAIN) == "whsec_" + base64.b64encode(PLAIN.encode()).decode()
    assert standard_secret(WHSEC) == WHSEC and signing_key(WHSEC) == bytes(range(32))
    # a library given the bare base64 (no prefix) agrees
    headers = signature_headers(PLAIN, "1", int(time.time()), BODY)
    Webhook(base64.b64encode(PLAIN.encode()).decode()).verify(BODY, headers)


def test_old_and_future_timestamps_are_refused():
    year_ago = int(time.time()) - 365 * 86400
    old = signature_headers(PLAIN, "42", year_ago, BODY)
    assert not verify(PLAIN, old, BODY)
    assert verify(PLAIN, old, BODY, now=year_ago + 10)  # the signature itself is right
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(standard_secret(PLAIN)).verify(BODY, old)
    now = time.time()
    assert not verify(PLAIN, signature_headers(PLAIN, "42", int(now) + 301, BODY), BODY, now=now)
    assert verify(PLAIN, signature_headers(PLAIN, "42", int(now) - 299, BODY), BODY, now=now)
    assert not verify(
        PLAIN, signature_headers(PLAIN, "42", int(now) - 61, BODY), BODY, now=now, tolerance=60
    )


def test_anything_else_is_refused():
    now = int(time.time())
    good = signature_headers(PLAIN, "42", now, BODY)
    assert not verify("another-secret-value", good, BODY)
    assert not verify(PLAIN, good, BODY + b" ")
    assert not verify(PLAIN, {**good, "webhook-id": "43"}, BODY)  # the id is signed
    assert not verify(PLAIN, {**good, "webhook-timestamp": str(now + 1)}, BODY)
    fullwidth = "\uff11\uff12\uff13"  # digits, but not ASCII ones
    assert not verify(PLAIN, {**good, "webhook-timestamp": fullwidth}, BODY)
    assert not verify(PLAIN, {**good, "webhook-signature": "v1,ünicode"}, BODY)
    for missing in good:
        assert not verify(PLAIN, {k: v for k, v in good.items() if k != missing}, BODY)
    assert sign(PLAIN, "42", now, BODY) == good["webhook-signature"]


@pytest.mark.parametrize(
    ("secret", "ok"),
    [
        (PLAIN, True),
        (WHSEC, True),
        ("x" * 15, False),
        ("x" * 201, False),
        ("whsec_" + base64.b64encode(b"k" * 23).decode(), False),  # too short a key
        ("whsec_" + base64.b64encode(b"k" * 65).decode(), False),  # too long a key
        ("whsec_not/base64!!", False),
    ],
)
def test_secrets_are_checked(secret, ok):
    if ok:
        assert check_secret(secret) == secret
    else:
        with pytest.raises(ValueError):
            check_secret(secret)
