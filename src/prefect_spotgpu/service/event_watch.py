"""One watcher per process learns the newest event id; waiting long-polls sleep until it passes
their cursor.

A long-poll with nothing to answer yet does not ask the database again and again: it waits on
:meth:`EventWatch.wait_past`, and queries its own events only once the newest id of the
``events`` table has passed what it has seen. The newest id is learnt by one thread for the
whole process, and only while some poll waits: at once when this process's tick leader commits
new events (the :class:`~prefect_spotgpu.service.ticker.Notifier`), and otherwise with one
``SELECT max(id)`` every ``interval`` seconds (another replica may lead; while this one leads,
every ``LEADER_CHECK_SECONDS`` only, in case). So N waiting polls cost O(1) queries a second,
not O(N).

``newest`` is written only by the watcher thread; a waiter is woken (its future resolved on
its own event loop) only by that thread, or by the waiter's own timeout.

Events become visible in id order (only the tick leader writes them, one fenced transaction at
a time), so a poll that read ``newest`` before its query and found nothing has missed nothing
at or below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine, func, select

from prefect_spotgpu.service.models import EventRow
from prefect_spotgpu.service.ticker import Notifier

logger = logging.getLogger("prefect_spotgpu.service.event_watch")

LEADER_CHECK_SECONDS = 5.0
"""While this process leads the ticks, its own commits wake the watcher; it still reads the
newest id this often."""


class EventWatch:
    """The newest event id of the database, for this process's waiting long-polls."""

    def __init__(
        self,
        *,
        engine: Engine,
        notifier: Notifier,
        leading: Callable[[], bool],
        interval: float = 0.5,
    ) -> None:
        self.engine = engine
        self.notifier = notifier
        self.leading = leading  # () -> whether this process leads the ticks now
        self.interval = interval
        self.newest = 0  # the newest event id the watcher has read
        self.reads = 0  # how many times it has read it (a count for tests and metrics)
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, int]] = {}
        self._lock = threading.Lock()
        self._wanted = threading.Event()  # set when a poll starts waiting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """How many polls wait on the watcher now (past their first query)."""
        with self._lock:
            return len(self._waiters)

    async def wait_past(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for an event id above ``seen``; the newest id known then."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self.newest > seen:
                return self.newest
            self._waiters[id(future)] = (loop, future, seen)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="spotgpu-event-watch", daemon=True
                )
                self._thread.start()
        self._wanted.set()
        try:
            await asyncio.wait((future,), timeout=timeout)
        finally:
            with self._lock:
                self._waiters.pop(id(future), None)
        return self.newest

    def stop(self) -> None:
        """End the watcher thread (a later wait starts another)."""
        self._stop.set()
        self._wanted.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
        self._stop.clear()

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        version = self.notifier.version
        last_read = -float("inf")
        while not self._stop.is_set():
            self._wanted.clear()
            with self._lock:
                waiting = bool(self._waiters)
            if not waiting:
                last_read = -float("inf")  # the first poll to wait gets a fresh read at once
                self._wanted.wait(timeout=1.0)
                continue
            due = not self.leading() or time.monotonic() - last_read >= LEADER_CHECK_SECONDS
            if due or self.notifier.version != version:
                version = self.notifier.version  # before the read: a later commit reads again
                try:
                    self._advance(self._read_newest())
                except Exception:  # the database is down: the polls time out, we read again
                    logger.exception("reading the newest event id failed")
                last_read = time.monotonic()
            self.notifier.wait(version, timeout=self.interval)

    def _read_newest(self) -> int:
        """One indexed read outside any transaction (no write lock on SQLite)."""
        options = {"isolation_level": "AUTOCOMMIT"}
        with self.engine.connect().execution_options(**options) as connection:
            newest = connection.scalar(select(func.max(EventRow.id)))
        self.reads += 1
        return int(newest or 0)

    def _advance(self, newest: int) -> None:
        with self._lock:
            if newest > self.newest:
                self.newest = newest
            woken = [
                (loop, future) for loop, future, seen in self._waiters.values() if seen < newest
            ]
        for loop, future in woken:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits on it
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
