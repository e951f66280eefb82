"""What a gang costs: the agreement per ``maybe_save`` call, and a gang save against one
rank's save of the same total bytes (one process per rank, gloo on loopback).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python shard_bench.py DIR MB
    python shard_bench.py DIR MB          # no WORLD_SIZE: the single-rank figures

Each rank's state is MB megabytes of float32 (a single rank saves n x MB: the gang's total).
Rank 0 (or the single process) prints one JSON object: ``maybe_save_us`` (a call with nothing
due, mean of many), ``max_us`` (one bare agreement, gang only), ``save_seconds`` (median of 3
saves, from the moment every rank starts to the moment rank 0 returns: rank 0 commits last).
"""

import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage

root, mb = sys.argv[1], float(sys.argv[2])
gang = "WORLD_SIZE" in os.environ
if gang:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world_size = dist.get_rank(), dist.get_world_size()
else:
    rank, world_size = 0, 1
total_ranks = int(os.environ.get("SPOTGPU_BENCH_GANG_SIZE", world_size))
elements = int(mb * 1e6 / 4) * (1 if gang else total_ranks)
state = {"w": torch.randn(elements)}
ckpt = Checkpointer(
    LocalStorage(root),
    "bench",
    rank=rank,
    world_size=world_size,
    every=3600,
    keep=1,
    handle_sigusr1=False,
    signing_key="",
)
report: dict = {"world_size": world_size, "bytes_per_rank": elements * 4}

calls = 2000
for step in range(200):  # warm up
    ckpt.maybe_save(state, step)
started = time.perf_counter()
for step in range(calls):
    ckpt.maybe_save(state, step)
report["maybe_save_us"] = (time.perf_counter() - started) / calls * 1e6
if gang:
    started = time.perf_counter()
    for _ in range(calls):
        ckpt.sync.max(0)
    report["max_us"] = (time.perf_counter() - started) / calls * 1e6

seconds = []
for step in range(1, 4):
    if gang:
        ckpt.sync.max(0)  # every rank starts together
    started = time.perf_counter()
    ckpt.save(state, step)
    seconds.append(time.perf_counter() - started)
report["save_seconds"] = statistics.median(seconds)
if rank == 0:
    print(json.dumps(report))
if gang:
    dist.destroy_process_group()
