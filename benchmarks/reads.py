"""Reads benchmark: the tick's duration with paced anonymous dashboard readers and without.

Does a crowd of readers slow the tick leader? For SQLite and PostgreSQL side by side in one run.

The market: ``--bids`` open bids and one node of 8 GPUs per 10 bids (``api.fill``), a few days
of minute price bars, and a leader that writes every running allocation's charge every tick
(``SPOTGPU_CHARGE_FLUSH_SECONDS=1``). The service runs as its own process on a loopback port.
Nodes are declared and send no heartbeats, so the heartbeat timeout is set beyond the run.

- ``idle`` / ``readers``: blocks of ``--block`` seconds alternate between no readers and
  ``--readers`` concurrent anonymous readers, each on its own keep-alive connection, cycling
  through the reads the public page makes (``/market/nodes``, the quotes, the stream's snapshot,
  the selected pool's order book, minute history and forecast, ``/health``) with a fixed think
  time between a response and its next request. Alternating blocks share the machine's
  background load between the two arms.
- The read rate is paced, not flat out: the total rate (``--rate``, reads per second) is by
  default calibrated on the first database so the service process stays at about
  ``--cpu-target`` cores (one Python process, so one core is its ceiling), and is reused for
  the second. The figures say what was achieved: read rate, read p50/p99, and the service's,
  the readers' and the machine's CPU (from ``/proc``).
- Every tick is measured inside the service by a probe this file installs before the service
  starts (nothing in ``src/`` changes), two ways. By phase (``phases_*``): waiting for a pooled
  connection, ``BEGIN IMMEDIATE`` (``write_lock``: SQLite's write lock; PostgreSQL has no such
  statement, its row-lock waits would be inside ``statements``), the other statements, the
  commit, the pure market's ``tick``, and the ORM/Python rest. By the tick thread's state
  (``states_*``, from ``/proc/self/task/<tid>/schedstat``): on a CPU, runnable but queued for a
  core (the machine's CPU contention), and blocked (the GIL, I/O, locks); each phase's blocked
  share too (``phases_blocked_*``: in ``market``, pure computing, blocked is the GIL held by
  another thread), and ``gc``, the garbage collections (any thread's) during the tick. On
  SQLite the probe also logs the other threads' write transactions (``BEGIN IMMEDIATE`` to
  their end: ``other_write_transactions``) and which of them held the write lock when a tick
  asked for it (``write_lock_held_by_another_thread``). The service's own tick histogram
  (``/metrics``) checks the probe over the same span.

    python benchmarks/reads.py [--quick] [--bids 3000] [--readers 100] [--seconds 60]
        [--rate R] [--databases sqlite,postgresql] [--service-gc freeze]

``--service-gc freeze`` was the experiment behind the service's own ``gc.freeze()`` at start-up
(now always done). ``--public-cache 0`` turns off the service's one-answer-per-tick cache of the
anonymous views (service/public_cache.py): the same readers, every read a database read.

Prints one JSON object; ``ratios`` are readers/idle (the issue's target: tick p99 at most 1.5x).
Needs PostgreSQL at SPOTGPU_TEST_POSTGRES_URL (default: local ``test``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import sqlalchemy as sa

from prefect_spotgpu.api_client import tls

TICK_LOG_ENV = "SPOTGPU_BENCH_TICK_LOG"
GC_ENV = "SPOTGPU_BENCH_GC"
TARGET_RATIO = 1.5
PHASES = ("pool_wait", "write_lock", "statements", "commit", "market", "python")
STATES = ("on_cpu", "cpu_queue", "blocked")
TRIAL_RATE = 20.0  # reads per second while calibrating
SETTLE_SECONDS = 1.5  # a block's first seconds are not measured: the last reads drain
CLOCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- inside the service process


class TickProbe:
    """Times each tick of the leader and its parts, in the service process, from outside the
    service's code: SQLAlchemy events and wrappers installed before the app starts.

    Each part of a tick is timed twice: its wall time, and how much of that the tick thread was
    blocked (neither on a CPU nor queued for one: the GIL, I/O, a lock). Only the tick thread,
    inside ``Ticker.tick``, is timed; other threads' statements pass through one ``if``, except
    their SQLite write transactions (``BEGIN IMMEDIATE`` to commit or rollback), whose holding
    times are logged too, so a tick that waits for the write lock can name the holder. One JSON
    line per tick, and per other thread's write transaction, goes to ``SPOTGPU_BENCH_TICK_LOG``.
    """

    def __init__(self, sink) -> None:
        self.sink, self.sink_lock = sink, threading.Lock()
        self.ident: int | None = None  # the tick thread, while it is inside a tick
        self.parts: dict[str, float] = {}
        self.holders: list[str] = []  # who held the write lock when the tick asked for it
        self.statement: tuple[float, float, float] | None = None
        self.schedstat: int | None = None  # the tick thread's /proc/.../schedstat, open
        self.gc_seconds = [0.0, 0.0, 0.0]  # by generation, any thread's (GIL held throughout)
        self.gc_started = 0.0
        self.holds: dict[int, tuple[float, float, str]] = {}  # thread -> write transaction

    def write(self, record: dict) -> None:
        with self.sink_lock:
            self.sink.write(json.dumps(record) + "\n")

    def sched(self) -> tuple[float, float]:
        """(on a CPU, runnable but waiting for one): seconds, for the calling tick thread."""
        if self.schedstat is None:
            path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
            self.schedstat = os.open(path, os.O_RDONLY)
        on_cpu, waiting = os.pread(self.schedstat, 128, 0).split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9

    def span(self) -> tuple[float, float, float]:
        return (time.perf_counter(), *self.sched())

    def end(self, part: str, span: tuple[float, float, float]) -> None:
        wall = time.perf_counter() - span[0]
        on_cpu, queued = self.sched()
        self.add(part, wall)
        self.add(part + "_blocked", max(0.0, wall - (on_cpu - span[1]) - (queued - span[2])))

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_started = time.perf_counter()
        else:
            self.gc_seconds[info["generation"]] += time.perf_counter() - self.gc_started

    def mine(self) -> bool:
        return self.ident is not None and threading.get_ident() == self.ident

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def attach(self, engine) -> None:
        def before(conn, cursor, statement, parameters, context, executemany) -> None:
            if self.mine():
                if statement.startswith("BEGIN"):
                    self.holders = sorted(name for _, _, name in self.holds.values())
                self.statement = self.span()

        def after(conn, cursor, statement, parameters, context, executemany) -> None:
            if self.mine():
                part = "write_lock" if statement.startswith("BEGIN") else "statements"
                self.end(part, self.statement)
                self.add("statement_count", 1)
            elif statement.startswith("BEGIN IMMEDIATE"):
                thread = threading.current_thread().name
                self.holds[threading.get_ident()] = (time.time(), time.perf_counter(), thread)

        sa.event.listen(engine, "before_cursor_execute", before)
        sa.event.listen(engine, "after_cursor_execute", after)
        engine.raw_connection = self.timed(engine.raw_connection, "pool_wait")
        engine.dialect.do_commit = self.timed(engine.dialect.do_commit, "commit", ends=True)
        engine.dialect.do_rollback = self.timed(engine.dialect.do_rollback, "commit", ends=True)

    def timed(self, function, part: str, ends: bool = False):
        def wrapper(*args, **kwargs):
            if self.mine():
                span = self.span()
                try:
                    return function(*args, **kwargs)
                finally:
                    self.end(part, span)
            hold = self.holds.pop(threading.get_ident(), None) if ends else None
            try:
                return function(*args, **kwargs)
            finally:
                if hold is not None:
                    seconds = time.perf_counter() - hold[1]
                    thread = re.sub(r"[_ ]\d+$", "", hold[2])
                    self.write(
                        {"kind": "hold", "at": hold[0], "seconds": seconds, "thread": thread}
                    )

        return wrapper

    def install(self) -> None:
        from prefect_spotgpu.market import Market
        from prefect_spotgpu.service.ticker import Ticker

        probe = self
        ticker_init, ticker_tick, market_tick = Ticker.__init__, Ticker.tick, Market.tick

        def init(ticker, settings, engine, *args, **kwargs):
            ticker_init(ticker, settings, engine, *args, **kwargs)
            probe.attach(engine)
            if os.environ.get(GC_ENV) == "freeze":  # the experiment: startup's objects frozen
                gc.collect()
                gc.freeze()

        def tick(ticker, now):
            probe.parts, probe.holders, probe.ident = {}, [], threading.get_ident()
            at, gc0, span = time.time(), list(probe.gc_seconds), probe.span()
            ok = False
            try:
                decision = ticker_tick(ticker, now)
                ok = True
                return decision
            finally:
                wall = time.perf_counter() - span[0]
                on_cpu, queued = (b - a for a, b in zip(span[1:], probe.sched(), strict=True))
                blocked = max(0.0, wall - on_cpu - queued)
                probe.ident = None
                parts, timed = probe.parts, [p for p in PHASES if p != "python"]
                probe.write(
                    {
                        "at": at,
                        "ok": ok,
                        "wall": wall,
                        "service": ticker.tick_seconds_last if ok else None,
                        "on_cpu": on_cpu,
                        "cpu_queue": queued,
                        "blocked": blocked,
                        **{p: parts.get(p, 0.0) for p in timed},
                        "python": max(0.0, wall - sum(parts.get(p, 0.0) for p in timed)),
                        **{f"{p}_blocked": parts.get(f"{p}_blocked", 0.0) for p in timed},
                        "python_blocked": max(
                            0.0, blocked - sum(parts.get(f"{p}_blocked", 0.0) for p in timed)
                        ),
                        "gc": sum(probe.gc_seconds) - sum(gc0),
                        "gc_full": probe.gc_seconds[2] - gc0[2],
                        "write_lock_holders": probe.holders,
                        "statement_count": int(parts.get("statement_count", 0)),
                    }
                )

        def clear(market, now):
            if not probe.mine():
                return market_tick(market, now)
            span = probe.span()
            try:
                return market_tick(market, now)
            finally:
                probe.end("market", span)

        Ticker.__init__, Ticker.tick, Market.tick = init, tick, clear
        gc.callbacks.append(self.on_gc)


def serve_probed(argv: list[str]) -> None:
    """The service's own ``spotgpu server start``, with the tick probe installed first."""
    TickProbe(open(os.environ[TICK_LOG_ENV], "a", buffering=1)).install()  # noqa: SIM115
    from prefect_spotgpu.cli.app import app

    app(args=["server", "start", *argv], prog_name="spotgpu")


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:  # the service: no test helpers in it
    serve_probed(sys.argv[2:])
    sys.exit(0)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api import ADMIN_KEY, fill, free_port, new_database, stop  # noqa: E402

