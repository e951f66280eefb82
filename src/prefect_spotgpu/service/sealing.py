"""Sealed job secrets: a bid's job environment is encrypted at rest (Fernet: AES-128-CBC and
HMAC-SHA256, from ``cryptography``), and opened only to hand it to the agent of the node that
holds an active allocation of that bid.

The key comes from ``SPOTGPU_SECRET_KEY`` (a Fernet key: 32 url-safe base64-encoded bytes, as
``spotgpu admin new-secret-key`` prints), else from ``<home>/secret_key``, generated once with
mode 0600. Every replica of a market must share the key; losing it loses the sealed
environments of open bids (their jobs cannot start), never anything else.

A bid row keeps its job's environment names in the clear (``job.env_names``) and the values
only in ``job_env_sealed``: :func:`seal_job` makes that pair, :func:`job_for_node` opens it for
the node's agent.

Example::

    >>> sealer = Sealer(Fernet.generate_key().decode())
    >>> box = sealer.seal({"AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    >>> "s3cr3t" in box
    False
    >>> sealer.open(box)
    {'AWS_SECRET_ACCESS_KEY': 's3cr3t'}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import select
from sqlalchemy.orm import Session

from prefect_spotgpu.service.models import BidRow


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
        return self._fernet.encrypt(json.dumps(env, sort_keys=True).encode()).decode()

    def open(self, sealed: str) -> dict[str, str]:
        try:
            return json.loads(self._fernet.decrypt(sealed.encode()))
        except InvalidToken:
            raise SealError("a sealed job environment does not open with this key") from None


def new_key() -> str:
    return Fernet.generate_key().decode()


def key_from_home(home: Path) -> str:
    """The key in ``<home>/secret_key``, created (mode 0600, never wider) on first use."""
    path = home / "secret_key"
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        tmp = home / f".secret_key.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(new_key() + "\n")
        try:  # atomic and exclusive: a replica starting beside us never reads half a key
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


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


def check_sealing_key(*, session: Session, sealer: Sealer) -> None:
    """Refuse a key that cannot open what this market has sealed (a replica started with a
    home of its own, hence a key of its own, beside replicas that share one)."""
    sample = session.scalar(
        select(BidRow.job_env_sealed)
        .where(BidRow.job_env_sealed.is_not(None))
        .order_by(BidRow.id.desc())
        .limit(1)
    )
    if sample is not None:
        sealer.open(sample)  # SealError: the wrong key
