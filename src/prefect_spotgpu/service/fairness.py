"""Fair shares: who may hold how many slots, and who may start how much expensive work.

Pure decisions, no I/O (the routes are the shell: ``routes/long_poll.py``, the dashboard's
stream, ``routes/forecast.py``). Two kinds of limit, each keyed by the caller: a tenant, a node
agent, or, for an anonymous caller, its client address.

- :class:`SlotCaps` bounds what a caller holds *at once* (concurrent long-polls, streams): a
  slot is taken when the request starts and given back when it ends, whatever the ending.
- :class:`TokenBuckets` bounds how *often* a caller starts expensive work (an estimate, a
  forecast fitted afresh): a bucket of ``burst`` tokens refilled at ``per_second``; a request
  takes one or is told how long until one is there (its ``Retry-After``).

The counts are changed only through these classes' methods, under their own lock (long-polls
run on the event loop, estimates in the thread pool).

>>> caps = SlotCaps(limit=2)
>>> caps.take("tenant:1"), caps.take("tenant:1"), caps.take("tenant:1"), caps.take("tenant:2")
(True, True, False, True)
>>> caps.give_back("tenant:1"); caps.take("tenant:1")
True
>>> buckets = TokenBuckets(burst=2, per_second=0.5)
>>> [buckets.take("10.0.0.7", now=0.0) for _ in range(3)]  # seconds to wait; 0: go ahead
[0.0, 0.0, 2.0]
>>> buckets.take("10.0.0.7", now=2.0), buckets.take("10.0.0.8", now=2.0)
(0.0, 0.0)
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefect_spotgpu.service.errors import TooManyRequests

if TYPE_CHECKING:
    from prefect_spotgpu.service.settings import ServiceSettings


class SlotCaps:
    """At most ``limit`` slots held at once per key; ``limit`` 0 means no cap."""

    def __init__(self, *, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must be 0 (no cap) or more")
        self.limit = limit
        self.held: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> bool:
        """Take a slot of ``key``; False (nothing taken) when it holds ``limit`` already."""
        with self._lock:
            count = self.held.get(key, 0)
            if self.limit and count >= self.limit:
                return False
            self.held[key] = count + 1
            return True

    def give_back(self, key: Hashable) -> None:
        """Give back a slot ``take`` gave (a key holding none is left alone)."""
        with self._lock:
            count = self.held.get(key, 0)
            if count <= 1:
                self.held.pop(key, None)
            else:
                self.held[key] = count - 1


def take_all(caps: Sequence[tuple[SlotCaps, Hashable]]) -> int | None:
    """Take one slot of each ``(caps, key)``, or none at all: the index of the first that is
    full (every slot taken before it given back), else None.

    >>> tenants, addresses = SlotCaps(limit=5), SlotCaps(limit=1)
    >>> take_all([(tenants, 1), (addresses, "10.0.0.7")])  # both taken: None
    >>> take_all([(tenants, 2), (addresses, "10.0.0.7")])  # the address is full
    1
    >>> tenants.held  # tenant 2's slot was given back
    {1: 1}
    """
    taken: list[tuple[SlotCaps, Hashable]] = []
    for index, (cap, key) in enumerate(caps):
        if not cap.take(key):
            for done, done_key in taken:
                done.give_back(done_key)
            return index
        taken.append((cap, key))
    return None


class TokenBuckets:
    """A token bucket per key: ``burst`` tokens, refilled at ``per_second``; ``per_second`` 0
    means no limit. At most ``max_keys`` buckets are kept, the least recently used forgotten
    first (a forgotten bucket comes back full: an attacker with that many addresses gains a
    burst each, no more)."""

    def __init__(self, *, burst: float, per_second: float, max_keys: int = 10_000) -> None:
        if burst < 1 or per_second < 0 or max_keys < 1:
            raise ValueError("need burst >= 1, per_second >= 0 and max_keys >= 1")
        self.burst = float(burst)
        self.per_second = float(per_second)
        self.max_keys = max_keys
        self.buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # tokens, at
        self._lock = threading.Lock()

    def take(self, key: Hashable, *, now: float) -> float:
        """Take a token of ``key`` at ``now`` (seconds, monotonic): 0.0 when taken, else the
        seconds until one is there (nothing taken)."""
        if self.per_second == 0:
            return 0.0
        with self._lock:
            tokens, at = self.buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - at) * self.per_second)
            wait = 0.0
            if tokens >= 1:
                tokens -= 1
            else:
                wait = (1 - tokens) / self.per_second
            self.buckets[key] = (tokens, now)
            while len(self.buckets) > self.max_keys:
                self.buckets.popitem(last=False)
            return wait


CAP_RETRY_SECONDS = 5
"""The ``Retry-After`` of a refused long-poll or stream: a held one ends within a poll's
timeout, or when its client goes."""


def take_or_refuse(
    slots: Sequence[tuple[SlotCaps, Hashable]], *, what: str, names: Sequence[str]
) -> Callable[[], None]:
    """Take a slot of each ``(caps, key)`` and return what gives them back (once, however
    often it is called), or raise :class:`TooManyRequests` naming the first full one
    (``names[i]``: whose it is)."""
    full = take_all(slots)
    if full is not None:
        raise TooManyRequests(
            f"too many {what} at once from this {names[full]} (at most "
            f"{slots[full][0].limit}): retry when one has ended",
            retry_after=CAP_RETRY_SECONDS,
        )
    once = threading.Lock()

    def give_back() -> None:
        if once.acquire(blocking=False):  # never released: the slots go back once
            for cap, key in slots:
                cap.give_back(key)

    return give_back


@contextlib.contextmanager
def holding(
    slots: Sequence[tuple[SlotCaps, Hashable]], *, what: str, names: Sequence[str]
) -> Iterator[None]:
    """Hold the slots of :func:`take_or_refuse` for the ``with`` block."""
    give_back = take_or_refuse(slots, what=what, names=names)
    try:
        yield
    finally:
        give_back()


def client_address(request) -> str:
    """The client address of a request (a Starlette ``Request``: the peer, or the address a
    trusted proxy forwarded)."""
    client = request.client
    return client.host if client is not None else "unknown"


@dataclass(frozen=True)
class FairShares:
    """One process's limits (``ServiceSettings``' fair-share block), in ``app.state``."""

    long_polls_by_caller: SlotCaps  # key: ("tenant", id) or ("node", id)
    long_polls_by_address: SlotCaps  # key: the client address
    streams_by_address: SlotCaps
    anonymous_work: TokenBuckets  # estimates, forecasts fitted afresh; key: the address
    tenant_work: TokenBuckets  # the same, for a tenant's (or the operator's) key

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> FairShares:
        return cls(
            long_polls_by_caller=SlotCaps(limit=settings.long_polls_per_caller),
            long_polls_by_address=SlotCaps(limit=settings.long_polls_per_address),
            streams_by_address=SlotCaps(limit=settings.streams_per_address),
            anonymous_work=TokenBuckets(
                burst=settings.anonymous_estimates_burst,
                per_second=settings.anonymous_estimates_per_minute / 60,
            ),
            tenant_work=TokenBuckets(
                burst=settings.tenant_estimates_burst,
                per_second=settings.tenant_estimates_per_minute / 60,
            ),
        )
