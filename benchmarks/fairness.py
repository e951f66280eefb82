"""Fairness benchmark: can one tenant or anonymous client slow another tenant's requests?

The real service runs as its own process on a loopback port (SQLite), with 28 days of minute
price bars in ``--regions`` regions of one model and a node in each (declared, no heartbeats:
the heartbeat timeout is set beyond the run), so the tick writes a quote and a bar a minute per
pool as a live market does. A *victim* tenant makes ordinary authenticated reads one at a time
(``GET /bids`` and ``GET /bids/{id}``, alternately, ``--think`` seconds apart) and its median
and p90 latency are measured idle, then under each flood in turn, each flood from its own
process so that its client work does not share the victim's interpreter:

- ``long_polls``: one hostile tenant holds ``--long-polls`` concurrent ``GET /events`` long
  polls (25 s each, re-polled as each answers);
- ``streams``: ``--streams`` anonymous ``GET /stream`` connections, each read as it comes;
- ``estimates``: ``--estimates`` anonymous ``POST /estimate`` for ``region: any`` in parallel,
  each re-posted as soon as it is answered, and each with its own history window (``days``
  drawn anew each time), so that no two are answered from the same fitted forecast: every one
  the service admits costs a fresh fit of every region.

A refused request (429) is counted and retried after its ``Retry-After``, as the market's own
clients do; a client that ignores it is a plain request flood, which is not this benchmark's
subject. Each flood is given ``--ramp`` seconds to open its connections before the victim is
measured for ``--seconds``; then it is stopped and the service given a moment to drain.

    python benchmarks/fairness.py [--seconds 10] [--ramp 2] [--regions 6]

Prints one JSON object: ``idle`` and each flood's victim p50/p90, the p90's ratio to idle, and
the flood's admitted and refused (429) requests; ``met`` is the target, the victim's p90 under
every flood at most twice its idle p90. Loopback only; bounded in time (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))

import api
from api import ADMIN_KEY, stop

TARGET_RATIO = 2.0
MODEL = "A100-80G"


# ---------------------------------------------------------------- the market


def seed_history(url: str, regions: list[str], days: int) -> int:
    """``days`` of minute bars in each region (a random walk with a daily cycle), up to the
    minute before now; the number of bars."""
    from prefect_spotgpu.service.db import make_engine, migrate

    engine = make_engine(url)
    migrate(engine)
    now = int(time.time() // 60)
    minutes = np.arange(now - days * 1440, now)
    rng = np.random.default_rng(days)
    bars = sa.table(
        "price_bars",
        *(sa.column(c) for c in ("gpu_model", "region", "minute", "open", "high", "low", "close")),
    )
    count = 0
    with engine.begin() as connection:
        for i, region in enumerate(regions):
            cycle = 0.25 * np.sin(2 * np.pi * (minutes / 1440 + i / len(regions)))
            walk = np.cumsum(rng.normal(0, 0.002, len(minutes)))
            closes = np.clip(1.3 + cycle + walk, 0.9, 2.1).round(4).tolist()
            connection.execute(
                sa.insert(bars),
                [
                    {"gpu_model": MODEL, "region": region, "minute": int(m), "open": c,
                     "high": c, "low": c, "close": c}
                    for m, c in zip(minutes.tolist(), closes, strict=True)
                ],
            )  # fmt: skip
            count += len(closes)
    engine.dispose()
    return count


def start(db_url: str, home: Path) -> tuple[subprocess.Popen, str]:
    """The service as its own process (its default fair-share settings, and no cap on open
    bids: the victim's own book is not what this measures); its API root."""
    return api.start(
        db_url,
        home,
        env={
            "SPOTGPU_HEARTBEAT_TIMEOUT_SECONDS": "86400",  # declared nodes send no heartbeats
            "SPOTGPU_MAX_OPEN_BIDS_PER_TENANT": "1000",
        },
    )


def setup(root: str, regions: list[str]) -> dict:
    """The tenants (victim, hostile, a provider) and the market: a node per region, and the
    victim's bids (below every reserve: they wait, and the victim reads them)."""
    admin = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {ADMIN_KEY}"})

    def tenant(name: str) -> tuple[int, str]:
        made = admin.post("/tenants", json={"name": name, "starting_credit": 1e6}).json()
        return made["id"], made["api_key"]

    (_, victim), (_, hostile), (owner_id, owner) = map(tenant, ("victim", "hostile", "owner"))
    admin.put(f"/tenants/{owner_id}/provider", json={"provider": True}).raise_for_status()
    provider = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {owner}"})
    for region in regions:
        node = {"name": f"n-{region}", "gpu_model": MODEL, "region": region, "gpu_count": 8,
                "capacity": "spot", "reserve_price": 0.9}  # fmt: skip
        provider.post("/nodes", json=node).raise_for_status()
    buyer = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {victim}"})
    bids = []
    for _ in range(5):
        body = {"gpu_model": MODEL, "gpu_count": 1, "max_price": 0.5}
        made = buyer.post("/bids", json=body)
        made.raise_for_status()
        bids.append(made.json()["id"])
    for client in (admin, provider, buyer):
        client.close()
    return {"victim": victim, "hostile": hostile, "bids": bids}


# ---------------------------------------------------------------- the victim


def victim_latencies(root: str, key: str, bids: list[int], seconds: float, think: float):
    """The victim's request latencies (ms) over ``seconds``, and its failures."""
    latencies, failures = [], 0
    paths = ["/bids"] + [f"/bids/{b}" for b in bids]
    end = time.monotonic() + seconds
    with httpx.Client(base_url=root, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        for i in itertools.count():
            if time.monotonic() >= end:
                break
            started = time.perf_counter()
            try:
                response = c.get(paths[0] if i % 2 == 0 else paths[1 + (i // 2) % len(bids)])
                failures += response.status_code != 200
            except httpx.HTTPError:  # counted at the time it took to fail
                failures += 1
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(think)
    return latencies, failures


def summary(latencies: list[float]) -> dict:
    ms = np.asarray(latencies)
    return {
        "victim_p50_ms": round(float(np.percentile(ms, 50)), 2),
        "victim_p90_ms": round(float(np.percentile(ms, 90)), 2),
        "victim_requests": len(latencies),
    }


# ---------------------------------------------------------------- the floods (own processes)


def flood(kind: str, root: str, key: str, count: int, stopping, counts) -> None:
    """Run ``count`` hostile clients of ``kind`` until ``stopping`` is set; ``counts``: shared
    (admitted, refused with 429, failed, in flight now: requests awaiting an answer or
    streams open)."""
    asyncio.run(_flood(kind, root, key, count, stopping, counts))


async def _flood(kind: str, root: str, key: str, count: int, stopping, counts) -> None:
    headers = {"Authorization": f"Bearer {key}"} if kind == "long_polls" else {}
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    client = httpx.AsyncClient(base_url=root, headers=headers, limits=limits, timeout=60)

    def add(index: int, by: int = 1) -> None:
        with counts.get_lock():
            counts[index] += by

    async def refused_or_failed(response: httpx.Response) -> None:
        if response.status_code == 429:
            add(1)
            await asyncio.sleep(float(response.headers.get("Retry-After", 1)))
        else:
            add(2)
            await asyncio.sleep(1)

    async def long_poll() -> None:
        cursor = 0
        while True:
            add(3)
            try:
                response = await client.get("/events", params={"after": cursor, "timeout": 25})
            finally:
                add(3, -1)
            if response.status_code == 200:
                add(0)
                cursor = response.json()["cursor"]
            else:
                await refused_or_failed(response)

    async def stream() -> None:
        while True:
            async with client.stream("GET", "/stream") as response:
                if response.status_code == 200:
                    add(0)
                    add(3)
                    try:
                        async for _ in response.aiter_lines():
                            pass
                    finally:
                        add(3, -1)
                else:
                    await response.aread()
                    await refused_or_failed(response)

    async def estimate() -> None:
        while True:
            body = {
                "gpu_model": MODEL, "region": "any", "gpu_hours": 200, "max_price": 1.2,
                "deadline": (datetime.now(UTC) + timedelta(days=7)).isoformat(),
            }  # fmt: skip
            days = round(random.uniform(14, 28), 3)  # a window of its own: no fit reused
            add(3)
            try:
                response = await client.post("/estimate", json=body, params={"days": days})
            finally:
                add(3, -1)
            if response.status_code == 200:
                add(0)
            else:
                await refused_or_failed(response)

    async def guarded(work) -> None:
        try:
            await work()
        except httpx.HTTPError:
            add(2)

    work = {"long_polls": long_poll, "streams": stream, "estimates": estimate}[kind]
    tasks = [asyncio.create_task(guarded(work)) for _ in range(count)]
    while not stopping.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()


def gauge_later(seconds: float, counts, into: list) -> None:
    """Append ``counts[3]`` (what the flood holds then) to ``into`` in ``seconds``."""
    threading.Timer(seconds, lambda: into.append(counts[3])).start()


# ---------------------------------------------------------------- the run


def run(args) -> dict:
    regions = [f"region-{i}" for i in range(args.regions)]
    home = Path(tempfile.mkdtemp(prefix="spotgpu-fairness-"))
    url = f"sqlite:///{home / 'bench.db'}"
    bars = seed_history(url, regions, args.days)
    proc, root = start(url, home)
    context = mp.get_context("spawn")
    try:
        market = setup(root, regions)
        with httpx.Client(base_url=root, timeout=120) as anonymous:  # one fit, uncached
            body = {"gpu_model": MODEL, "region": "any", "gpu_hours": 200, "max_price": 1.2,
                    "deadline": (datetime.now(UTC) + timedelta(days=7)).isoformat()}  # fmt: skip
            started = time.perf_counter()
            anonymous.post("/estimate", json=body, params={"days": 27.5}).raise_for_status()
            uncached = time.perf_counter() - started
        time.sleep(2)  # the anonymous bucket refills a little
        victim = (root, market["victim"], market["bids"])
        idle, failed = victim_latencies(*victim, args.seconds, args.think)
        result = {"idle": {**summary(idle), "victim_failures": failed}, "floods": {}}
        floods = {"long_polls": args.long_polls, "streams": args.streams,
                  "estimates": args.estimates}  # fmt: skip
        for kind, count in floods.items():
            stopping, counts = context.Event(), context.Array("q", 4)
            key = market["hostile"]
            hostile = context.Process(
                target=flood, args=(kind, root, key, count, stopping, counts), daemon=True
            )
            hostile.start()
            time.sleep(args.ramp)
            before = list(counts)
            in_flight: list[int] = []
            gauge_later(args.seconds / 2, counts, in_flight)
            latencies, failed = victim_latencies(*victim, args.seconds, args.think)
            during = [now - then for now, then in zip(counts, before, strict=True)]
            stopping.set()
            hostile.join(timeout=30)
            if hostile.is_alive():
                hostile.kill()
            measured = summary(latencies)
            result["floods"][kind] = {
                **measured,
                "p90_ratio_to_idle": round(
                    measured["victim_p90_ms"] / result["idle"]["victim_p90_ms"], 2
                ),
                "victim_failures": failed,
                "hostile_clients": count,
                "hostile_in_flight_mid_window": in_flight[0] if in_flight else None,
                "admitted": during[0],
                "refused_429": during[1],
                "failed": during[2],
                "admitted_whole_flood": counts[0],
                "refused_429_whole_flood": counts[1],
            }
            time.sleep(args.drain)
        again, _ = victim_latencies(*victim, args.seconds / 2, args.think)
        result["idle"]["victim_p90_ms_after_the_floods"] = summary(again)["victim_p90_ms"]
    finally:
        stop(proc)
        shutil.rmtree(home, ignore_errors=True)
    result["config"] = {
        "database": "sqlite",
        "regions": args.regions,
        "history_days": args.days,
        "price_bars": bars,
        "uncached_any_region_estimate_seconds": round(uncached, 3),
        "measured_seconds": args.seconds,
        "ramp_seconds": args.ramp,
        "victim_think_seconds": args.think,
        "cores": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    ratios = [f["p90_ratio_to_idle"] for f in result["floods"].values()]
    result["target"] = f"victim p90 <= {TARGET_RATIO:g}x idle p90"
    result["met"] = all(r <= TARGET_RATIO for r in ratios)
    return {"benchmark": "fairness", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="victim seconds per arm")
    parser.add_argument("--ramp", type=float, default=2.0, help="a flood's seconds to open")
    parser.add_argument("--drain", type=float, default=3.0, help="seconds after a flood")
    parser.add_argument("--think", type=float, default=0.02, help="victim's pause")
    parser.add_argument("--regions", type=int, default=6)
    parser.add_argument("--days", type=int, default=28)
    parser.add_argument("--long-polls", type=int, default=300)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--estimates", type=int, default=40)
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
