"""One answer per tick for the anonymous market views (the dashboard's public reads).

A hundred people watching the dashboard ask the same few questions (every node, every quote,
a pool's depth, its history, its forecast), and the answer changes only when the market does.
:class:`PublicCache` keeps each anonymous ``GET`` answer of :data:`CACHED` paths for at most
``public_cache_seconds`` (one tick by default) *and* only while this replica's tick has not
committed a change (the :class:`~prefect_spotgpu.service.ticker.Notifier`'s versions are part
of the key): so an event on the stream is never followed by a stale page, and N viewers cost
one database read per view per tick instead of N. A request with an ``Authorization`` header
is never cached nor served from the cache; nor is anything but a complete ``200``. Writes
that only another replica saw (a heartbeat's telemetry) show within ``public_cache_seconds``.
At most :data:`MAX_ENTRIES` answers are kept, and only for query strings made of the parameters
these routes declare: a caller who varies a made-up parameter (``/prices?x=1``, ``?x=2``, ...)
is answered from the database like any uncached read, and cannot evict the others' answers.

The dashboard's stream is shared the same way (:class:`SharedSnapshot`): every open stream of
the process sends the same message, read once per market version and at most every
``seconds``, however many are open. Forecasts are kept per bar by ``service.forecasts``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable
from urllib.parse import parse_qsl

CACHED = (
    "/api/v1/market/nodes",
    "/api/v1/market/depth/",
    "/api/v1/prices",
)
"""Path prefixes of the anonymous market views."""
MAX_ENTRIES = 256


class PublicCache:
    """ASGI middleware (see the module docstring)."""

    def __init__(
        self, app, seconds: float, versions, query_names: Callable[[], frozenset[str]]
    ) -> None:
        self.app = app
        self.seconds = seconds
        self.versions = versions  # () -> a value that changes when the market does
        self.query_names = query_names  # () -> the query parameters the cached routes declare
        self.entries: OrderedDict[tuple, tuple[float, dict, bytes]] = OrderedDict()
        self.locks: dict[tuple, asyncio.Lock] = {}

    async def __call__(self, scope, receive, send) -> None:
        if not self._cacheable(scope):
            await self.app(scope, receive, send)
            return
        key = (scope["path"], scope.get("query_string", b""), self.versions())
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:  # one computes, the others wait for its answer
            hit = self._fresh(key)
            if hit is None:
                hit = await self._compute(scope, receive, send, key)
                if hit is None:  # not cacheable: already sent
                    return
            else:
                self.entries.move_to_end(key)
        self.locks.pop(key, None)
        start, body = hit
        await send(start)
        await send({"type": "http.response.body", "body": body})

    def _cacheable(self, scope) -> bool:
        if scope["type"] != "http" or scope["method"] != "GET" or self.seconds <= 0:
            return False
        if not scope["path"].startswith(CACHED):
            return False
        if any(name == b"authorization" for name, _ in scope.get("headers", ())):
            return False
        query = scope.get("query_string", b"").decode("latin-1")
        declared = self.query_names()
        return all(name in declared for name, _ in parse_qsl(query, keep_blank_values=True))

    def _fresh(self, key) -> tuple[dict, bytes] | None:
        entry = self.entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1], entry[2]

    async def _compute(self, scope, receive, send, key) -> tuple[dict, bytes] | None:
        start: dict = {}
        chunks: list[bytes] = []
        passing = False

        async def capture(message) -> None:
            nonlocal passing, start
            if passing:
                await send(message)
            elif message["type"] == "http.response.start":
                start = message
                if message["status"] != 200:
                    passing = True
                    await send(message)
            else:
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        if passing or not start:
            return None
        body = b"".join(chunks)
        self.entries[key] = (time.monotonic() + self.seconds, start, body)
        while len(self.entries) > MAX_ENTRIES:
            self.entries.popitem(last=False)
        return start, body


def declared_query_names(routes: Iterable) -> frozenset[str]:
    """The query parameters the cached routes among ``routes`` declare (their dependencies'
    too: a FastAPI ``Dependant`` tree)."""
    names: set[str] = set()
    for route in routes:
        dependant = getattr(route, "dependant", None)
        if dependant is None or not getattr(route, "path", "").startswith(CACHED):
            continue
        todo = [dependant]
        while todo:
            current = todo.pop()
            names.update(p.alias for p in current.query_params)
            todo.extend(current.dependencies)
    return frozenset(names)


class SharedSnapshot:
    """The latest answer of an async ``read``, shared by every caller for one ``version`` and
    at most ``seconds``: one read at a time, the others wait for its answer."""

    def __init__(self, *, seconds: float) -> None:
        self.seconds = seconds
        self.reads = 0  # how many times it read (a count for tests)
        self._latest: tuple[Hashable, float, object] | None = None  # version, at, answer
        self._lock: asyncio.Lock | None = None

    async def get(self, version: Hashable, read: Callable[[], Awaitable]):
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            latest = self._latest
            fresh = latest is not None and time.monotonic() - latest[1] < self.seconds
            if fresh and latest[0] == version:
                return latest[2]
            answer = await read()
            self.reads += 1
            self._latest = (version, time.monotonic(), answer)
            return answer