# ---------------------------------------------------------------- the benchmark process


def start(
    db_url: str, home: Path, tick_log: Path, gc_mode: str, *, leader: bool = True
) -> tuple[subprocess.Popen, str]:
    """``api.start``'s service, through this file's probe, billing every tick; with ``leader``
    false an API replica that never ticks (``SPOTGPU_RUN_TICKER=false``)."""
    port = free_port()
    env = {
        **os.environ,
        "SPOTGPU_ADMIN_KEY": ADMIN_KEY,
        "SPOTGPU_HOME": str(home),
        "SPOTGPU_CHARGE_FLUSH_SECONDS": "1",
        "SPOTGPU_HEARTBEAT_TIMEOUT_SECONDS": "86400",  # declared nodes send no heartbeats
        TICK_LOG_ENV: str(tick_log),
        GC_ENV: gc_mode,
        "SPOTGPU_RUN_TICKER": "true" if leader else "false",
    }
    args = ["--db", db_url, "--port", str(port), "--tick-seconds", "1", "--log-level", "warning"]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            health = httpx.get(root + "/api/v1/health", timeout=2, verify=tls())
            if health.status_code == 200 and (health.json().get("leader") or not leader):
                return proc, root
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("service did not start")


def wait_for_ticks(root: str, tick_log: Path, ticks: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(root + "/api/v1/health", timeout=30, verify=tls()).json()["ticks"] < ticks:
        records = map(json.loads, tick_log.read_text().splitlines())
        failed = sum(1 for r in records if r.get("kind") is None and not r["ok"])
        if failed >= 3 or time.monotonic() > deadline:
            raise RuntimeError(f"the leader does not tick ({failed} failed ticks): see its log")
        time.sleep(0.1)


def seed_history(url: str, days: float) -> int:
    """Minute bars for every pool ``fill`` makes, up to the minute before now."""
    minutes = int(days * 1440)
    if minutes == 0:
        return 0
    engine = sa.create_engine(url)
    now = int(time.time() // 60)
    rng = np.random.default_rng(minutes)
    bars = sa.table(
        "price_bars",
        *(sa.column(c) for c in ("gpu_model", "region", "minute", "open", "high", "low", "close")),
    )
    rows = []
    for region in ("eu-west", "us-east"):
        closes = np.clip(1.4 + np.cumsum(rng.normal(0, 0.01, minutes)), 0.9, 2.1).round(4)
        rows += [
            {"gpu_model": "A100-80G", "region": region, "minute": now - minutes + i,
             "open": c, "high": c, "low": c, "close": c}
            for i, c in enumerate(closes.tolist())
        ]  # fmt: skip
    with engine.begin() as c:
        c.execute(sa.insert(bars), rows)
    engine.dispose()
    return len(rows)


def reads_for(model: str, region: str) -> dict[str, str]:
    """The anonymous reads of one dashboard refresh (static/app.js), for a selected pool."""
    pool = f"/api/v1/prices/{model}/{region}"
    return {
        "market nodes": "/api/v1/market/nodes",
        "quotes": "/api/v1/prices",
        "stream snapshot": "/api/v1/stream?once=true",
        "order book": f"/api/v1/market/depth/{model}/{region}?capacity=spot",
        "history 24 h": f"{pool}/history?hours=24",
        "forecast": f"{pool}/forecast?hours=6",
        "health": "/api/v1/health",
    }


class Readers:
    """``n`` readers on their own connections, in one asyncio loop on a thread: each sends one
    read, waits for the answer, thinks ``think`` seconds, and again; while ``active`` is clear
    they only think, so their phases stay spread and a block starts at full rate."""

    def __init__(self, root: str, n: int, think: float) -> None:
        self.root, self.n, self.think = root, n, think
        self.active, self.ready, self.done = threading.Event(), threading.Event(), threading.Event()
        self.samples: list[tuple[float, str, float, bool]] = []  # (sent at, read, seconds, ok)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Readers:
        self.thread.start()
        if not self.ready.wait(120):
            raise RuntimeError("the readers did not connect")
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=60)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        clients = [  # plain HTTP: no certificate store to load 100 times
            httpx.AsyncClient(base_url=self.root, timeout=60, limits=limits, verify=False)
            for _ in range(self.n)
        ]
        try:
            await asyncio.gather(*(c.get("/api/v1/health") for c in clients))  # connected
            self.ready.set()
            await asyncio.gather(*(self._reader(i, c) for i, c in enumerate(clients)))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    async def _reader(self, i: int, client: httpx.AsyncClient) -> None:
        rng = np.random.default_rng(i)
        region = ("eu-west", "us-east")[i % 2]
        paths = list(reads_for("A100-80G", region).items())
        k = int(rng.integers(len(paths)))
        think = self.think
        await asyncio.sleep(float(rng.uniform(0, think)))
        while not self.done.is_set():
            if self.think != think:  # a new rate: a new phase, so the readers stay spread
                think = self.think
                await asyncio.sleep(float(rng.uniform(0, think)))
            if self.active.is_set():
                name, path = paths[k % len(paths)]
                k += 1
                at, started = time.time(), time.perf_counter()
                try:
                    ok = (await client.get(path)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.samples.append((at, name, time.perf_counter() - started, ok))
            await asyncio.sleep(think)


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class Meter:
    """CPU of the service, of this process (the readers) and of the machine over a span."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t, self.service, self.client, self.machine = (
            time.monotonic(), cpu_seconds(pid), cpu_seconds("self"), machine_busy(),
        )  # fmt: skip

    def read(self) -> dict:
        elapsed = time.monotonic() - self.t
        busy, total = machine_busy()
        return {
            "service_cpu_cores": round((cpu_seconds(self.pid) - self.service) / elapsed, 3),
            "readers_cpu_cores": round((cpu_seconds("self") - self.client) / elapsed, 3),
            "machine_cpu_busy": round(
                (busy - self.machine[0]) / max(1, total - self.machine[1]), 3
            ),
        }


def tick_histogram(root: str) -> tuple[float, float]:
    """(sum, count) of the service's own ``spotgpu_tick_duration_seconds``."""
    text = httpx.get(root + "/metrics", timeout=30).text
    found = {
        m[1]: float(m[2])
        for m in re.finditer(r"^spotgpu_tick_duration_seconds_(sum|count) (\S+)$", text, re.M)
    }
    return found.get("sum", 0.0), found.get("count", 0.0)


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize_ticks(ticks: list[dict], spans: list[tuple]) -> dict:
    wall = np.array([t["service"] for t in ticks])
    slow = [t for t in ticks if t["service"] >= pct(wall, 95)]

    def mean_ms(rows, key):
        return round(float(np.mean([r[key] for r in rows])) * 1000, 2) if rows else None

    def p99_ms(key):
        return round(pct([t[key] for t in ticks], 99) * 1000, 2)

    intervals = [  # from one tick's start to the next's, within a block
        b["at"] - a["at"]
        for s in spans
        for a, b in itertools.pairwise([t for t in ticks if s[1] <= t["at"] < s[2]])
    ]
    contended = [t for t in ticks if t["write_lock_holders"]]
    return {
        "ticks": len(ticks),
        "tick_p50_s": round(pct(wall, 50), 4),
        "tick_p99_s": round(pct(wall, 99), 4),
        "tick_max_s": round(float(wall.max()), 4),
        "tick_mean_s": round(float(wall.mean()), 4),
        "phases_mean_ms": {p: mean_ms(ticks, p) for p in PHASES},
        "phases_blocked_mean_ms": {p: mean_ms(ticks, f"{p}_blocked") for p in PHASES},
        "phases_p99_ms": {p: p99_ms(p) for p in PHASES},
        "slowest_5pct_phases_mean_ms": {p: mean_ms(slow, p) for p in PHASES},
        "states_mean_ms": {p: mean_ms(ticks, p) for p in STATES},
        "slowest_5pct_states_mean_ms": {p: mean_ms(slow, p) for p in STATES},
        "gc_during_tick_mean_ms": mean_ms(ticks, "gc"),
        "gc_during_tick_p99_ms": p99_ms("gc"),
        "full_gc_during_tick_mean_ms": mean_ms(ticks, "gc_full"),
        "write_lock_held_by_another_thread": {
            "ticks": len(contended),
            "holders": dict(
                collections.Counter(h for t in contended for h in t["write_lock_holders"])
            ),
            "write_lock_mean_ms_then": mean_ms(contended, "write_lock"),
            "write_lock_mean_ms_otherwise": mean_ms(
                [t for t in ticks if not t["write_lock_holders"]], "write_lock"
            ),
        },
        "statements_per_tick": round(float(np.mean([t["statement_count"] for t in ticks])), 1),
        "tick_interval_p99_s": round(pct(intervals, 99), 3) if intervals else None,
    }


def summarize_holds(holds: list[dict], seconds: float) -> dict:
    """Other threads' SQLite write transactions (``BEGIN IMMEDIATE`` to its end), by thread."""
    out = {}
    for thread in sorted({h["thread"] for h in holds}):
        ms = [h["seconds"] * 1000 for h in holds if h["thread"] == thread]
        out[thread] = {
            "per_second": round(len(ms) / seconds, 2),
            "p50_ms": round(pct(ms, 50), 2),
            "p99_ms": round(pct(ms, 99), 2),
            "max_ms": round(max(ms), 2),
        }
    return out


def summarize_reads(samples: list[tuple], seconds: float, readers: int, think: float) -> dict:
    ms = np.array([s[2] for s in samples]) * 1000
    by_name: dict[str, list[float]] = {}
    for _, name, secs, _ in samples:
        by_name.setdefault(name, []).append(secs * 1000)
    return {
        "readers": readers,
        "think_s": round(think, 3),
        "achieved_reads_per_second": round(len(samples) / seconds, 1),
        "read_p50_ms": round(pct(ms, 50), 2),
        "read_p99_ms": round(pct(ms, 99), 2),
        "errors": sum(1 for s in samples if not s[3]),
        "p50_ms_by_read": {k: round(pct(v, 50), 2) for k, v in sorted(by_name.items())},
    }


def load_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(the ticks that committed, other threads' write transactions) from the probe's log."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ticks = [r for r in records if r.get("kind") is None and r["ok"]]
    return ticks, [r for r in records if r.get("kind") == "hold"]


def calibrate(proc, readers: Readers, seconds: float, cpu_target: float):
    """The total read rate that keeps the service at about ``cpu_target`` cores, from its CPU
    idle and at the readers' current (trial) rate."""
    idle = Meter(proc.pid)
    time.sleep(seconds)
    idle_cores = idle.read()["service_cpu_cores"]
    before, meter = len(readers.samples), Meter(proc.pid)
    readers.active.set()  # at the trial's rate, from the start: the readers' phases are spread
    time.sleep(seconds)
    readers.active.clear()
    busy = meter.read()["service_cpu_cores"]
    elapsed = time.monotonic() - meter.t
    achieved = (len(readers.samples) - before) / elapsed
    per_read = max(1e-4, (busy - idle_cores) / max(achieved, 1e-9))
    rate = float(np.clip((cpu_target - idle_cores) / per_read, 5.0, 400.0))
    return rate, {
        "how": f"calibrated on the first database: its service at about {cpu_target} cores",
        "service_cpu_cores_idle": idle_cores,
        "trial_reads_per_second": round(achieved, 1),
        "service_cpu_cores_trial": busy,
        "cpu_ms_per_read": round(per_read * 1000, 2),
    }


def bench(kind: str, cfg: argparse.Namespace, rate: float | None) -> tuple[dict, float, dict]:
    home = Path(tempfile.mkdtemp())
    url, drop = new_database(kind, home)
    tick_log = home / "ticks.jsonl"
    try:
        fill(url, cfg.bids)
        bars = seed_history(url, cfg.history_days)
        proc, root = start(url, home, tick_log, cfg.service_gc)
        replica = None
        if cfg.split:  # the readers ask an API replica; the leader process only ticks
            replica = start(url, home, home / "replica.jsonl", cfg.service_gc, leader=False)
        read_root, read_proc = (replica[1], replica[0]) if replica else (root, proc)
        try:
            wait_for_ticks(root, tick_log, 3)  # the cold load, the tick that places all, a flush
            engine = sa.create_engine(url)
            with engine.connect() as c:
                running = c.execute(
                    sa.text("SELECT count(*), coalesce(sum(gpu_count), 0) FROM allocations "
                            "WHERE status = 'running'")
                ).one()  # fmt: skip
            engine.dispose()
            with Readers(
                read_root, cfg.readers, think=cfg.readers / (rate or TRIAL_RATE)
            ) as readers:
                how: dict = {}
                if rate is None:
                    rate, how = calibrate(read_proc, readers, cfg.calibrate, cfg.cpu_target)
                    readers.think = cfg.readers / rate
                    time.sleep(readers.think)  # every reader on the new think time, spread
                hist0, since = tick_histogram(root), time.time()
                blocks = []
                for i in range(2 * max(1, round(cfg.seconds / cfg.block))):
                    arm = ("idle", "readers")[i % 2]
                    settle = min(SETTLE_SECONDS, cfg.block / 2)
                    meter = Meter(proc.pid)
                    if arm == "readers":
                        readers.active.set()
                    start_at = time.time()
                    time.sleep(cfg.block)
                    readers.active.clear()
                    blocks.append((arm, start_at + settle, time.time(), meter.read()))
                time.sleep(1.5)  # the last tick written, the last reads answered
                until, hist1 = time.time(), tick_histogram(root)
        finally:
            stop(proc)
            if replica:
                stop(replica[0])
        ticks, holds = load_log(tick_log)
        out: dict = {
            "book": {
                "nodes": cfg.bids // 10,
                "open_bids": cfg.bids,
                "running_allocations": int(running[0]),
                "gpus_running": int(running[1]),
                "price_bars": bars,
            }
        }
        for arm in ("idle", "readers"):
            spans = [b for b in blocks if b[0] == arm]
            mine = [t for t in ticks if any(s[1] <= t["at"] < s[2] for s in spans)]
            summary = summarize_ticks(mine, spans)
            seconds = sum(s[2] - s[1] for s in spans)
            cpu = {k: round(float(np.mean([s[3][k] for s in spans])), 3) for k in spans[0][3]}
            summary.update(cpu)
            if kind == "sqlite":
                summary["other_write_transactions"] = summarize_holds(
                    [h for h in holds if any(s[1] <= h["at"] < s[2] for s in spans)], seconds
                )
            if arm == "readers":
                reads = [r for r in readers.samples if any(s[1] <= r[0] < s[2] for s in spans)]
                summary["reads"] = summarize_reads(reads, seconds, cfg.readers, readers.think)
            out[arm] = summary
        idle, busy = out["idle"], out["readers"]
        out["ratios"] = {
            "tick_p50": round(busy["tick_p50_s"] / idle["tick_p50_s"], 2),
            "tick_p99": round(busy["tick_p99_s"] / idle["tick_p99_s"], 2),
            "tick_mean": round(busy["tick_mean_s"] / idle["tick_mean_s"], 2),
            "target_tick_p99": TARGET_RATIO,
            "meets_target": busy["tick_p99_s"] <= TARGET_RATIO * idle["tick_p99_s"],
        }
        extra = busy["tick_mean_s"] - idle["tick_mean_s"]
        out["extra_tick_mean_ms"] = {  # readers minus idle
            "total": round(extra * 1000, 2),
            **{
                name: {p: round(busy[key][p] - idle[key][p], 2) for p in names}
                for name, key, names in (
                    ("by_phase", "phases_mean_ms", PHASES),
                    ("blocked_by_phase", "phases_blocked_mean_ms", PHASES),
                    ("by_state", "states_mean_ms", STATES),
                )
            },
            "gc": round(busy["gc_during_tick_mean_ms"] - idle["gc_during_tick_mean_ms"], 2),
            "full_gc": round(
                busy["full_gc_during_tick_mean_ms"] - idle["full_gc_during_tick_mean_ms"], 2
            ),
        }
        count = hist1[1] - hist0[1]
        probed = [t for t in ticks if since <= t["at"] + t["wall"] <= until]
        out["service_metric_check"] = {  # the probe against the service's own histogram
            "ticks_in_histogram": int(count),
            "ticks_probed": len(probed),
            "histogram_mean_s": round((hist1[0] - hist0[0]) / count, 4) if count else None,
            "probe_mean_s": round(float(np.mean([t["wall"] for t in probed])), 4),
        }
        return out, rate, how
    finally:
        drop()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke check")
    parser.add_argument("--bids", type=int, default=None, help="open bids (nodes: a tenth)")
    parser.add_argument("--readers", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per arm")
    parser.add_argument("--block", type=float, default=None, help="seconds per block")
    parser.add_argument("--rate", type=float, default=None, help="total reads per second")
    parser.add_argument("--cpu-target", type=float, default=0.5, help="service cores to aim at")
    parser.add_argument("--calibrate", type=float, default=None, help="seconds per trial")
    parser.add_argument("--history-days", type=float, default=None)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument(
        "--split",
        action="store_true",
        help="readers on an API replica (SPOTGPU_RUN_TICKER=false), the leader in a process "
        "of its own: DESIGN's deployment at scale",
    )
    parser.add_argument(
        "--public-cache",
        type=float,
        default=None,
        help="the service's public_cache_seconds (0: every read goes to the database; "
        "default: the service's own, one tick)",
    )
    parser.add_argument(
        "--service-gc",
        choices=("default", "freeze"),
        default="default",
        help="an experiment: freeze: gc.freeze() in the service once it has started",
    )
    cfg = parser.parse_args()
    if cfg.public_cache is not None:  # the service processes inherit it
        os.environ["SPOTGPU_PUBLIC_CACHE_SECONDS"] = str(cfg.public_cache)
    defaults = (
        {"bids": 500, "seconds": 8, "block": 4, "calibrate": 2, "history_days": 0.25}
        if cfg.quick
        else {"bids": 3000, "seconds": 60, "block": 15, "calibrate": 8, "history_days": 2}
    )
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    started = time.monotonic()
    out: dict = {
        "benchmark": "reads",
        "quick": cfg.quick,
        "config": {
            "open_bids": cfg.bids,
            "nodes": cfg.bids // 10,
            "readers": cfg.readers,
            "measured_seconds_per_arm": cfg.seconds,
            "block_seconds": cfg.block,
            "tick_seconds": 1,
            "charge_flush_seconds": 1,
            "history_days": cfg.history_days,
            "cpu_target_cores": cfg.cpu_target,
            "service_gc": cfg.service_gc,
            "split": cfg.split,
            "public_cache_seconds": os.environ.get("SPOTGPU_PUBLIC_CACHE_SECONDS", "1 (default)"),
            "cores": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }
    rate, kinds = cfg.rate, cfg.databases.split(",")
    out["read_rate"] = {"reads_per_second": rate, "how": "--rate", "used_for": kinds}
    for kind in kinds:
        result, chosen, how = bench(kind, cfg, rate)
        if rate is None:
            out["read_rate"] = {"reads_per_second": round(chosen, 1), **how, "used_for": kinds}
        rate = chosen
        out[kind] = result
        print(json.dumps({kind: result["ratios"]}), file=sys.stderr)
    out["summary"] = {
        kind: {
            "tick_p50_idle_s": out[kind]["idle"]["tick_p50_s"],
            "tick_p50_readers_s": out[kind]["readers"]["tick_p50_s"],
            "tick_p99_idle_s": out[kind]["idle"]["tick_p99_s"],
            "tick_p99_readers_s": out[kind]["readers"]["tick_p99_s"],
            **out[kind]["ratios"],
            "reads_per_second": out[kind]["readers"]["reads"]["achieved_reads_per_second"],
            "read_p99_ms": out[kind]["readers"]["reads"]["read_p99_ms"],
            "service_cpu_cores": out[kind]["readers"]["service_cpu_cores"],
        }
        for kind in kinds
    }
    out["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
