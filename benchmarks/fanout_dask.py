"""Dask fan-out benchmark: many short shards over ``SpotGPUCluster`` workers, with reclaims.

On a local stack (the market and 4 agents x 4 declared A100-80G, process runners; no Prefect
server: plain Dask), ``--shards`` shards of simulated GPU work (``time.sleep(--seconds)``, then
the output stored once with ``put_once``) run twice on one cluster of 16 workers:

- ``calm``: nothing happens to the nodes;
- ``troubled``: three nodes running workers are reclaimed (a notice: graceful retire) and one
  agent is killed with SIGKILL with its jobs (a lost node), at random moments.

Reported for each: makespan against the ideal (total work / 16 GPUs), GPU occupancy (billed
allocation-seconds / (GPUs x makespan)) and busy share (work / (GPUs x makespan)), per-shard
overhead, shards redone (begun more than once), spot cost against on-demand; and how fast
workers came (joined per second from ``scale(16)``). Targets: makespan <= 1.25 x ideal;
``troubled`` <= 1.10 x ``calm``; redone <= 1 shard per reclaim.

    python benchmarks/fanout_dask.py [--shards 10000] [--seconds 0.2]
    python benchmarks/fanout_dask.py --cells 100x0.2,100x2,1000x0.2,1000x2

``--cells`` runs each ``SHARDSxSECONDS`` cell (calm, then troubled) on the same stack and
cluster, and reports them as a list under ``cells``.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = str(ROOT / "tests")
sys.path.insert(0, TESTS)

AGENTS, GPUS_PER_AGENT = 4, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=0.2, help="GPU seconds per shard")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cells", default=None, help="SHARDSxSECONDS,... (a matrix of runs)")
    args = parser.parse_args()
    cells = (
        [(int(n), float(s)) for n, s in (c.split("x") for c in args.cells.split(","))]
        if args.cells
        else [(args.shards, args.seconds)]
    )
    home = Path(tempfile.mkdtemp(prefix="fanout-dask-bench-"))
    from distributed import Client

    from prefect_spotgpu.cli.stack import LocalStack
    from prefect_spotgpu.dask import SpotGPUCluster

    gpus = AGENTS * GPUS_PER_AGENT
    with LocalStack(home, heartbeat_timeout_seconds=3) as stack:
        stack.start_market()
        stack.nodes = {
            stack.start_agent(f"node-{i}", gpus=GPUS_PER_AGENT): f"node-{i}" for i in range(AGENTS)
        }
        cluster = SpotGPUCluster(
            market_url=stack.market_url, api_key=stack.buyer_key, gpu_model="A100-80G",
            max_price=1.5, env={"PYTHONPATH": TESTS}, poll_seconds=0.5,
        )  # fmt: skip
        client = Client(cluster)
        began = time.monotonic()
        cluster.scale(gpus)
        client.wait_for_workers(gpus, timeout=120)
        joined = time.monotonic() - began
        results = []
        for n, seconds in cells:
            args.shards, args.seconds = n, seconds
            runs = {
                tag: run(stack, client, cluster, f"{tag}-{n}x{seconds}", args, gpus, home)
                for tag in ("calm", "troubled")
            }
            results.append(cell(n, seconds, gpus, runs["calm"], runs["troubled"]))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        client.close()
        cluster.close()
    workers = {"count": gpus, "seconds_to_join": round(joined, 2),
               "per_second": round(gpus / joined, 2)}  # fmt: skip
    head = {"benchmark": "fanout_dask", "workers": workers}
    out = head | ({"cells": results} if args.cells else results[0])
    print(json.dumps(out, indent=2), flush=True)
    os._exit(0)


def cell(n: int, seconds: float, gpus: int, calm: dict, troubled: dict) -> dict:
    ideal = n * seconds / gpus
    out = {
        "config": {"shards": n, "shard_seconds": seconds, "gpus": gpus,
                   "agents": AGENTS, "cores": os.cpu_count(), "ideal_seconds": round(ideal, 2)},
        "calm": calm,
        "troubled": troubled,
        "troubled_vs_calm": round(troubled["makespan_seconds"] / calm["makespan_seconds"], 3),
        "targets": "makespan <= 1.25 x ideal; troubled <= 1.10 x calm; redone <= 1 per reclaim",
    }  # fmt: skip
    out["met"] = {
        "makespan_calm": calm["makespan_vs_ideal"] <= 1.25,
        "makespan_troubled": troubled["makespan_vs_ideal"] <= 1.25,
        "reclaims_add_at_most_10pct": out["troubled_vs_calm"] <= 1.10,
        "redone_per_reclaim": troubled["redone_after_notices"] <= troubled["reclaims"],
    }
    return out


def run(stack, client, cluster, tag: str, args, gpus: int, home: Path) -> dict:
    from distributed import as_completed

    from dask_tasks import read_log, run_shard
    from dask_trouble import Trouble

    n, log = args.shards, str(home / f"work-{tag}.log")
    done = [0]
    trouble = None
    if tag.startswith("troubled"):
        at = [(int(n * f), int(n * (f + 0.08))) for f in (0.15, 0.35, 0.55, 0.75)]
        plan = list(zip(("reclaim", "reclaim", "reclaim", "kill"), at, strict=True))
        trouble = Trouble(stack, lambda: done[0], plan, seed=args.seed, gpus=GPUS_PER_AGENT)
    before = set(cluster.bids_placed)
    bids_before = cost_of(cluster)
    client.wait_for_workers(gpus, timeout=120)
    started = time.monotonic()
    if trouble is not None:
        trouble.start()
    futures = client.map(run_shard, [str(home / "store")] * n, [tag] * n, range(n),
                         [args.seconds] * n, [log] * n, pure=False)  # fmt: skip
    # the outputs are in storage: each result (a digest) is let go once read, so a lost
    # worker's finished shards are not wanted again (a held result would be recomputed)
    for future in as_completed(_drain(futures)):
        future.result()
        done[0] += 1
    makespan = time.monotonic() - started
    if trouble is not None:
        trouble.done.set()
        trouble.join(timeout=120)
    cost = cost_of(cluster)
    billed = (cost["gpu_hours"] - bids_before["gpu_hours"]) * 3600
    begun, stored = read_log(log)
    killed_at = min(
        [at for at, w, _, _ in (trouble.log if trouble else []) if w == "kill"] or [1e18]
    )
    seen, redone_after_kill = set(), 0
    for shard, at in sorted(begun, key=lambda b: b[1]):
        redone_after_kill += shard in seen and at >= killed_at
        seen.add(shard)
    work = n * args.seconds
    ideal = work / gpus
    return {
        "makespan_seconds": round(makespan, 2),
        "makespan_vs_ideal": round(makespan / ideal, 3),
        "gpu_occupancy": round(min(billed, gpus * makespan) / (gpus * makespan), 3),
        "busy_share": round(work / (gpus * makespan), 3),
        "per_shard_overhead_ms": round(1000 * (gpus * makespan - work) / n, 2),
        "shards_begun": len(begun),
        "redone_shards": len(begun) - len({s for s, _ in begun}),
        "redone_after_notices": len(begun) - len(seen) - redone_after_kill,
        "redone_after_kill": redone_after_kill,
        "outputs_stored": len(stored),
        "outputs_stored_once": len(stored) == len(set(stored)) == n,
        "reclaims": 0 if trouble is None else sum(w == "reclaim" for _, w, _, _ in trouble.log),
        "kills": 0 if trouble is None else sum(w == "kill" for _, w, _, _ in trouble.log),
        "trouble_at_shards": [] if trouble is None else [(w, p) for _, w, _, p in trouble.log],
        "new_bids": len(set(cluster.bids_placed) - before),
        "cost_so_far": cost,
    }


def _drain(futures: list) -> list:
    """The futures, the caller's list emptied (``as_completed`` then holds the only
    references, and drops each as it yields it)."""
    taken = list(futures)
    futures.clear()
    return taken


def cost_of(cluster) -> dict:
    return cluster.cost_report()


if __name__ == "__main__":
    main()
