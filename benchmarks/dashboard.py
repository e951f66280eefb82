"""Dashboard and metrics benchmark: what the page's reads and a Prometheus scrape cost, side by
side with the cheapest read of the API, on a loaded market, for SQLite and PostgreSQL.

With ``--bids`` open bids stored (and one node of 8 GPUs per 10 bids), against the service
running as its own process on a loopback port:

- ``reads``: p50/p99 latency of each read the dashboard makes on every live update
  (``/prices``, ``/market/nodes``, ``/market/depth/...``, a day of minute history) and of
  ``/metrics``, each against ``/health`` (the cheapest route: the ratio is what the read adds);
- ``page``: bytes of the page, its script and its style sheet (no other host is contacted);
- ``stream``: seconds from a bid's creation to the first server-sent event after it (what a
  viewer waits for the page to show it), against the stream's 2 s ceiling; the leader ticks
  every second and the stream speaks as soon as a tick changes a quote.

    python benchmarks/dashboard.py [--bids 10000] [--samples 50]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api import ADMIN_KEY, fill, new_database, start, stop

READS = {
    "health (baseline)": "/api/v1/health",
    "prices": "/api/v1/prices",
    "market nodes": "/api/v1/market/nodes",
    "order book": "/api/v1/market/depth/A100-80G/eu-west",
    "history 24 h": "/api/v1/prices/A100-80G/eu-west/history?hours=24",
    "metrics scrape": "/metrics",
}


def timed(client: httpx.Client, path: str, samples: int) -> dict:
    client.get(path).raise_for_status()  # warm
    ms = []
    for _ in range(samples):
        t0 = time.perf_counter()
        response = client.get(path)
        ms.append((time.perf_counter() - t0) * 1000)
        response.raise_for_status()
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "bytes": len(response.content),
    }


def stream_delay(root: str, key: str, trials: int) -> dict:
    """Seconds from a bid's creation (its 201) to the next ``market`` event on the stream."""
    events: list[float] = []
    stop_reading = threading.Event()

    def read() -> None:
        with (
            httpx.Client(timeout=None) as client,
            client.stream("GET", root + "/api/v1/stream") as response,
        ):
            for line in response.iter_lines():
                if line.startswith("event: market"):
                    events.append(time.monotonic())
                if stop_reading.is_set():
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(3)
    delays = []
    rng = np.random.default_rng(7)
    with httpx.Client(base_url=root + "/api/v1", headers={"Authorization": f"Bearer {key}"}) as c:
        for i in range(trials):
            body = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 0.5 + i / 1000}
            c.post("/bids", json=body).raise_for_status()
            created = time.monotonic()
            deadline = created + 10
            while time.monotonic() < deadline and not any(t > created for t in events):
                time.sleep(0.01)
            delays.append(min(t for t in events if t > created) - created)
            time.sleep(float(rng.uniform(0, 2)))  # creations at random points of the cycle
    stop_reading.set()
    return {
        "trials": trials,
        "p50_s": round(statistics.median(delays), 3),
        "max_s": round(max(delays), 3),
        "ceiling_s": 2.0,
    }


def bench(kind: str, bids: int, samples: int) -> dict:
    home = Path(tempfile.mkdtemp())
    url, drop = new_database(kind, home)
    try:
        fill(url, bids)
        proc, base = start(url, home)
        root = base.removesuffix("/api/v1")
        try:
            time.sleep(3)  # a few ticks: quotes and bars written
            with httpx.Client(base_url=root, timeout=60) as client:
                reads = {name: timed(client, path, samples) for name, path in READS.items()}
                base_ms = reads["health (baseline)"]["p50_ms"]
                for figures in reads.values():
                    figures["vs_baseline"] = round(figures["p50_ms"] / base_ms, 2)
                page = {
                    name: len(client.get(f"/dashboard{suffix}").content)
                    for name, suffix in (
                        ("html", ""), ("js", "/app.js"), ("gangs_js", "/gangs.js"),
                        ("css", "/app.css"),
                    )
                }  # fmt: skip
                admin = httpx.Client(
                    base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
                )
                key = admin.post("/tenants", json={"name": "viewer"}).json()["api_key"]
            return {
                "book": {"open_bids": bids, "nodes": bids // 10},
                "reads": reads,
                "page_bytes": page,
                "stream": stream_delay(root, key, trials=10),
            }
        finally:
            stop(proc)
    finally:
        drop()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bids", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    started = time.monotonic()
    out = {
        "benchmark": "dashboard",
        **{kind: bench(kind, args.bids, args.samples) for kind in ("sqlite", "postgresql")},
    }
    out["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
