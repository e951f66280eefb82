"""API benchmark: bids created per second over HTTP, latency, and tick time with a full book.

For SQLite and PostgreSQL side by side in one run:

- ``create``: C concurrent clients (keep-alive) create bids for S seconds against the service
  running as its own process on a loopback port; bids per second, p50/p99 latency;
- ``tick``: with 10,000 and 100,000 open bids stored (and 1 node of 8 GPUs per 10 bids), the
  leader's cold load time and its steady tick time (the service's own measurement, /health),
  against the pure market tick on the same book in memory (``market_only``), so the database's
  share is visible;
- ``profile``: where the time of one bid creation and of one tick goes (cProfile, in process).

- ``bulk``: bids per second through ``POST /bids/batch`` beside single bids, and single bids'
  latency while batches run (``--only bulk`` runs just this);

    python benchmarks/api.py [--seconds 5] [--clients 8] [--books 10000,100000] [--batch 100]

Prints one JSON object. Needs PostgreSQL at SPOTGPU_TEST_POSTGRES_URL (default: local ``test``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import sqlalchemy as sa

from prefect_spotgpu.api_client import tls

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import ADMIN_KEY, free_port, fresh_postgres_schema  # noqa: E402

POSTGRES = os.environ.get(
    "SPOTGPU_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def start(
    db_url: str, home: Path, tick: float = 1.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """The service as its own process (more ``SPOTGPU_*`` settings in ``env``); its API root."""
    port = free_port()
    env = {
        **os.environ,
        "SPOTGPU_ADMIN_KEY": ADMIN_KEY,
        "SPOTGPU_HOME": str(home),
        # one load tenant places every bid: the per-tenant cap is not what this measures
        "SPOTGPU_MAX_OPEN_BIDS_PER_TENANT": "1000000",
        **(env or {}),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect_spotgpu.cli",
            "server",
            "start",
            "--db",
            db_url,
            "--port",
            str(port),
            "--tick-seconds",
            str(tick),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/api/v1"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2, verify=tls()).json().get("leader"):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("service did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def new_database(kind: str, home: Path):
    if kind == "sqlite":
        return f"sqlite:///{home / 'bench.db'}", lambda: None
    return fresh_postgres_schema(POSTGRES)


JOB = {  # what the spot-gpu worker sends: the engine's command and its environment, sealed
    "command": ["python", "-m", "prefect_spotgpu.launch"],
    "env": {
        "PREFECT_API_URL": "http://prefect:4200/api",
        "PREFECT_API_KEY": "pnu_" + "x" * 36,
        "PREFECT__FLOW_RUN_ID": str(uuid.uuid4()),
        "SPOTGPU_CHECKPOINT_URL": "s3://bucket/checkpoints",
        "AWS_ACCESS_KEY_ID": "AKIA" + "X" * 16,
        "AWS_SECRET_ACCESS_KEY": "s" * 40,
        **{f"EXTRA_{i}": "v" * 64 for i in range(24)},  # about 2 KB in all
    },
}


def bench_create(kind: str, seconds: float, clients: int, job: dict | None = None) -> dict:
    home = Path(tempfile.mkdtemp())
    url, drop = new_database(kind, home)
    proc, base = start(url, home)
    try:
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        key = admin.post("/tenants", json={"name": "load", "starting_credit": 1e6}).json()
        latencies: list[float] = []
        errors = [0]
        lock = threading.Lock()
        end = time.monotonic() + seconds

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            local = []
            with httpx.Client(
                base_url=base, timeout=30, headers={"Authorization": f"Bearer {key['api_key']}"}
            ) as c:
                while time.monotonic() < end:
                    body = {
                        "gpu_model": "A100-80G",
                        "region": "eu-west",
                        "gpu_count": int(rng.choice([1, 2, 4, 8])),
                        "max_price": round(float(rng.uniform(0.9, 2.1)), 2),
                        "idempotency_key": uuid.uuid4().hex,
                    }
                    if job is not None:
                        body["job"] = job
                    t0 = time.perf_counter()
                    response = c.post("/bids", json=body)
                    local.append(time.perf_counter() - t0)
                    if response.status_code != 201:
                        with lock:
                            errors[0] += 1
            with lock:
                latencies.extend(local)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        ms = np.array(latencies) * 1000
        return {
            "bids_per_second": round(len(latencies) / elapsed, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "requests": len(latencies),
            "errors": errors[0],
            "clients": clients,
        }
    finally:
        stop(proc)
        drop()
        shutil.rmtree(home, ignore_errors=True)


def bench_bulk(
    kind: str, seconds: float, batch: int, job: dict | None = None, rate: float | None = None
) -> dict:
    """Bids per second through ``POST /bids/batch`` (one client, ``batch`` bids a request;
    flat out, or paced to ``rate`` bids/s), and the latency of single bids placed meanwhile by
    another tenant (one every 20 ms), against the same single bids with no batch running."""
    home = Path(tempfile.mkdtemp())
    url, drop = new_database(kind, home)
    proc, base = start(url, home)
    try:
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        keys = [
            admin.post("/tenants", json={"name": name, "starting_credit": 1e9}).json()["api_key"]
            for name in ("fan-out", "victim")
        ]
        rng = np.random.default_rng(batch)

        def body() -> dict:
            bid = {
                "gpu_model": "A100-80G",
                "region": "eu-west",
                "gpu_count": int(rng.choice([1, 2, 4, 8])),
                "max_price": round(float(rng.uniform(0.9, 2.1)), 2),
                "idempotency_key": uuid.uuid4().hex,
            }
            return bid if job is None else {**bid, "job": job}

        def singles(until: float) -> list[float]:
            latencies = []
            with httpx.Client(
                base_url=base, timeout=30, headers={"Authorization": f"Bearer {keys[1]}"}
            ) as c:
                while time.monotonic() < until:
                    t0 = time.perf_counter()
                    assert c.post("/bids", json=body()).status_code == 201
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)
            return latencies

        idle = singles(time.monotonic() + min(seconds, 3.0))
        placed, batch_latencies, during = [0], [], []
        end = time.monotonic() + seconds

        def bulk() -> None:
            with httpx.Client(
                base_url=base, timeout=60, headers={"Authorization": f"Bearer {keys[0]}"}
            ) as c:
                due = time.monotonic()
                while time.monotonic() < end:
                    bids = [body() for _ in range(batch)]
                    t0 = time.perf_counter()
                    response = c.post("/bids/batch", json={"bids": bids})
                    batch_latencies.append(time.perf_counter() - t0)
                    assert response.status_code == 201, response.text
                    placed[0] += batch
                    if rate:  # the next batch when this rate says so
                        due += batch / rate
                        time.sleep(max(0.0, due - time.monotonic()))

        ticks: list[float] = []

        def tick_times() -> None:  # the leader's own tick durations meanwhile (/health)
            seen = None
            while time.monotonic() < end:
                health = httpx.get(base + "/health", timeout=10, verify=tls()).json()
                if health["ticks"] != seen:
                    ticks.append(health["last_tick_seconds"])
                    seen = health["ticks"]
                time.sleep(0.1)

        loader = threading.Thread(target=bulk)
        sampler = threading.Thread(target=tick_times)
        started = time.monotonic()
        loader.start()
        sampler.start()
        during = singles(end)
        loader.join()
        sampler.join()
        elapsed = time.monotonic() - started
        ms = lambda xs, q: round(float(np.percentile(np.array(xs) * 1000, q)), 2)  # noqa: E731
        return {
            "bids_per_second": round(placed[0] / elapsed, 1),
            "batch": batch,
            "batch_p50_ms": ms(batch_latencies, 50),
            "batch_p99_ms": ms(batch_latencies, 99),
            "single_bid_during_bulk_p50_ms": ms(during, 50),
            "single_bid_during_bulk_p99_ms": ms(during, 99),
            "single_bid_idle_p99_ms": ms(idle, 99),
            "single_bids_during_bulk": len(during),
            "tick_seconds_max_during_bulk": round(max(ticks, default=0.0), 4),
        }
    finally:
        stop(proc)
        drop()
        shutil.rmtree(home, ignore_errors=True)


def fill(url: str, bids: int) -> None:
    """Store ``bids`` open bids and bids/10 nodes of 8 GPUs straight into a migrated database."""
    from prefect_spotgpu.service.db import make_engine, migrate

    engine = make_engine(url)
    migrate(engine)
    now = datetime.now(UTC)
    rng = np.random.default_rng(bids)
    with engine.begin() as c:
        tenants = sa.table(
            "tenants",
            sa.column("id"),
            sa.column("name"),
            sa.column("credits_micros"),
            sa.column("spent_micros"),
            sa.column("created_at"),
        )
        buyer, owner = (
            c.execute(
                sa.insert(tenants)
                .values(name=name, credits_micros=credits, spent_micros=0, created_at=now)
                .returning(tenants.c.id)
            ).scalar()
            for name, credits in (("load", 10**12), ("owner", 0))  # micros
        )
        nodes = [
            {
                "owner_id": owner,
                "name": f"n{i}",
                "gpu_model": "A100-80G",
                "region": ["eu-west", "us-east"][i % 2],
                "gpu_count": 8,
                "reserve_price": 0.9,
                "state": "live",
                "token_hash": f"h{i}",
                "declared": True,
                "last_heartbeat_at": now,
                "created_at": now,
            }
            for i in range(bids // 10)
        ]
        c.execute(sa.insert(sa.table("nodes", *(sa.column(k) for k in nodes[0]))), nodes)
        prices = np.round(rng.uniform(0.9, 2.1, bids), 2).tolist()
        sizes = rng.choice([1, 2, 4, 8], bids).tolist()
        rows = [
            {
                "tenant_id": buyer,
                "gpu_model": "A100-80G",
                "region": "any" if i % 10 == 0 else ["eu-west", "us-east"][i % 2],
                "gpu_count": sizes[i],
                "max_price": prices[i],
                "status": "open",
                "created_at": now,
                "updated_at": now,
            }
            for i in range(bids)
        ]
        c.execute(sa.insert(sa.table("bids", *(sa.column(k) for k in rows[0]))), rows)
    engine.dispose()


def bench_tick(kind: str, bids: int, samples: int = 10) -> dict:
    home = Path(tempfile.mkdtemp())
    url, drop = new_database(kind, home)
    try:
        fill(url, bids)
        t0 = time.monotonic()
        proc, base = start(url, home)
        while httpx.get(base + "/health", timeout=30, verify=tls()).json()["ticks"] < 1:
            time.sleep(0.05)
        first_tick = time.monotonic() - t0  # start, cold load, and the tick that places all
        try:
            ticks = []
            seen = None
            while len(ticks) < samples:
                health = httpx.get(base + "/health", timeout=10, verify=tls()).json()
                if health["ticks"] != seen and health["ticks"] > 2:
                    ticks.append(health["last_tick_seconds"])
                seen = health["ticks"]
                time.sleep(0.3)
            quotes = httpx.get(base + "/prices", timeout=10, verify=tls()).json()
        finally:
            stop(proc)
        return {
            "open_bids": bids,
            "nodes": bids // 10,
            "startup_to_first_tick_seconds": round(first_tick, 2),
            "steady_tick_seconds_median": round(statistics.median(ticks), 4),
            "steady_tick_seconds_max": round(max(ticks), 4),
            "gpus_running": sum(q["gpus_running"] for q in quotes),
        }
    finally:
        drop()
        shutil.rmtree(home, ignore_errors=True)


def market_only(bids: int) -> float:
    """The pure market's steady tick on a book of the same shape (no database)."""
    from prefect_spotgpu.market import Market, MarketConfig, Node

    rng = np.random.default_rng(bids)
    m = Market(MarketConfig(open_regions=True))
    for i in range(bids // 10):
        m.upsert_node(Node(i + 1, "A100-80G", ["eu-west", "us-east"][i % 2], 8, 0.9))
    for region in ("eu-west", "us-east", "any"):
        n = bids // 3
        m.add_bid_arrays(
            gpu_model="A100-80G",
            region=region,
            ids=np.arange(n) + {"eu-west": 0, "us-east": n, "any": 2 * n}[region],
            gpu_counts=rng.choice([1, 2, 4, 8], n),
            max_prices=np.round(rng.uniform(0.9, 2.1, n), 2),
            created_at=np.zeros(n),
        )
    m.tick(1.0)
    times = []
    for k in range(5):
        t0 = time.perf_counter()
        m.tick(2.0 + k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(kind: str) -> dict:
    """Top functions by own time for 300 bid creations and 20 ticks, in process."""
    from fastapi.testclient import TestClient

    from prefect_spotgpu.service.api import create_app
    from prefect_spotgpu.service.settings import ServiceSettings
    from prefect_spotgpu.service.ticker import Ticker

    home = Path(tempfile.mkdtemp())
    url, drop = new_database(kind, home)
    try:
        fill(url, 10_000)
        settings = ServiceSettings(db_url=url, home=home, admin_key=ADMIN_KEY)
        app = create_app(settings, background=False)
        out = {}
        with TestClient(app) as client:
            key = client.post(
                "/api/v1/tenants",
                json={"name": "p"},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            ).json()
            # the route's own work, in this thread: auth lookup, validation, insert, commit
            from fastapi import Response

            from prefect_spotgpu.service import roles, schemas
            from prefect_spotgpu.service.routes import bids

            sessions = app.state.sessions
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                tenant_id = roles._lookup(app.state.engine, key["api_key"]).tenant_id
                data = schemas.BidCreate.model_validate(
                    {"gpu_model": "A100-80G", "gpu_count": 2, "max_price": 1.5}
                )
                bids.create_bid(
                    data=data,
                    tenant_id=tenant_id,
                    db=sessions,
                    response=Response(),
                    request=SimpleNamespace(app=app),
                )
            prof.disable()
            out["create_bid"] = top(prof)
            ticker = Ticker(settings, app.state.engine, app.state.sessions)
            ticker.become_leader()
            ticker.tick(time.time())
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                ticker.tick(time.time())
            prof.disable()
            out["tick_10k"] = top(prof)
        return out
    finally:
        drop()
        shutil.rmtree(home, ignore_errors=True)


def top(prof: cProfile.Profile, n: int = 8) -> list[str]:
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    total = sum(v[2] for v in stats.stats.values())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [f"{v[2] / total:5.1%} {Path(k[0]).name}:{k[2]}" for k, v in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--books", default="10000,100000")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--batch", type=int, default=100, help="bids per POST /bids/batch")
    parser.add_argument(
        "--only", choices=["bulk"], help="only the bulk comparison (single bids vs batches)"
    )
    args = parser.parse_args()
    if args.only == "bulk":
        print(json.dumps(bulk_comparison(args), indent=2))
        return
    out: dict = {"benchmark": "api", "create": {}, "tick": {}, "market_only_tick_seconds": {}}
    out["bulk"] = bulk_comparison(args)
    for kind in ("sqlite", "postgresql"):
        out["create"][kind] = bench_create(kind, args.seconds, args.clients)
        print(json.dumps({kind: out["create"][kind]}), file=sys.stderr)
        with_job = bench_create(kind, args.seconds, args.clients, job=JOB)
        with_job["vs_plain"] = round(
            with_job["bids_per_second"] / out["create"][kind]["bids_per_second"], 3
        )
        out["create"][f"{kind}_with_sealed_job"] = with_job
        print(json.dumps({f"{kind}_with_sealed_job": with_job}), file=sys.stderr)
        out["tick"][kind] = []
        for bids in (int(b) for b in args.books.split(",")):
            out["tick"][kind].append(bench_tick(kind, bids))
            print(json.dumps(out["tick"][kind][-1]), file=sys.stderr)
    for bids in (int(b) for b in args.books.split(",")):
        out["market_only_tick_seconds"][str(bids)] = round(market_only(bids), 4)
    if not args.no_profile:
        out["profile"] = {kind: profile(kind) for kind in ("sqlite", "postgresql")}
    print(json.dumps(out, indent=2))


def bulk_comparison(args) -> dict:
    """Per database: single bids from C clients against batches from one, flat out (the target:
    at least 1,000 bids/s) and paced at 1,000 bids/s (the target: single bids' p99 at most 50 ms
    meanwhile)."""
    out: dict = {"benchmark": "api-bulk", "target": "bulk >= 1000 bids/s; single p99 <= 50 ms"}
    for kind in ("sqlite", "postgresql"):
        single = bench_create(kind, args.seconds, args.clients)
        bulk = bench_bulk(kind, args.seconds, args.batch)
        with_job = bench_bulk(kind, args.seconds, args.batch, job=JOB)
        paced = bench_bulk(kind, 2 * args.seconds, args.batch, rate=1000.0)
        out[kind] = {
            "single_bids": single,
            "batches": bulk,
            "batches_with_sealed_job": with_job,
            "batches_at_1000_per_second": paced,
            "bulk_vs_single": round(bulk["bids_per_second"] / single["bids_per_second"], 1),
            "met": bulk["bids_per_second"] >= 1000 and paced["single_bid_during_bulk_p99_ms"] <= 50,
        }
        print(json.dumps({kind: out[kind]}), file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
