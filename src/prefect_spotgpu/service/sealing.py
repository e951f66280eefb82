"""Sealed job secrets: a bid's job environment is encrypted at rest (Fernet: AES-128-CBC and
HMAC-SHA256, from ``cryptography``), and opened only to hand it to the agent of the node that
holds an active allocation of that bid.

The key comes from ``SPOTGPU_SECRET_KEY`` (a Fernet key: 32 url-safe base64-encoded bytes, as
``spotgpu admin new-secret-key`` prints), else from ``<home>/secret_key``, generated once with
mode 0600. Every replica of a market must share the key; losing it loses the sealed
environments of open bids (their jobs cannot start), never anything else.

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
