"""Service settings, from ``SPOTGPU_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path.home() / ".spotgpu"


class ServiceSettings(BaseSettings):
    """How the market service runs. Every field can be set as ``SPOTGPU_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="SPOTGPU_", extra="ignore")

    home: Path = Field(default_factory=default_home, description="State directory.")
    db_url: str | None = Field(
        None,
        description="SQLAlchemy URL; default: a SQLite file in the state directory. "
        "PostgreSQL: postgresql+psycopg://user@host/db",
    )
    host: str = "127.0.0.1"
    port: int = Field(4300, ge=1, le=65535)
    admin_key: SecretStr | None = Field(
        None, description="Admin API key; default: generated once into <home>/admin_key."
    )
    secret_key: SecretStr | None = Field(
        None,
        description="Fernet key that seals bids' job environments at rest; default: "
        "generated once into <home>/secret_key (mode 0600). Replicas must share it.",
    )
    tick_seconds: float = Field(1.0, gt=0, le=60)
    starting_credit: float = Field(10.0, ge=0)
    notice_seconds: float = Field(300.0, gt=0)
    hysteresis: float = Field(0.05, ge=0, lt=10)
    heartbeat_timeout_seconds: float = Field(30.0, gt=0)
    charge_flush_seconds: float = Field(
        5.0, gt=0, description="How often running charges are written to the ledger."
    )
    webhook_max_attempts: int = Field(6, ge=1, le=20)
    webhook_backoff_seconds: float = Field(1.0, gt=0)
    webhook_timeout_seconds: float = Field(
        5.0,
        gt=0,
        le=60,
        description="One delivery attempt's deadline, all of it: DNS, connect, TLS, sending "
        "and the answer's status.",
    )
    webhook_workers: int = Field(
        8, ge=1, le=256, description="Deliveries in flight at once (one per tenant at a time)."
    )
    webhook_allow_private: bool = Field(
        False,
        description="Let webhooks reach loopback, private and link-local addresses (local "
        "stacks and tests); otherwise only public destinations are accepted and reached.",
    )
    run_ticker: bool = Field(True, description="Run the tick loop (one leader among replicas).")
    public_cache_seconds: float = Field(
        1.0,
        ge=0,
        le=60,
        description="How long an anonymous market view (nodes, prices, depth, history, "
        "forecast) is answered from memory, unless this replica's tick changes the market "
        "first; 0: never (service/public_cache.py).",
    )

    @field_validator("db_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        """``postgresql://`` and ``postgres://`` (no driver named) mean psycopg 3, the driver
        installed with the service (SQLAlchemy alone would pick psycopg2, which is not)."""
        if value is None:
            return value
        for plain in ("postgresql://", "postgres://"):
            if value.startswith(plain):
                return "postgresql+psycopg://" + value.removeprefix(plain)
        if not value.startswith(("sqlite", "postgresql+psycopg")):
            raise ValueError("db_url must be a sqlite:// or postgresql+psycopg:// URL")
        return value

    def database_url(self) -> str:
        if self.db_url:
            return self.db_url
        self.home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.home / 'market.db'}"

    def resolved_admin_key(self) -> str:
        """The admin key: from the environment, else the key file (created on first use)."""
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        path = self.home / "admin_key"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text("sgadm_" + secrets.token_urlsafe(24) + "\n")
        return path.read_text().strip()

    def resolved_secret_key(self) -> str:
        """The key that seals job environments: from the environment, else the key file."""
        from prefect_spotgpu.service.sealing import key_from_home

        if self.secret_key is not None:
            return self.secret_key.get_secret_value()
        return key_from_home(self.home)
