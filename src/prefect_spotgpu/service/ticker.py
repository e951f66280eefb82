"""The tick loop: every second, the leader clears the market and writes the decision.

Exactly one replica leads (:mod:`~prefect_spotgpu.service.leader`: a lock elects it, and every
tick transaction fences on the leader's epoch, so a leader that lost its lock cannot commit a
stale tick). The leader keeps a ``market.Market`` in memory, rebuilt cold from the database
(:mod:`~prefect_spotgpu.service.market_rows`) whenever it becomes leader or a tick fails; API
writes reach it through the ``market_changes`` outbox, applied idempotently at each tick
(:mod:`~prefect_spotgpu.service.changes`).

One tick, in one transaction: fence; apply the outbox; mark silent nodes lost; hold the bids
of tenants out of credit; clear the market; write its decision
(:mod:`~prefect_spotgpu.service.tick_writes`); write the charges when due; write the quotes.
Between ticks, when due, the leader prunes rows past their retention, a bounded batch of
each kind (:mod:`~prefect_spotgpu.service.retention`).

Allocation rows are written only by the tick leader, through ``gate``. Charges accrue in memory
(:class:`~prefect_spotgpu.service.ledger.Accrued`) and are written every
``charge_flush_seconds`` (and at once for allocations that end): an allocation's
``charged_until`` and ``price`` are written with them, so a leader that dies between flushes
loses no charge — the next leader bills the gap from the database's ``charged_until``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.market import Decision, Market
from prefect_spotgpu.service import credit, leader, ledger, outbox
from prefect_spotgpu.service.changes import apply_change, lose_silent_nodes, read_bid_rows
from prefect_spotgpu.service.clock import SYSTEM, Clock
from prefect_spotgpu.service.leader import Leadership, LostLeadership
from prefect_spotgpu.service.market_rows import load_market
from prefect_spotgpu.service.metrics import ServiceMetrics
from prefect_spotgpu.service.retention import Pruner
from prefect_spotgpu.service.settings import ServiceSettings
from prefect_spotgpu.service.tick_writes import PoolQuotes, TickWrites

logger = logging.getLogger("prefect_spotgpu.service.ticker")


class Notifier:
    """Says when this process's leader commits new events (``version``: the event watcher of
    :mod:`~prefect_spotgpu.service.event_watch` then reads the newest id, which wakes the
    waiting long-polls), and counts the commits that changed a pool's quote
    (``market_version``, for the dashboard's stream)."""

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


class Ticker:
    """Runs the tick loop of one replica (it ticks only while it leads)."""

    def __init__(
        self,
        settings: ServiceSettings,
        engine: Engine,
        sessions: sessionmaker[Session],
        notifier: Notifier | None = None,
        metrics: ServiceMetrics | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.settings = settings
        self.clock = clock  # (the only time it reads: service/clock.py)
        self.engine = engine
        self.sessions = sessions
        self.notifier = notifier or Notifier()
        self.metrics = metrics or ServiceMetrics()
        self.leadership = Leadership(engine, settings)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.epoch: int | None = None
        self.leading_since = 0.0  # when this replica last became the tick leader
        self.market: Market | None = None
        self.accrued = ledger.Accrued()  # charged by the market, not yet written
        self.charged: set[int] = set()  # the tenants the last tick charged
        self.limits = credit.BidLimits.from_settings(settings)
        self.quotes = PoolQuotes()
        self.retention = Pruner(settings, sessions)  # old rows, pruned while this one leads
        self.last_flush = 0.0
        self.tick_seconds_last = 0.0
        self.ticks = 0
        self.rounds = 0  # passes of the loop, a tick or not (a failed one, a follower's)
        self.round_at = float("-inf")  # the clock's time the last finished pass ran at

    # ---------------------------------------------------------------- the loop

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            at = self.clock.time()
            try:
                if self.epoch is None and self.leadership.try_acquire():
                    self.become_leader()
                if self.epoch is not None:
                    self.leadership.check()
                    self.tick(at)
                    self.retention.run_due(now=at, epoch=self.epoch)
            except LostLeadership as exc:
                logger.warning("lost tick leadership: %s", exc)
                self.step_down()
            except Exception:
                logger.exception("tick failed; the market is rebuilt from the database")
                self.market = None
            self.rounds += 1
            self.round_at = at
            # until a tick after this pass's time (a clock moved on meanwhile: at once)
            self.clock.wait(stop, at + self.settings.tick_seconds - self.clock.time())
        self.step_down()

    def become_leader(self) -> None:
        with self.sessions.begin() as session:
            self.epoch = leader.take_over(session=session, holder=self.holder, now=time.time())
        self.market = None
        self.leading_since = self.clock.time()
        logger.info("%s leads the tick loop (epoch %s)", self.holder, self.epoch)

    def step_down(self) -> None:
        self.epoch = None
        self.market = None
        self.accrued.clear()
        self.leadership.release()

    # ---------------------------------------------------------------- one tick

    def tick(self, now: float) -> Decision:
        started = time.perf_counter()
        with self.sessions.begin() as session:
            leader.fence(session=session, epoch=self.epoch, now=now)
            if self.market is None:
                self.accrued.clear()
                self.market = load_market(session=session, settings=self.settings)
                self.last_flush = now
            changes = outbox.take_changes(session=session)
            bid_rows = read_bid_rows(session, changes)  # held while the changes apply
            writes = TickWrites(session, self.market, self.accrued, now, limits=self.limits)
            for change in changes:
                apply_change(writes, change, now)
            del bid_rows
            # a new leader (a restart, a failover) gives every agent a timeout to check in
            timeout = self.settings.heartbeat_timeout_seconds
            if now - self.leading_since >= timeout:
                lose_silent_nodes(writes, timeout, now)
            # every tenant the last tick charged, its charges flushed or not
            owed = {
                t: self.accrued.tenants.get(t, 0) for t in self.charged | {*self.accrued.tenants}
            }
            credit.hold_short_of_credit(writes, owed, self.limits.hold_seconds)
            decision = self.market.tick(now)
            self.charged = set(decision.charges.tenant_id.tolist())
            writes.decision(decision)
            writes.flush_events()
            if writes.ended or now - self.last_flush >= self.settings.charge_flush_seconds:
                self.accrued.write(session, self.market)
                self.quotes.write_bars(session)
                self.last_flush = now
            moved = self.quotes.write(session, decision, now)
            outbox.clear_changes(session=session, changes=changes)
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
