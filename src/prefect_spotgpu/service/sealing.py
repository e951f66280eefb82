"""Sealed secrets: a bid's job environment and a tenant's webhook signing secret are encrypted
at rest (Fernet: AES-128-CBC and HMAC-SHA256, from ``cryptography``), with the same key. A job's
environment is opened only to hand it to the agent of the node that holds an active allocation
of that bid; a webhook secret only to sign that tenant's deliveries (``webhooks.WebhookSender``).
Neither is ever returned by a route.

The key comes from ``SPOTGPU_SECRET_KEY`` (a Fernet key: 32 url-safe base64-encoded bytes, as
``spotgpu admin new-secret-key`` prints), else from ``<home>/secret_key``, generated once with
mode 0600 (``at_rest.create_once``). Every replica of a market must share the key; losing it
loses the sealed environments of open bids (their jobs cannot start) and the webhook secrets
(tenants set theirs again), never anything else.

A bid row keeps its job's environment names in the clear (``job.env_names``) and the values
only in ``job_env_sealed``: :func:`seal_job` makes that pair, :func:`job_for_node` opens it for
the node's agent. ``tenants.webhook_secret`` holds ``sealed:`` and a Fernet token, written by
``crud.set_webhook`` through :func:`seal_secret`; a value without the prefix is a plaintext
secret written before sealing existed, which :func:`seal_plaintext_webhook_secrets` seals at
start (migrations have no key), as :func:`seal_plaintext_jobs` does for job environments.

The key is replaced only by ``spotgpu server rotate-key`` (``service/resealing.py``), which
opens every sealed value with the old key and seals it again with the new one; a sealed value
carries no key id (a Fernet token is authenticated: the key that opens it is its key).

Example::

    >>> sealer = Sealer(Fernet.generate_key().decode())
    >>> box = sealer.seal({"AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    >>> "s3cr3t" in box
    False
    >>> sealer.open(box)
    {'AWS_SECRET_ACCESS_KEY': 's3cr3t'}
    >>> stored = seal_secret("a-webhook-secret-of-some-length", sealer)
    >>> stored.startswith(SEALED), open_secret(stored, sealer)
    (True, 'a-webhook-secret-of-some-length')
"""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from prefect_spotgpu.service.at_rest import create_once
from prefect_spotgpu.service.models import BidRow, Tenant

SEALED = "sealed:"
"""How a sealed webhook secret begins (a Fernet token follows). ``crud.set_webhook`` seals every
secret, so a value without it is one an older version stored in the clear."""


class SealError(RuntimeError):
    """A sealed value that this key cannot open (another market's key, or tampered)."""


class Sealer:
    def __init__(self, key: str) -> None:
        try:
            self._fernet = Fernet(key.encode() if isinstance(key, str) else key)
        except (ValueError, TypeError) as exc:
            raise ValueError(
                "the secret key must be a Fernet key (32 url-safe base64-encoded bytes)"
            ) from exc

    def seal(self, env: dict[str, str]) -> str:
        return self.seal_text(json.dumps(env, sort_keys=True))

    def open(self, sealed: str) -> dict[str, str]:
        return json.loads(self.open_text(sealed))

    def seal_text(self, text: str) -> str:
        return self._fernet.encrypt(text.encode()).decode()

    def open_text(self, sealed: str) -> str:
        try:
            return self._fernet.decrypt(sealed.encode()).decode()
        except InvalidToken:
            raise SealError("a sealed value does not open with this key") from None


def new_key() -> str:
    return Fernet.generate_key().decode()


def key_from_home(home: Path) -> str:
    """The key in ``<home>/secret_key``, created (mode 0600, in a home of mode 0700) on first
    use, atomically: a replica starting beside us never reads half a key."""
    return create_once(home / "secret_key", new_key)


def seal_job(job: dict, sealer: Sealer) -> tuple[dict, str | None]:
    """A job as a bid row keeps it: without its ``env``, with the names of its variables
    (``env_names``); and the environment sealed (None when it has none)."""
    job = dict(job)
    env = job.pop("env", None) or {}
    return {**job, "env_names": sorted(env)}, sealer.seal(env) if env else None


def job_for_node(*, bid: BidRow, sealer: Sealer) -> dict | None:
    """The bid's job with its environment opened: only for the agent of a node that holds
    an active allocation of the bid (the caller checks that)."""
    if bid.job is None:
        return None
    job = {k: v for k, v in bid.job.items() if k != "env_names"}
    if bid.job_env_sealed:
        job["env"] = sealer.open(bid.job_env_sealed)
    else:  # written in the clear by a replica that predates sealing (until it is sealed)
        job["env"] = dict(bid.job.get("env") or {})
    return job


def seal_plaintext_jobs(*, session: Session, sealer: Sealer) -> int:
    """Seal the job environments written in the clear before sealing existed (once, at
    start); how many bids were sealed."""
    sealed = 0
    unsealed = select(BidRow).where(BidRow.job.is_not(None), BidRow.job_env_sealed.is_(None))
    for bid in session.scalars(unsealed.execution_options(yield_per=1000)):
        if "env" in (bid.job or {}):
            bid.job, bid.job_env_sealed = seal_job(bid.job, sealer)
            sealed += 1
    return sealed


def _is_sealed():
    """SQL: the row's webhook secret is sealed (a case-sensitive prefix test, unlike LIKE on
    SQLite)."""
    return func.substr(Tenant.webhook_secret, 1, len(SEALED)) == SEALED


def seal_secret(secret: str, sealer: Sealer) -> str:
    """A webhook secret as ``tenants.webhook_secret`` keeps it."""
    return SEALED + sealer.seal_text(secret)


def open_secret(stored: str, sealer: Sealer) -> str:
    """The webhook secret that ``stored`` keeps, to sign with (SealError: another key's)."""
    if stored.startswith(SEALED):
        return sealer.open_text(stored.removeprefix(SEALED))
    return stored  # written in the clear by a replica that predates sealing (until sealed)


def seal_plaintext_webhook_secrets(*, session: Session, sealer: Sealer) -> int:
    """Seal the webhook secrets written in the clear before sealing existed (once, at start;
    a sealed one is left as it is); how many were sealed."""
    sealed = 0
    plain = select(Tenant).where(Tenant.webhook_secret.is_not(None), ~_is_sealed())
    for tenant in session.scalars(plain.execution_options(yield_per=1000)):
        tenant.webhook_secret = seal_secret(tenant.webhook_secret, sealer)
        sealed += 1
    return sealed


def check_sealing_key(*, session: Session, sealer: Sealer) -> None:
    """Refuse a key that cannot open what this market has sealed: a replica started with a
    home of its own, hence a key of its own, beside replicas that share one; or a database
    half-way through ``spotgpu server rotate-key``, which re-seals in id order (so the oldest
    and the newest value of a column are opened: until it finishes, no one key opens both)."""
    for order in (BidRow.id.desc(), BidRow.id.asc()):
        sample = session.scalar(
            select(BidRow.job_env_sealed)
            .where(BidRow.job_env_sealed.is_not(None))
            .order_by(order)
            .limit(1)
        )
        if sample is not None:
            sealer.open(sample)  # SealError: the wrong key
    for order in (Tenant.id.desc(), Tenant.id.asc()):
        secret = session.scalar(
            select(Tenant.webhook_secret).where(_is_sealed()).order_by(order).limit(1)
        )
        if secret is not None:
            open_secret(secret, sealer)
