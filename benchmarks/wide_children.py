"""A wide fan-out of child flow runs: N shards of simulated GPU work, as ``fanout.py --wide``
runs it (one JSON object there).

Each shard is one ``@spot_gpu`` child run of ``shard_work``: it sleeps ``seconds`` (the GPU
work; this machine has 2 cores) and stores its output with ``put_new``, skipping a shard
already stored (a child resumed elsewhere, or a recomputed one). Measured: makespan against
the ideal (total work / GPUs), children created per second (the parent's ``Children.create``
calls), the most children holding GPUs at once (allocations running, sampled every 0.1 s),
GPU occupancy (allocation-seconds / (GPUs x makespan)), per-shard overhead, shards redone
(begun more than once: ``FLOWS_WORK_LOG``) and the cost against on-demand.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from prefect import flow


@flow(name="bench-shard", log_prints=False)
def shard_work(index: int, seconds: float, out: str) -> str:
    from prefect_spotgpu.checkpoint.flow import run_outputs

    store, prefix = run_outputs(out)
    name = f"{prefix}/shard-{index:06d}.txt"
    if store.exists(name):  # done by an earlier attempt
        return name
    log = os.environ.get("FLOWS_WORK_LOG")
    if log:
        with open(log, "a") as begun:
            begun.write(f"{index}\n")
    time.sleep(seconds)
    store.put_new(name, f"shard {index}\n".encode())
    return name


class Occupancy(threading.Thread):
    """Samples the market's running allocations every 0.1 s: the most at once, and the
    allocation-seconds they add up to."""

    def __init__(self, stack) -> None:
        super().__init__(daemon=True)
        self.stack, self.done = stack, threading.Event()
        self.most, self.gpu_seconds = 0, 0.0

    def run(self) -> None:
        market = self.stack.market()
        last = time.monotonic()
        while not self.done.is_set():
            running = market.get("/allocations?status=running").json()
            now = time.monotonic()
            running = [a for a in running if a["status"] == "running"]
            busy = sum(a.get("gpu_count", 1) for a in running)
            self.most = max(self.most, len(running))
            self.gpu_seconds += busy * (now - last)
            last = now
            time.sleep(0.1)


def wide_run(stack, pool: str, *, n: int, seconds: float, gpus: int, cap: int, trouble=None):
    from prefect_spotgpu import spot_gpu
    from prefect_spotgpu.child_runs import Children
    from prefect_spotgpu.fanout import fan_out

    tag = f"wide-{n}-{seconds}-{'hit' if trouble else 'calm'}-{int(time.time())}"
    log = stack.home / f"{tag}.log"
    child = spot_gpu(
        work_pool=pool, gpu_model="A100-80G", max_price=1.5, env={"FLOWS_WORK_LOG": str(log)}
    )(shard_work)
    created: list[tuple[float, int]] = []
    original = Children.create

    def timed_create(self, params):
        began = time.monotonic()
        ids = original(self, params)
        if params:
            created.append((time.monotonic() - began, len(params)))
        return ids

    Children.create = timed_create
    occupancy = Occupancy(stack)

    @flow(name=f"bench-{tag}")
    def parent() -> dict:
        return fan_out(
            child, [{"index": i, "seconds": seconds, "out": tag} for i in range(n)],
            cap=cap, poll_seconds=0.2,
        )  # fmt: skip

    occupancy.start()
    if trouble is not None:
        trouble.start()
    started = time.monotonic()
    try:
        manifest = parent()
    finally:
        Children.create = original
        occupancy.done.set()
        if trouble is not None:
            trouble.done.set()
            trouble.join(timeout=30)
    makespan = time.monotonic() - started
    occupancy.join(timeout=5)
    begun = Path(log).read_text().splitlines() if Path(log).exists() else []
    ideal = n * seconds / gpus
    creating = sum(t for t, _ in created)
    cost = manifest["cost"]
    return {
        "shards": n,
        "shard_seconds": seconds,
        "makespan_seconds": round(makespan, 2),
        "ideal_seconds": round(ideal, 2),
        "makespan_vs_ideal": round(makespan / ideal, 2),
        "children_created_per_second": round(sum(k for _, k in created) / creating, 1)
        if creating
        else None,
        "most_children_holding_gpus": occupancy.most,
        "width_target": min(cap, gpus),
        "gpu_occupancy": round(occupancy.gpu_seconds / (gpus * makespan), 3),
        "per_shard_overhead_seconds": round(makespan * min(cap, gpus) / n - seconds, 3),
        "attempts": manifest["attempts"],
        "shards_begun": len(begun),
        "shards_redone": len(begun) - len(set(begun)),
        "reclaims": len(trouble.log) if trouble else 0,
        "preemptions": cost["preemptions"],
        "spot_cost": cost["spot_cost"],
        "on_demand_cost": cost["on_demand_cost"],
        "saving": cost["saving"],
    }
