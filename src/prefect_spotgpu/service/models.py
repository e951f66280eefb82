"""The market's tables (SQLAlchemy 2 declarative). Migrations live in ``migrations/``.

Money is stored as whole micros (``*_micros``, BigInteger; :mod:`prefect_spotgpu.market.money`),
never as floats: a tenant's ``spent_micros`` is exactly the sum of its allocations'
``charged_micros`` (with those retention removed: ``archived_charges``), and its
``credits_micros`` exactly the sum of its ledger entries (never removed). The float
properties (``credits``, ``charged_amount`` ...) are read-only views for display.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from prefect_spotgpu.economics.schedules import aware
from prefect_spotgpu.market.money import from_micros

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets BIGINT.
BigId = BigInteger().with_variant(Integer, "sqlite")


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite drops the zone on the way)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("datetimes stored in the market must be timezone-aware")
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value, dialect):
        return None if value is None else aware(value)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    credits_micros: Mapped[int] = mapped_column(BigInteger, default=0)  # all its ledger entries
    spent_micros: Mapped[int] = mapped_column(BigInteger, default=0)  # charges written so far
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    # "sealed:" and a Fernet token (service/sealing.py), never the secret itself
    webhook_secret: Mapped[str | None] = mapped_column(Text)
    provider: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=false()
    )  # the operator allowed it to register nodes (supply is vetted; anyone may buy)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    @property
    def credits(self) -> float:
        return from_micros(self.credits_micros)

    @property
    def spent(self) -> float:
        return from_micros(self.spent_micros)

    @property
    def balance_micros(self) -> int:
        return self.credits_micros - self.spent_micros

    @property
    def balance(self) -> float:
        return from_micros(self.balance_micros)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # refused from then on


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    gpu_model: Mapped[str] = mapped_column(String(50))
    region: Mapped[str] = mapped_column(String(63))
    gpu_count: Mapped[int] = mapped_column(Integer)
    reserve_price: Mapped[float] = mapped_column(Float)
    capacity: Mapped[str] = mapped_column(String(20), default="spot", server_default="spot")
    state: Mapped[str] = mapped_column(String(20), index=True)  # a market.NodeState
    state_before_loss: Mapped[str | None] = mapped_column(String(20))  # while lost: what it was
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    declared: Mapped[bool] = mapped_column(Boolean, default=False)
    inventory: Mapped[dict | None] = mapped_column(JSON)
    telemetry: Mapped[dict | None] = mapped_column(JSON)
    images: Mapped[list | None] = mapped_column(JSON)  # references held locally, as reported
    runner: Mapped[str | None] = mapped_column(String(16))  # a market.Runner; None: not said
    default_image: Mapped[str | None] = mapped_column(String(300))  # a Docker node's, if any
    address: Mapped[str | None] = mapped_column(String(253))  # where other nodes reach it
    job_subnet: Mapped[str | None] = mapped_column(String(18))  # a Docker node's job network
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (UniqueConstraint("owner_id", "name"),)


class BidRow(Base):
    __tablename__ = "bids"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    gpu_model: Mapped[str] = mapped_column(String(50))
    region: Mapped[str] = mapped_column(String(63))
    gpu_count: Mapped[int] = mapped_column(Integer)
    max_price: Mapped[float] = mapped_column(Float)
    capacity: Mapped[str] = mapped_column(String(20), default="spot", server_default="spot")
    window_start: Mapped[datetime | None] = mapped_column(UTCDateTime)
    window_end: Mapped[datetime | None] = mapped_column(UTCDateTime)
    deadline: Mapped[datetime | None] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(20), index=True)  # a protocol.BidStatus
    hold_reason: Mapped[str | None] = mapped_column(String(500))
    labels: Mapped[dict | None] = mapped_column(JSON)
    job: Mapped[dict | None] = mapped_column(JSON)  # what the node agent runs, less its env
    job_env_sealed: Mapped[str | None] = mapped_column(Text)  # the job's env, encrypted
    node_count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    min_node_count: Mapped[int | None] = mapped_column(Integer)  # a gang that may shrink
    gang_id: Mapped[int | None] = mapped_column(BigInteger, index=True)  # rank 0's bid id
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_bids_tenant_status", "tenant_id", "status"),
    )


class AllocationRow(Base):
    __tablename__ = "allocations"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=False)
    bid_id: Mapped[int] = mapped_column(ForeignKey("bids.id"), index=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    gpu_count: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20), index=True)  # a protocol.AllocationStatus
    epoch: Mapped[int] = mapped_column(Integer, default=1)
    kind: Mapped[str] = mapped_column(String(20))
    started_at: Mapped[float] = mapped_column(Float)
    charged_until: Mapped[float] = mapped_column(Float)
    price: Mapped[float] = mapped_column(Float, default=0.0)
    deadline: Mapped[float | None] = mapped_column(Float)
    notice_reason: Mapped[str | None] = mapped_column(String(30))
    charged_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    charge_carry: Mapped[int] = mapped_column(
        BigInteger, default=0, server_default="0"
    )  # owed below one micro, with charged_until (market/money.py)
    charged_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    notice_fee_micros: Mapped[int] = mapped_column(
        BigInteger, default=0, server_default="0"
    )  # a takeover's floor for the notices it caused: paid in all by its end (notice_fee.py)
    last_checkpoint_at: Mapped[float | None] = mapped_column(Float)
    paid_at_checkpoint_micros: Mapped[int] = mapped_column(
        BigInteger, default=0, server_default="0"
    )  # charged_micros when the last durable checkpoint was reported
    final_save: Mapped[str | None] = mapped_column(String(20))  # ok, failed: gate.FINAL_SAVES
    ended_at: Mapped[float | None] = mapped_column(Float, index=True)  # (retention)
    job_address: Mapped[str | None] = mapped_column(String(15))  # on its node's job network
    end_reason: Mapped[str | None] = mapped_column(String(200))  # a protocol.EndReason, mostly

    @property
    def charged_amount(self) -> float:
        return from_micros(self.charged_micros)


class ArchivedCharges(Base):
    """Per tenant, the charges of its ended allocations that retention removed
    (``service/retention.py``, the only writer): its ``spent_micros`` is exactly the sum of
    its allocations' ``charged_micros`` plus ``charged_micros`` here."""

    __tablename__ = "archived_charges"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    allocations: Mapped[int] = mapped_column(BigInteger, default=0)
    charged_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    charged_seconds: Mapped[float] = mapped_column(Float, default=0.0)


