"""The DCP part of ``benchmarks/checkpoint.py``, run on every rank by torchrun (gloo, CPU).

An FSDP2 model of ``GIB`` GiB of float32 parameters (a stack of square Linear layers, each
sharded over the ranks), saved side by side, alternating, ``REPEAT`` times (median kept):

- raw: each rank writes its own shards' bytes with large sequential writes and fsyncs (the
  ceiling for this sharded state);
- ours: ``dcp.save`` with ``SpotStorageWriter`` onto ``LocalStorage`` (checksums, the rank's
  manifest, atomic renames, fsyncs, then the commit); ours_signed the same, signed (BLAKE3
  leaves and an HMAC'd manifest: what a run under the spot-gpu worker writes);
- dcp_filesystem: ``dcp.save`` with DCP's own ``FileSystemWriter`` (fsyncs on);
- dcp_alone: ``dcp.save`` with a writer that writes nothing: DCP's own planning, gathers and
  commit round, which every DCP writer pays on top of its writes;
- copy_floor: one copy of each rank's shards into memory already allocated;
- async_blocking: how long ``dcp.async_save`` with ``SpotStorageWriter`` holds the loop (it
  stages the state in host memory kept from one save to the next, as ``DistributedCheckpointer``
  does, then writes in a thread), and async_total until it is durable.

Each figure is the slowest rank's (a barrier before and after). Rank 0 prints one JSON object.

    torchrun --nproc-per-node 2 benchmarks/dcp_ranks.py DIR GIB REPEAT
"""

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.futures import Future

from prefect_spotgpu.checkpoint import LocalStorage
from prefect_spotgpu.checkpoint.dcp import SpotStorageWriter

root, gib, repeat = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
width = 4096  # 64 MiB a layer
layers = max(1, round(gib * 2**30 / (width * width * 4)))
model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
state = {"model": model.state_dict()}
local = [p.to_local() for p in model.parameters()]
local_bytes = sum(t.numel() * t.element_size() for t in local)
total_bytes = torch.tensor([local_bytes])
dist.all_reduce(total_bytes)
group = dist.new_group(backend="gloo")


def slowest(action, name: str) -> float:
    """``action``'s time on the slowest rank, each writer starting from an empty directory
    (as retention leaves one; ``raw`` overwrites its file)."""
    fresh(name)
    started = time.perf_counter()
    action()
    took = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def fresh(name: str) -> Path:
    """An empty directory for this rank (``name-<rank>``), and ``name`` shared, removed."""
    path = root / f"{name}-{rank}"
    if rank == 0:
        shutil.rmtree(root / name, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    dist.barrier()
    return path


def raw() -> None:
    path = root / f"raw-{rank}" / "shards.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in local:
            view = memoryview(tensor.detach().numpy()).cast("B")
            while view:
                view = view[os.write(fd, view[: 64 << 20]) :]
        os.fsync(fd)
    finally:
        os.close(fd)


step = [0]


def ours() -> None:
    step[0] += 1
    storage = LocalStorage(root / "ours")
    dcp.save(
        state, storage_writer=SpotStorageWriter(storage, "bench", step[0]), process_group=group
    )


def ours_signed() -> None:
    step[0] += 1
    storage = LocalStorage(root / "ours")
    writer = SpotStorageWriter(storage, "bench", step[0], signing_key=b"bench-signing-key")
    dcp.save(state, storage_writer=writer, process_group=group)


def dcp_filesystem() -> None:
    path = root / "dcp-filesystem"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), process_group=group)


class NothingWriter(SpotStorageWriter):
    """DCP's orchestration alone: every item "written" nowhere."""

    def write_data(self, plan, planner):
        results = [WriteResult(item.index, 0, None) for item in plan.items]
        for item in plan.items:
            planner.resolve_data(item)
        future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata, results) -> None:
        pass


def dcp_alone() -> None:
    dcp.save(state, storage_writer=NothingWriter(None, "bench", 0), process_group=group)


copies = [torch.empty_like(t) for t in local]


def copy_floor() -> None:
    for target, source in zip(copies, local, strict=True):
        target.copy_(source)


pending = []
PLANNER = DefaultSavePlanner(enable_plan_caching=True)  # (DistributedCheckpointer's, too)
# staging memory kept from one save to the next, as DistributedCheckpointer keeps it
stager = DefaultStager(StagingOptions(False, False, False, False))


def async_blocking() -> None:
    step[0] += 1
    storage = LocalStorage(root / "ours")
    writer = SpotStorageWriter(storage, "bench", step[0])
    pending.append(
        dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
    )


def async_total() -> None:
    async_blocking()
    pending.pop().result()


DIRS = {"raw": "raw", "ours": "ours", "ours_signed": "ours", "dcp_filesystem": "dcp-filesystem"}
figures: dict[str, list[float]] = {}
actions = {"raw": raw, "ours": ours, "ours_signed": ours_signed,
           "dcp_filesystem": dcp_filesystem, "dcp_alone": dcp_alone,
           "copy_floor": copy_floor}  # fmt: skip
for _ in range(repeat):
    for name, action in actions.items():
        figures.setdefault(name, []).append(slowest(action, DIRS.get(name, "scratch")))
    figures.setdefault("async_blocking", []).append(slowest(async_blocking, "ours"))
    pending.pop().result()
    figures.setdefault("async_total", []).append(slowest(async_total, "ours"))
median = {name: statistics.median(values) for name, values in figures.items()}
if rank == 0:
    gb = total_bytes.item() / 1e9
    print(json.dumps({
        "ranks": world, "state_bytes": int(total_bytes.item()), "layers": layers,
        "repeat": repeat, "seconds": {k: round(v, 4) for k, v in median.items()},
        "all_seconds": {k: [round(x, 4) for x in v] for k, v in figures.items()},
        "gb_per_s": {k: round(gb / median[k], 3)
                     for k in ("raw", "ours", "ours_signed", "dcp_filesystem")},
        "ours_vs_raw": round(median["raw"] / median["ours"], 3),
        "ours_signed_vs_raw": round(median["raw"] / median["ours_signed"], 3),
        "ours_less_dcp_alone_vs_raw": round(
            median["raw"] / (median["ours"] - median["dcp_alone"]), 3
        ),
        "ours_vs_dcp_filesystem": round(median["dcp_filesystem"] / median["ours"], 3),
        "async_blocking_vs_copy_floor": round(median["async_blocking"] / median["copy_floor"], 3),
    }))  # fmt: skip
dist.barrier()
dist.destroy_process_group()
