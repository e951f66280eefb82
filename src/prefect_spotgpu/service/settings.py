"""Service settings, from ``SPOTGPU_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prefect_spotgpu.service.at_rest import create_once, private_dir


class NoAdminKey(Exception):
    """No admin key is set or kept on this host (the message names where to put one)."""


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
        description="Fernet key that seals bids' job environments and webhook secrets at rest; "
        "default: generated once into <home>/secret_key (mode 0600). Replicas must share it.",
    )
    tick_seconds: float = Field(1.0, gt=0, le=60)
    starting_credit: float = Field(10.0, ge=0)
    notice_seconds: float = Field(300.0, gt=0)
    hysteresis: float = Field(0.05, ge=0, lt=10)
    warm_replacement: bool = Field(
        True,
        description="Give a one-node bid's job to the node reserved for its migration at the "
        "notice, so that node starts it at once in a waiting role (its image pulled, the flow "
        "loaded, its set-up done) and it runs the moment the final save is acknowledged. "
        "The reserved node then holds the job's environment from the notice on. Only after a "
        "reclaim or a reserve's notice: an outbid's target gets the job when it runs it.",
    )
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
    migrate_at_start: bool = Field(
        False,
        description="Upgrade an existing database's schema at start (one host only). Off: an "
        "empty database gets its schema, one behind the code is refused and the operator runs "
        "`spotgpu server migrate` once before starting the replicas.",
    )
    public_cache_seconds: float = Field(
        1.0,
        ge=0,
        le=60,
        description="How long an anonymous market view (nodes, prices, depth, history, "
        "forecast) is answered from memory, unless this replica's tick changes the market "
        "first; 0: never (service/public_cache.py).",
    )

    credit_horizon_seconds: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="Credit a new bid reserves: its maximum price x GPUs x this many seconds "
        "must fit the balance beside the tenant's open bids (a buyer must be able to pay for "
        "the notice it will get); default: the notice plus 10 ticks. At least the notice "
        "plus two ticks, the credit kept while bids run.",
    )
    max_open_bids_per_tenant: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="Open or held bid rows a tenant may have at once (a gang counts each "
        "member); more are refused with a 409.",
    )

    def admission_horizon_seconds(self) -> float:
        """Seconds of a bid's maximum price reserved at admission (``credit_horizon_seconds``)."""
        if self.credit_horizon_seconds is not None:
            return self.credit_horizon_seconds
        return self.notice_seconds + 10 * self.tick_seconds

    @model_validator(mode="after")
    def _credit_covers_the_notice(self) -> ServiceSettings:
        least = self.notice_seconds + 2 * self.tick_seconds
        if self.credit_horizon_seconds is not None and self.credit_horizon_seconds < least:
            raise ValueError(
                f"credit_horizon_seconds must be at least the notice plus two ticks ({least} s)"
            )
        return self

    # fair shares (service/fairness.py): beyond these, a 429 with Retry-After
    long_polls_per_caller: int = Field(
        50,
        ge=0,
        le=100_000,
        description="Long-polls (every .../events route) one tenant, or one node agent, may "
        "hold at once (the worker holds one per running flow run, an agent one); 0: no cap.",
    )
    long_polls_per_address: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Long-polls from one client address at once, whatever their keys (raise "
        "it for many agents behind one NAT); 0: no cap.",
    )
    streams_per_address: int = Field(
        8,
        ge=0,
        le=100_000,
        description="Dashboard streams (GET /api/v1/stream) from one client address at once; "
        "0: no cap.",
    )
    anonymous_estimates_per_minute: float = Field(
        12.0,
        ge=0,
        le=60_000,
        description="Estimates (POST /api/v1/estimate), and forecasts fitted afresh for an "
        "anonymous read, one client address may start per minute without a key, after a "
        "burst of anonymous_estimates_burst; 0: no limit.",
    )
    anonymous_estimates_burst: int = Field(
        10, ge=1, le=100_000, description="Estimates an address may start at once, keyless."
    )
    tenant_estimates_per_minute: float = Field(
        120.0,
        ge=0,
        le=60_000,
        description="The same for a tenant's key (or the operator's), after a burst of "
        "tenant_estimates_burst; 0: no limit.",
    )
    tenant_estimates_burst: int = Field(
        60, ge=1, le=100_000, description="Estimates a tenant may start at once."
    )

    # retention (service/retention.py; docs/operators/retention.md): 0 keeps for ever
    retention_events_days: float = Field(
        30.0,
        ge=0,
        description="Days events are kept (long-polls and webhooks read them); 0: for ever. "
        "An event a pending webhook delivery will still send is kept.",
    )
    retention_webhook_deliveries_days: float = Field(
        30.0,
        ge=0,
        description="Days a delivered or failed webhook delivery is kept after its last "
        "attempt; 0: for ever. A pending one is never removed.",
    )
    retention_node_reports_days: float = Field(
        14.0, ge=0, description="Days the audit of node agents' reports is kept; 0: for ever."
    )
    retention_ended_allocations_days: float = Field(
        90.0,
        ge=0,
        description="Days an ended allocation is kept; 0: for ever. Its charges stay in its "
        "tenant's totals (archived_charges); an allocation of a bid or gang still open or "
        "held is kept whatever its age.",
    )
    retention_minute_bars_days: float = Field(
        7.0,
        ge=0,
        description="Days a pool's minute price bars are kept; older ones are folded into "
        "one hourly bar per hour (open, high, low, close), not dropped. 0: minute bars for ever.",
    )
    retention_hourly_bars_days: float = Field(
        0.0,
        ge=0,
        description="Days the hourly price bars folded from minute bars are kept; 0: for ever "
        "(24 rows a pool a day).",
    )
    retention_interval_seconds: float = Field(
        600.0,
        ge=0,
        description="How often the tick leader prunes, on the service's clock (while a "
        "backlog is left: one batch of each kind at every tick); 0: never (only "
        "`spotgpu server prune`).",
    )
    retention_batch_rows: int = Field(
        5000,
        ge=100,
        le=20_000,
        description="Rows one pruning transaction removes at most (short transactions: the "
        "tick's writes never wait long behind them).",
    )

    @model_validator(mode="after")
    def _hourly_bars_outlive_minute_bars(self) -> ServiceSettings:
        minute, hourly = self.retention_minute_bars_days, self.retention_hourly_bars_days
        if 0 < minute < 1 / 24:
            raise ValueError(
                "retention_minute_bars_days must be 0 (for ever) or at least an hour (0.0417)"
            )
        if hourly > 0 and (minute == 0 or hourly < minute):
            raise ValueError(
                "retention_hourly_bars_days must be 0 (for ever) or at least "
                "retention_minute_bars_days (hourly bars are made from minute bars that old), "
                "and minute bars must then have a retention"
            )
        return self

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
        """``db_url``, else SQLite in the home (created with mode 0700: service/at_rest.py)."""
        if self.db_url:
            return self.db_url
        return f"sqlite:///{private_dir(self.home) / 'market.db'}"

    def resolved_admin_key(self) -> str:
        """The admin key: from the environment, else the key file (created on first use, mode
        0600, in a home of mode 0700)."""
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        return create_once(self.home / "admin_key", lambda: "sgadm_" + secrets.token_urlsafe(24))

    def existing_admin_key(self) -> str:
        """The admin key a client of the market uses: from the environment, else the key file
        the service wrote; never a new one (a new key only earns 401s). Raises
        :class:`NoAdminKey` naming both places."""
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        path = self.home / "admin_key"
        try:
            if path.stat().st_mode & 0o077:  # as the service itself refuses it (at_rest)
                raise NoAdminKey(
                    f"the admin key file {path} is open to other users of this host: "
                    f"chmod 600 {path}, and rotate the key if others may have read it"
                )
            key = path.read_text().strip()
        except FileNotFoundError:
            key = ""
        except OSError as exc:
            raise NoAdminKey(f"cannot read the admin key file {path}: {exc}") from None
        if not key:
            raise NoAdminKey(
                f"no admin key: set SPOTGPU_ADMIN_KEY, or run this as the service's user on its "
                f"host, where it keeps the key in {path} (not found). SPOTGPU_HOME moves it."
            )
        return key

    def resolved_secret_key(self) -> str:
        """The key that seals job environments and webhook secrets: from the environment, else
        the key file (created on first use, mode 0600, in a home of mode 0700)."""
        from prefect_spotgpu.service.sealing import key_from_home

        if self.secret_key is not None:
            return self.secret_key.get_secret_value()
        return key_from_home(self.home)