class LedgerEntry(Base):
    """Credits (starting, top-ups, compensation). Charges roll up on their allocation."""

    __tablename__ = "ledger_entries"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    kind: Mapped[str] = mapped_column(String(20))  # a ledger.CreditKind
    amount_micros: Mapped[int] = mapped_column(BigInteger)
    allocation_id: Mapped[int | None] = mapped_column(BigId)
    reason: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    @property
    def amount(self) -> float:
        return from_micros(self.amount_micros)


class NodeReport(Base):
    """Audit: every report a node made about an allocation, accepted or not."""

    __tablename__ = "node_reports"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    node_id: Mapped[int] = mapped_column(BigId, index=True)
    allocation_id: Mapped[int] = mapped_column(BigId, index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(20))
    cause: Mapped[str | None] = mapped_column(String(20))
    checkpoint_at: Mapped[float | None] = mapped_column(Float)
    step: Mapped[int | None] = mapped_column(BigInteger)
    status_code: Mapped[int] = mapped_column(Integer)  # what the API answered
    detail: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)  # (retention)


class ImageRow(Base):
    """The operator's image catalogue: a name tenants choose, the reference nodes pull."""

    __tablename__ = "images"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    reference: Mapped[str] = mapped_column(String(500), index=True)
    framework: Mapped[str] = mapped_column(String(100))
    cuda_version: Mapped[str | None] = mapped_column(String(20))
    description: Mapped[str] = mapped_column(String(500), default="", server_default="")
    runs_flows: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """It holds prefect-spotgpu (``spotgpu admin image build``): a flow run may pick it.
    False: a base that runs only a job's own command."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class EventRow(Base):
    """What happened to allocations, in order: long-polls and webhooks read it."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(BigId, index=True)
    bid_id: Mapped[int] = mapped_column(BigId, index=True)
    node_id: Mapped[int] = mapped_column(BigId, index=True)
    allocation_id: Mapped[int] = mapped_column(BigId)
    kind: Mapped[str] = mapped_column(String(20))  # a protocol.EventKind
    payload: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)  # (retention)


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(BigId, index=True)
    event_id: Mapped[int] = mapped_column(BigId)
    url: Mapped[str] = mapped_column(String(2000))
    status: Mapped[str] = mapped_column(String(20), index=True)  # pending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)  # (retention)


class PriceBar(Base):
    """One minute of a pool's clearing price; or, once retention folded an hour's minutes
    (``service/retention.py``), that hour, at its first minute."""

    __tablename__ = "price_bars"

    gpu_model: Mapped[str] = mapped_column(String(50), primary_key=True)
    region: Mapped[str] = mapped_column(String(63), primary_key=True)
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # UNIX seconds // 60
    open: Mapped[float] = mapped_column(Float)
    high: Mapped[float] = mapped_column(Float)
    low: Mapped[float] = mapped_column(Float)
    close: Mapped[float] = mapped_column(Float)
    seconds: Mapped[int] = mapped_column(
        Integer, default=60, server_default="60"
    )  # the bar's width: 60, as the tick writes it; 3600, an hour folded by retention

    __table_args__ = (Index("ix_price_bars_seconds_minute", "seconds", "minute"),)  # retention


class MarketChange(Base):
    """Outbox: API writes the tick leader must apply to its in-memory market (``outbox``)."""

    __tablename__ = "market_changes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    entity: Mapped[str] = mapped_column(String(20))  # an outbox.Entity
    entity_id: Mapped[int] = mapped_column(BigId)
    op: Mapped[str] = mapped_column(String(20))
    data: Mapped[dict | None] = mapped_column(JSON)


class PoolQuoteRow(Base):
    """The latest quote of each pool, written by the tick leader for every replica to read."""

    __tablename__ = "pool_quotes"

    gpu_model: Mapped[str] = mapped_column(String(50), primary_key=True)
    region: Mapped[str] = mapped_column(String(63), primary_key=True)
    capacity: Mapped[str] = mapped_column(String(20), primary_key=True)
    clearing_price: Mapped[float | None] = mapped_column(Float)
    reserve_price: Mapped[float | None] = mapped_column(Float)
    gpus_total: Mapped[int] = mapped_column(Integer)
    gpus_free: Mapped[int] = mapped_column(Integer)
    gpus_running: Mapped[int] = mapped_column(Integer)
    waiting_bids: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[float] = mapped_column(Float)


class TickLeader(Base):
    """One row: the epoch of the current tick leader. Every tick fences on it."""

    __tablename__ = "tick_leader"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(String(200))
    heartbeat_at: Mapped[float] = mapped_column(Float)
