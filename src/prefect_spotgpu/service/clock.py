"""The service's clock: the one seam through which the tick loop and the routes read the time.

The market is pure and is handed ``now`` (``market/``); the service's shell reads it here: the
ticker (each tick's ``now``, its leadership's start, its wait between ticks) and every route
(``routes/params.now``: a request's time, set for it by ``ClockMiddleware``). A deployment
runs on ``SystemClock``. Tests drive a ``ManualClock`` instead of sleeping: time moves only when
a test advances it, and the tick loop, which waits on the clock, ticks at each step
(``tests/conftest.py``: ``Service.advance``), so a 30-second heartbeat timeout is a test of
milliseconds (docs/development/code-style.md#style-14).
"""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Now, in Unix seconds."""
        ...

    def wait(self, stop: threading.Event, seconds: float) -> None:
        """Until ``seconds`` of this clock have passed, or ``stop`` is set."""
        ...


class SystemClock:
    """The wall clock."""

    def time(self) -> float:
        return time.time()

    def wait(self, stop: threading.Event, seconds: float) -> None:
        stop.wait(seconds)


class ManualClock:
    """A clock that moves only when told (:meth:`advance`); a loop waiting on it wakes then.

    >>> clock = ManualClock(start=100.0)
    >>> clock.advance(2.5); clock.time()
    102.5
    """

    POLL_SECONDS = 0.05
    """How often a wait looks at its ``stop`` event (setting one does not wake the clock)."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)
        self._moved = threading.Condition()

    def time(self) -> float:
        with self._moved:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._moved:
            self._now += seconds
            self._moved.notify_all()

    def wait(self, stop: threading.Event, seconds: float) -> None:
        with self._moved:
            until = self._now + max(0.0, seconds)
            while self._now < until and not stop.is_set():
                self._moved.wait(self.POLL_SECONDS)


SYSTEM = SystemClock()
request_clock: ContextVar[Clock] = ContextVar("request_clock", default=SYSTEM)
"""The clock of the request being served (its app's: ``ClockMiddleware``)."""


class ClockMiddleware:
    """ASGI middleware giving every request of the app the service's ``clock``
    (``app.add_middleware(ClockMiddleware, clock=...)``)."""

    def __init__(self, app, clock: Clock) -> None:
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send) -> None:
        token = request_clock.set(self.clock)
        try:
            await self.app(scope, receive, send)
        finally:
            request_clock.reset(token)
