"""The tick loop: every second, the leader clears the market and writes the decision.

Exactly one replica leads: a PostgreSQL advisory lock (or a file lock beside a SQLite
database) elects it, and every tick transaction also fences on the ``tick_leader`` row's epoch,
so a leader that lost its lock cannot commit a stale tick. The leader keeps a
``market.Market`` in memory, rebuilt cold from the database whenever it becomes leader or a tick
fails; API writes reach it through the ``market_changes`` outbox, applied idempotently (a change
only marks a row dirty; the row itself says what to do).

Allocation rows are written only here, through ``gate``. Charges accrue in memory and are
written every ``charge_flush_seconds`` (and at once for allocations that end): an allocation's
``charged_until`` and ``price`` are written with them, so a leader that dies between flushes
loses no charge — the next leader bills the gap from the database's ``charged_until``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import (
    Engine,
    bindparam,
    delete,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.market import Allocation as MarketAllocation
from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    Capacity,
    Decision,
    Interval,
    Market,
    MarketConfig,
    Node,
    NodeState,
    PlacementKind,
)
from prefect_spotgpu.market.compensation import Loss, LossCause, compensation
from prefect_spotgpu.market.money import from_micros
from prefect_spotgpu.service import crud, gate
from prefect_spotgpu.service.metrics import ServiceMetrics
from prefect_spotgpu.service.models import (
    AllocationRow,
    BidRow,
    EventRow,
    LedgerEntry,
    MarketChange,
    NodeRow,
    PoolQuoteRow,
    PriceBar,
    Tenant,
    TickLeader,
    WebhookDelivery,
)
from prefect_spotgpu.service.settings import ServiceSettings

logger = logging.getLogger("prefect_spotgpu.service.ticker")

ADVISORY_LOCK_KEY = 0x53504F54_47505531 & 0x7FFFFFFFFFFFFFFF  # "SPOTGPU1"
S = AllocationStatus


class LostLeadership(Exception):
    pass


class Leadership:
    """Who may tick: an advisory lock on PostgreSQL, a file lock beside a SQLite file."""

    def __init__(self, engine: Engine, settings: ServiceSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._connection = None
        self._file = None

    def try_acquire(self) -> bool:
        if self.engine.dialect.name == "postgresql":
            if self._connection is None:
                self._connection = self.engine.connect()
            got = self._connection.execute(
                text("SELECT pg_try_advisory_lock(:key)"), {"key": ADVISORY_LOCK_KEY}
            ).scalar()
            self._connection.commit()
            return bool(got)
        path = self._lock_path()
        self._file = open(path, "a+")  # noqa: SIM115 - held for as long as we lead
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            self._file = None
            return False
        return True

    def check(self) -> None:
        """Raise LostLeadership when the lock's connection is gone."""
        if self._connection is not None:
            try:
                self._connection.execute(text("SELECT 1"))
                self._connection.commit()
            except Exception as exc:  # the lock died with its connection
                self.release()
                raise LostLeadership(str(exc)) from exc

    def release(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None
        if self._file is not None:
            with contextlib.suppress(Exception):
                fcntl.flock(self._file, fcntl.LOCK_UN)
                self._file.close()
            self._file = None

    def _lock_path(self) -> str:
        database = self.engine.url.database
        if database and database != ":memory:":
            return database + ".leader"
        self.settings.home.mkdir(parents=True, exist_ok=True)
        return str(self.settings.home / "memory.leader")


class Notifier:
    """Wakes long-polls in this process when the local leader commits new events, and counts
    the commits that changed a pool's quote (``market_version``, for the dashboard's stream)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.version = 0
        self.market_version = 0

    def market_moved(self) -> None:
        self.market_version += 1

    def notify(self) -> None:
        with self._condition:
            self.version += 1
            self._condition.notify_all()

    def wait(self, version: int, timeout: float) -> int:
        with self._condition:
            self._condition.wait_for(lambda: self.version != version, timeout=timeout)
            return self.version


def ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


class Ticker:
    """Runs the tick loop of one replica (it ticks only while it leads)."""

    def __init__(
        self,
        settings: ServiceSettings,
        engine: Engine,
        sessions: sessionmaker[Session],
        notifier: Notifier | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.sessions = sessions
        self.notifier = notifier or Notifier()
        self.metrics = metrics or ServiceMetrics()
        self.leadership = Leadership(engine, settings)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.epoch: int | None = None
        self.leading_since = 0.0  # when this replica last became the tick leader
        self.market: Market | None = None
        # allocation id -> [micros, seconds, tenant]; tenant -> micros: charged, not yet written
        self.pending: dict[int, list] = {}
        self.owed: defaultdict[int, int] = defaultdict(int)
        self.bars: dict[tuple[str, str, int], list[float]] = {}
        self.last_flush = 0.0
        self.last_quotes: dict[tuple[str, str, str], tuple] = {}
        self.tick_seconds_last = 0.0
        self.ticks = 0

    # ---------------------------------------------------------------- the loop

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                if self.epoch is None and self.leadership.try_acquire():
                    self.become_leader()
                if self.epoch is not None:
                    self.leadership.check()
                    self.tick(time.time())
            except LostLeadership as exc:
                logger.warning("lost tick leadership: %s", exc)
                self.step_down()
            except Exception:
                logger.exception("tick failed; the market is rebuilt from the database")
                self.market = None
            stop.wait(max(0.0, self.settings.tick_seconds - (time.monotonic() - started)))
        self.step_down()

    def become_leader(self) -> None:
        with self.sessions.begin() as session:
            row = session.get(TickLeader, 1, with_for_update=True)
            if row is None:
                row = TickLeader(id=1, epoch=0, holder="", heartbeat_at=0.0)
                session.add(row)
            row.epoch += 1
            row.holder = self.holder
            row.heartbeat_at = time.time()
            session.flush()
            self.epoch = row.epoch
        self.market = None
        self.leading_since = time.time()
        logger.info("%s leads the tick loop (epoch %s)", self.holder, self.epoch)

    def step_down(self) -> None:
        self.epoch = None
        self.market = None
        self.pending.clear()
        self.owed.clear()
        self.leadership.release()

    def _fence(self, session: Session, now: float) -> None:
        result = session.execute(
            update(TickLeader)
            .where(TickLeader.id == 1, TickLeader.epoch == self.epoch)
            .values(heartbeat_at=now)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            raise LostLeadership("another replica took over the tick loop")

    # ---------------------------------------------------------------- one tick

    def tick(self, now: float) -> Decision:
        started = time.perf_counter()
        with self.sessions.begin() as session:
            self._fence(session, now)
            if self.market is None:
                self._load(session, now)
            changes = list(session.scalars(select(MarketChange).order_by(MarketChange.id)))
            writes = _Writes(session, self, now)
            for change in changes:
                self._apply_change(writes, change, now)
            self._lost_nodes(writes, now)
            self._credit_holds(writes, now)
            decision = self.market.tick(now)
            writes.decision(decision)
            writes.flush_events()
            if writes.ended or now - self.last_flush >= self.settings.charge_flush_seconds:
                self._flush(session, now)
            moved = self._write_quotes(session, decision, now)
            if changes:
                session.execute(
                    delete(MarketChange).where(MarketChange.id.in_([c.id for c in changes]))
                )
        if writes.events:
            self.notifier.notify()
        if moved:
            self.notifier.market_moved()
        self.ticks += 1
        self.tick_seconds_last = time.perf_counter() - started
        self.metrics.observe_tick(
            self.tick_seconds_last, notices=decision.notices, reports=writes.final_saves
        )
        return decision

    def _load(self, session: Session, now: float) -> None:
        """Rebuild the in-memory market from the database (leader start, or after a failure).

        Plain bids (no window, no deadline) are read as columns and bulk-loaded per pool;
        the rest one by one. Bids that are cancelled or held but still hold GPUs are loaded
        too: their ``market_changes`` row (still in the outbox) ends them at this tick.
        """
        self.pending.clear()
        self.owed.clear()
        highest = session.scalar(select(AllocationRow.id).order_by(AllocationRow.id.desc()))
        config = MarketConfig(
            hysteresis=self.settings.hysteresis,
            notice_seconds=self.settings.notice_seconds,
            open_regions=True,
        )
        market = Market(config, next_allocation_id=(highest or 0) + 1)
        for n in session.scalars(select(NodeRow).order_by(NodeRow.id)):
            market.upsert_node(
                Node(
                    n.id,
                    n.gpu_model,
                    n.region,
                    n.gpu_count,
                    n.reserve_price,
                    NodeState(n.state),
                    n.capacity,
                )
            )
        allocs = list(
            session.scalars(
                select(AllocationRow)
                .where(AllocationRow.status.in_(crud.ACTIVE))
                .order_by(AllocationRow.id)
            )
        )
        holding = {a.bid_id for a in allocs}
        plain = (
            BidRow.window_start.is_(None) & BidRow.deadline.is_(None) & (BidRow.capacity == "spot")
        )
        columns = session.execute(
            select(
                BidRow.id,
                BidRow.tenant_id,
                BidRow.gpu_model,
                BidRow.region,
                BidRow.gpu_count,
                BidRow.max_price,
                BidRow.created_at,
            )
            .where(BidRow.status == "open", plain)
            .order_by(BidRow.id)
        ).all()
        groups: dict[tuple[str, str], list] = defaultdict(list)
        for row in columns:
            groups[(row.gpu_model, row.region)].append(row)
        loaded = set()
        for (model, region), rows in sorted(groups.items()):
            market.add_bid_arrays(
                gpu_model=model,
                region=region,
                ids=np.array([r.id for r in rows], np.int64),
                gpu_counts=np.array([r.gpu_count for r in rows], np.int64),
                max_prices=np.array([r.max_price for r in rows], np.float64),
                created_at=np.array([_aware(r.created_at).timestamp() for r in rows]),
                tenant_ids=np.array([r.tenant_id for r in rows], np.int64),
            )
            loaded.update(r.id for r in rows)
        others = list(
            session.scalars(
                select(BidRow).where((BidRow.status == "open") & ~plain).order_by(BidRow.id)
            )
        )
        missing = holding - loaded - {b.id for b in others}  # cancelled or held, holding GPUs
        others += [session.get(BidRow, bid_id) for bid_id in sorted(missing)]
        for row in sorted(others, key=lambda b: b.id):
            market.add_bid(self._bid(row))
        for a in allocs:
            market.load_allocation(
                MarketAllocation(
                    id=a.id,
                    bid_id=a.bid_id,
                    node_id=a.node_id,
                    gpu_count=a.gpu_count,
                    status=S(a.status),
                    started_at=a.started_at,
                    charged_until=a.charged_until,
                    charge_carry=a.charge_carry,
                    price=a.price,
                    deadline=a.deadline,
                    notice_reason=a.notice_reason,
                    kind=a.kind,
                )
            )
        market.compact()
        self.market = market
        self.last_flush = now

    @staticmethod
    def _bid(row: BidRow) -> Bid:
        window = None
        if row.window_start is not None and row.window_end is not None:
            window = Interval(ts(_aware(row.window_start)), ts(_aware(row.window_end)))
        return Bid(
            id=row.id,
            gpu_model=row.gpu_model,
            gpu_count=row.gpu_count,
            max_price=row.max_price,
            region=row.region,
            created_at=ts(_aware(row.created_at)),
            window=window,
            deadline=ts(_aware(row.deadline)) if row.deadline else None,
            tenant_id=row.tenant_id,
            capacity=row.capacity,
        )

    # ---------------------------------------------------------------- changes from the API

    def _apply_change(self, writes: _Writes, change: MarketChange, now: float) -> None:
        market, session = self.market, writes.session
        if change.entity == "node":
            row = session.get(NodeRow, change.entity_id)
            if row is not None:
                try:
                    market.upsert_node(
                        Node(
                            row.id,
                            row.gpu_model,
                            row.region,
                            row.gpu_count,
                            row.reserve_price,
                            NodeState(row.state),
                            row.capacity,
                        )
                    )
                except ValueError:
                    logger.exception("node %s cannot change that way", row.id)
        elif change.entity == "bid":
            row = session.get(BidRow, change.entity_id)
            if row is None:
                return
            if row.status == "open" and not market.has_bid(row.id):
                try:
                    market.add_bid(self._bid(row))
                except ValueError as exc:  # e.g. a region no node offers yet: hold it
                    row.status, row.hold_reason = "held", str(exc)
            elif row.status == "open" and market.bid_price(row.id) != row.max_price:
                market.reprice_bid(row.id, row.max_price)
            elif row.status in ("cancelled", "finished", "held") and market.has_bid(row.id):
                writes.settlement(
                    market.cancel_bid(row.id, now),
                    reason="bid cancelled"
                    if row.status == "cancelled"
                    else row.hold_reason or row.status,
                )
        elif change.entity == "allocation":
            self._apply_report(writes, change, now)
        elif change.entity == "tenant":
            writes.refresh_tenant(change.entity_id)
            self._release_holds(writes, change.entity_id)

    def _apply_report(self, writes: _Writes, change: MarketChange, now: float) -> None:
        """A node's report (checked by the API: its own allocation, its current epoch).

        A durable checkpoint (periodic, or the final save) records what the allocation had
        paid by then, so compensation never covers work that was saved. A failed final save,
        or a job that ends during its notice, ends the allocation at once: GPUs freed,
        billing stopped."""
        alloc = writes.session.get(AllocationRow, change.entity_id)
        status = self.market.allocation_status(change.entity_id)
        if alloc is None or status is None or status.is_terminal():
            return
        data = change.data or {}
        at = min(float(data.get("at", now)), now)
        checkpoint_at = data.get("checkpoint_at")
        if (
            change.op in ("checkpoint", "saved")
            and checkpoint_at is not None
            and checkpoint_at > (alloc.last_checkpoint_at or 0.0)
        ):  # a newer durable checkpoint: what was paid up to now is no longer at risk
            alloc.last_checkpoint_at = checkpoint_at
            alloc.paid_at_checkpoint_micros = writes.paid(alloc)
        if change.op == "saved" and status is S.NOTICED:
            alloc.final_save = "ok"
            writes.final_saves.append(change.op)
            writes.settlement(
                self.market.end_allocation(alloc.id, S.PREEMPTED, at),
                reason="final save acknowledged",
            )
        elif change.op == "save_failed" and status is S.NOTICED:
            alloc.final_save = "failed"
            writes.final_saves.append(change.op)
            cause = LossCause(data.get("cause") or LossCause.JOB)
            in_time = alloc.deadline is None or at <= alloc.deadline
            writes.settlement(
                self.market.end_allocation(alloc.id, S.PREEMPTED, at),
                reason=f"final save failed ({cause.value})",
            )
            if cause is LossCause.STORAGE and in_time:
                writes.compensate(alloc, cause, reclaimed=alloc.notice_reason == "reclaimed")
        elif change.op == "finished" and status in (S.RUNNING, S.NOTICED):
            writes.settlement(
                self.market.end_allocation(alloc.id, S.FINISHED, at),
                reason="job finished",
            )
            bid = writes.session.get(BidRow, alloc.bid_id)
            if bid is not None and bid.status in ("open", "held"):
                bid.status = "finished"
        elif change.op == "failed" and status in (S.RUNNING, S.NOTICED):
            writes.settlement(
                self.market.end_allocation(alloc.id, S.PREEMPTED, at),
                reason="job failed on the node",
            )

    def _lost_nodes(self, writes: _Writes, now: float) -> None:
        if now - self.leading_since < self.settings.heartbeat_timeout_seconds:
            return  # a new leader (a restart, a failover) gives every agent a timeout to check in
        cutoff = datetime.fromtimestamp(now - self.settings.heartbeat_timeout_seconds, UTC)
        lost = writes.session.scalars(
            select(NodeRow)
            .where(NodeRow.state.in_(("live", "draining")), NodeRow.last_heartbeat_at < cutoff)
            .order_by(NodeRow.id)
        )
        for node in lost:
            node.state = "lost"
            self.market.upsert_node(
                Node(
                    node.id,
                    node.gpu_model,
                    node.region,
                    node.gpu_count,
                    node.reserve_price,
                    NodeState.LOST,
                    node.capacity,
                )
            )
            logger.warning(
                "node %s missed heartbeats for %ss: lost",
                node.id,
                self.settings.heartbeat_timeout_seconds,
            )

    def _credit_holds(self, writes: _Writes, now: float) -> None:
        """Hold the bids of tenants whose balance (with unwritten charges) reached zero."""
        owed = self.owed
        for tenant_id, (credits, spent) in writes.balances(list(owed)).items():
            balance = credits - spent - owed[tenant_id]
            if balance > 0:
                continue
            reason = f"{crud.OUT_OF_CREDIT}: balance {from_micros(balance):.4f}"
            bids = writes.session.scalars(
                select(BidRow.id).where(BidRow.tenant_id == tenant_id, BidRow.status == "open")
            ).all()
            for bid_id in bids:
                held = writes.session.execute(  # compare-and-set: a cancel may have won
                    update(BidRow)
                    .where(BidRow.id == bid_id, BidRow.status == "open")
                    .values(status="held", hold_reason=reason)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if held and self.market.has_bid(bid_id):
                    writes.settlement(self.market.cancel_bid(bid_id, now), reason=reason)

    def _release_holds(self, writes: _Writes, tenant_id: int) -> None:
        tenant = writes.session.get(Tenant, tenant_id)
        if tenant is None or tenant.balance_micros <= 0:
            return
        held = writes.session.scalars(
            select(BidRow).where(
                BidRow.tenant_id == tenant_id,
                BidRow.status == "held",
                BidRow.hold_reason.like(f"{crud.OUT_OF_CREDIT}%"),
            )
        ).all()
        for bid in held:
            reopened = writes.session.execute(  # compare-and-set: a cancel may have won
                update(BidRow)
                .where(BidRow.id == bid.id, BidRow.status == "held")
                .values(status="open", hold_reason=None)
                .execution_options(synchronize_session=False)
            ).rowcount
            if reopened and not self.market.has_bid(bid.id):
                self.market.add_bid(self._bid(bid))

    # ---------------------------------------------------------------- writing

    def _flush(self, session: Session, now: float) -> None:
        """Write accrued charges, the prices in force, and the price bars."""
        ids, prices, charged, carry = self.market.charge_state()
        in_force = dict(
            zip(
                ids.tolist(),
                zip(prices.tolist(), charged.tolist(), carry.tolist(), strict=True),
                strict=True,
            )
        )
        rows, spent = [], defaultdict(int)
        for alloc_id, (amount, seconds, tenant) in self.pending.items():
            price, until, owed_below_a_micro = in_force.get(alloc_id, (None, None, 0))
            rows.append(
                {
                    "b_id": alloc_id,
                    "b_amount": amount,
                    "b_seconds": seconds,
                    "b_price": price,
                    "b_until": until,
                    "b_carry": owed_below_a_micro,
                }
            )
            spent[int(tenant)] += amount
        for alloc_id, (price, until, owed_below_a_micro) in in_force.items():
            if alloc_id not in self.pending:  # running, nothing charged yet
                rows.append(
                    {
                        "b_id": alloc_id,
                        "b_amount": 0,
                        "b_seconds": 0.0,
                        "b_price": price,
                        "b_until": until,
                        "b_carry": owed_below_a_micro,
                    }
                )
        _bulk_charge(session, rows)
        for tenant_id, amount in spent.items():
            session.execute(
                update(Tenant)
                .where(Tenant.id == tenant_id)
                .values(spent_micros=Tenant.spent_micros + amount)
                .execution_options(synchronize_session=False)
            )
        for (model, region, minute), (o, h, lo, c) in self.bars.items():
            bar = session.get(PriceBar, (model, region, minute))
            if bar is None:
                session.add(
                    PriceBar(
                        gpu_model=model,
                        region=region,
                        minute=minute,
                        open=o,
                        high=h,
                        low=lo,
                        close=c,
                    )
                )
            else:
                bar.high, bar.low, bar.close = max(bar.high, h), min(bar.low, lo), c
        self.pending.clear()
        self.owed.clear()
        self.bars.clear()
        self.last_flush = now

    def _write_quotes(self, session: Session, decision: Decision, now: float) -> bool:
        """Each pool's quote and this minute's price bar; whether any quote changed."""
        moved = False
        minute = int(now // 60)
        for q in decision.quotes:
            key = (q.gpu_model, q.region, q.capacity.value)
            if q.clearing_price is not None and q.capacity is Capacity.SPOT:
                bar = self.bars.get((q.gpu_model, q.region, minute))
                p = q.clearing_price
                if bar is None:
                    self.bars[(q.gpu_model, q.region, minute)] = [p, p, p, p]
                else:
                    bar[1], bar[2], bar[3] = max(bar[1], p), min(bar[2], p), p
            values = (
                q.clearing_price,
                q.reserve_price,
                q.gpus_total,
                q.gpus_free,
                q.gpus_running,
                q.waiting_bids,
            )
            if self.last_quotes.get(key) == values:
                continue
            row = session.get(PoolQuoteRow, key)
            if row is None:
                row = PoolQuoteRow(gpu_model=q.gpu_model, region=q.region, capacity=key[2])
                session.add(row)
            (
                row.clearing_price,
                row.reserve_price,
                row.gpus_total,
                row.gpus_free,
                row.gpus_running,
                row.waiting_bids,
            ) = values
            row.updated_at = now
            self.last_quotes[key] = values
            moved = True
        return moved


def _sums_by(groups: np.ndarray, micros: np.ndarray, n: int) -> list[int]:
    """Exact integer sums of ``micros`` per group (``np.bincount`` sums in floats)."""
    sums = np.zeros(n, np.int64)
    np.add.at(sums, groups, micros)
    return sums.tolist()


def _bulk_charge(session: Session, rows: list[dict]) -> None:
    """Add accrued charges to allocations (one executemany per kind of row).

    Running allocations also get their price in force, ``charged_until`` and ``charge_carry``
    (written together, so a restarted leader bills from exactly there); those that ended this
    tick (``b_price`` None) keep what their ending wrote.
    """
    table = AllocationRow.__table__
    running = [r for r in rows if r["b_price"] is not None]
    ended = [
        {k: r[k] for k in ("b_id", "b_amount", "b_seconds")} for r in rows if r["b_price"] is None
    ]
    added = {
        "charged_micros": table.c.charged_micros + bindparam("b_amount"),
        "charged_seconds": table.c.charged_seconds + bindparam("b_seconds"),
    }
    if running:
        session.execute(
            table.update()
            .where(table.c.id == bindparam("b_id"))
            .values(
                **added,
                price=bindparam("b_price"),
                charged_until=bindparam("b_until"),
                charge_carry=bindparam("b_carry"),
            ),
            running,
        )
    if ended:
        session.execute(
            table.update().where(table.c.id == bindparam("b_id")).values(**added), ended
        )


def _aware(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes: they were written in UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


class _Writes:
    """The writes of one tick: allocations (through the gate), events, deliveries, credits.

    Events are written in bulk at the end of the tick (``flush_events``), in order, with
    their webhook deliveries, so a cold tick that places 100,000 bids stays a few statements.
    """

    def __init__(self, session: Session, ticker: Ticker, now: float) -> None:
        self.session = session
        self.ticker = ticker
        self.now = now
        self.now_dt = datetime.fromtimestamp(now, UTC)
        self.events = 0
        self.ended = False
        self.final_saves: list[str] = []  # final-save reports applied (saved, save_failed)
        self._pending_events: list[dict] = []
        self._webhooks: dict[int, str | None] = {}
        self._tenants: dict[int, tuple[float, float]] = {}
        self._bid_tenant: dict[int, int] = {}

    def balances(self, tenant_ids) -> dict[int, tuple[int, int]]:
        """Each tenant's ``(credits, spent)`` in micros, as written."""
        out = {}
        for tenant_id in tenant_ids:
            if tenant_id not in self._tenants:
                self.refresh_tenant(tenant_id)
            out[tenant_id] = self._tenants[tenant_id]
        return out

    def refresh_tenant(self, tenant_id: int) -> None:
        row = self.session.execute(
            select(Tenant.credits_micros, Tenant.spent_micros, Tenant.webhook_url).where(
                Tenant.id == tenant_id
            )
        ).first()
        if row is not None:
            self._tenants[tenant_id] = (row.credits_micros, row.spent_micros)
            self._webhooks[tenant_id] = row.webhook_url

    def tenant_of(self, bid_id: int) -> int:
        tenant = self._bid_tenant.get(bid_id)
        if tenant is None:
            tenant = self._bid_tenant[bid_id] = self.ticker.market.bid_tenant(bid_id)
        return tenant

    def event(
        self, kind: str, *, alloc_id: int, bid_id: int, node_id: int, tenant_id: int, **payload
    ) -> None:
        body = {
            "allocation_id": alloc_id,
            "bid_id": bid_id,
            "node_id": node_id,
            "event": kind,
            "at": self.now,
            **payload,
        }
        self._pending_events.append(
            {
                "tenant_id": tenant_id,
                "bid_id": bid_id,
                "node_id": node_id,
                "allocation_id": alloc_id,
                "kind": kind,
                "payload": body,
                "created_at": self.now_dt,
            }
        )

    def flush_events(self) -> None:
        rows, self._pending_events = self._pending_events, []
        if not rows:
            return
        ids = (
            self.session.execute(
                insert(EventRow).returning(EventRow.id, sort_by_parameter_order=True), rows
            )
            .scalars()
            .all()
        )
        self.events += len(rows)
        deliveries = []
        for event_id, row in zip(ids, rows, strict=True):
            tenant_id = row["tenant_id"]
            if tenant_id not in self._webhooks:
                self.refresh_tenant(tenant_id)
            url = self._webhooks.get(tenant_id)
            if url:
                deliveries.append(
                    {
                        "tenant_id": tenant_id,
                        "event_id": event_id,
                        "url": url,
                        "status": "pending",
                        "attempts": 0,
                        "next_attempt_at": self.now,
                        "updated_at": self.now_dt,
                    }
                )
        if deliveries:
            self.session.execute(insert(WebhookDelivery), deliveries)

    def decision(self, decision: Decision) -> None:
        placements = list(decision.placements)
        gate.create_allocations(
            session=self.session,
            rows=[
                {
                    "id": p.allocation_id,
                    "bid_id": p.bid_id,
                    "node_id": p.node_id,
                    "tenant_id": self.tenant_of(p.bid_id),
                    "gpu_count": p.gpu_count,
                    "status": p.status.value,
                    "kind": p.kind.value,
                    "started_at": self.now,
                    "charged_until": self.now,
                    # in force from the start: a leader killed before its next flush must
                    # not leave a restarted one billing this interval at 0
                    "price": self.ticker.market.price_in_force(p.allocation_id),
                    "deadline": p.expires_at,
                    "charged_micros": 0,
                    "charged_seconds": 0.0,
                }
                for p in placements
            ],
        )
        for p in placements:
            kind = "allocated" if p.kind is PlacementKind.NEW else "reserved"
            self.event(
                kind,
                alloc_id=p.allocation_id,
                bid_id=p.bid_id,
                node_id=p.node_id,
                tenant_id=self.tenant_of(p.bid_id),
                status=p.status.value,
                gpu_count=p.gpu_count,
                placement=p.kind.value,
                epoch=1,
                expires_at=p.expires_at,
            )
        for n in decision.notices:
            row = gate.set_allocation_status(
                session=self.session,
                allocation_id=n.allocation_id,
                expected=S.RUNNING,
                to=S.NOTICED,
                deadline=n.deadline,
                notice_reason=n.reason.value,
            )
            self.event(
                "noticed",
                alloc_id=n.allocation_id,
                bid_id=n.bid_id,
                node_id=n.node_id,
                tenant_id=row.tenant_id,
                reason=n.reason.value,
                deadline=n.deadline,
                epoch=row.epoch,
            )
        self.charges(decision.charges)  # first: a compensation reads what was paid
        self.settlement_endings(decision.endings)
        for alloc_id in decision.promotions:
            row = gate.set_allocation_status(
                session=self.session,
                allocation_id=alloc_id,
                expected=S.RESERVED,
                to=S.RUNNING,
                started_at=self.now,
                charged_until=self.now,
                price=self.ticker.market.price_in_force(alloc_id),
                deadline=None,
            )
            self.event(
                "allocated",
                alloc_id=alloc_id,
                bid_id=row.bid_id,
                node_id=row.node_id,
                tenant_id=row.tenant_id,
                status="running",
                gpu_count=row.gpu_count,
                placement="promoted",
                epoch=row.epoch,
            )

    def charges(self, charges) -> None:
        pending, owed = self.ticker.pending, self.ticker.owed
        if len(charges) == 0:
            return
        tenants, inverse = np.unique(charges.tenant_id, return_inverse=True)
        for tenant, amount in zip(
            tenants.tolist(), _sums_by(inverse, charges.amount, len(tenants)), strict=True
        ):
            owed[tenant] += amount
        for alloc_id, amount, seconds, tenant in zip(
            charges.allocation_id.tolist(),
            charges.amount.tolist(),
            charges.seconds.tolist(),
            charges.tenant_id.tolist(),
            strict=True,
        ):
            entry = pending.get(alloc_id)
            if entry is None:
                pending[alloc_id] = [amount, seconds, tenant]
            else:
                entry[0] += amount
                entry[1] += seconds

    def settlement(self, settlement, reason: str) -> None:
        self.charges(settlement.charges)
        self.settlement_endings(settlement.endings, reason=reason)

    def paid(self, alloc: AllocationRow) -> int:
        """Micros the allocation has paid so far: written charges plus this leader's unwritten."""
        pending = self.ticker.pending.get(alloc.id)
        return alloc.charged_micros + (pending[0] if pending else 0)

    def settlement_endings(self, endings, reason: str | None = None) -> None:
        for e in endings:
            self.ended = True
            fields = {"ended_at": e.at, "end_reason": reason or e.reason}
            if e.previous.is_charged():  # its last charge took any carry
                fields["charged_until"], fields["charge_carry"] = e.at, 0
            row = gate.set_allocation_status(
                session=self.session,
                allocation_id=e.allocation_id,
                expected=e.previous,
                to=e.status,
                **fields,
            )
            self.event(
                e.status.value,
                alloc_id=e.allocation_id,
                bid_id=e.bid_id,
                node_id=e.node_id,
                tenant_id=row.tenant_id,
                reason=fields["end_reason"],
                epoch=row.epoch,
            )
            if e.reason == "node lost" and e.previous.is_charged():
                self.compensate(
                    self.session.get(AllocationRow, e.allocation_id), LossCause.NODE_LOST
                )

    def compensate(self, alloc: AllocationRow, cause: LossCause, reclaimed: bool = False) -> None:
        """Credit what the allocation paid since its last durable checkpoint, when the loss
        was the platform's (``market.compensation`` decides; this writes it, once)."""
        node = self.session.get(NodeRow, alloc.node_id)
        already = self.session.scalar(
            select(LedgerEntry.id).where(
                LedgerEntry.allocation_id == alloc.id, LedgerEntry.kind == "compensation"
            )
        )
        decided = compensation(
            Loss(
                cause,
                paid_total=self.paid(alloc),
                paid_at_checkpoint=alloc.paid_at_checkpoint_micros,
                own_node=node is not None and node.owner_id == alloc.tenant_id,
                already_compensated=already is not None,
                reclaimed=reclaimed,
            )
        )
        if decided is None:
            return
        crud.add_credit(
            session=self.session,
            tenant_id=alloc.tenant_id,
            amount=decided.amount,
            kind="compensation",
            allocation_id=alloc.id,
            now=self.now_dt,
            reason=decided.reason,
        )
