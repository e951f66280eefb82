"""Checkpoint benchmark: our writer against the raw disk, torch.save and safetensors.

For a state of float32 tensors (default 1 GiB), on the file system of --dir, side by side in one
run (each measured --repeat times, alternating, median kept):

- raw: the same bytes written with large sequential writes and fsynced (the ceiling);
- ours: ``Checkpointer.save`` to ``LocalStorage`` (checksums, manifest, atomic rename, fsyncs);
- ours_signed: the same with a signing key (SHA-256 per leaf instead of CRC32, signed manifest);
- torch.save and, when installed, safetensors, each followed by an fsync;
- notice_to_durable: a separate process holds the state and calls ``maybe_save`` every step;
  the time from SIGUSR1 to its acknowledgement file (written after the save is durable).

Periodic saves, for each state size of --async-gib (default 1 and 4 GiB), synchronous against
asynchronous (``background``), side by side:

- copy_floor: one plain copy of the state into memory already allocated (the floor of a
  consistent snapshot), and fresh_copy: ``clone()`` of every tensor (new memory);
- sync_blocking: a periodic save that writes before returning (the training loop waits for it);
- async_blocking: a periodic save that stages a snapshot and returns (median of the saves after
  the first, which allocates the staging memory; the first is reported too);
- steps per second of a training step (a 768x768 matmul) with no save in flight, and while a
  background save is written;
- staging_bytes / state_bytes, and the peak resident memory the saves added.

Targets: ours >= 0.9 x raw; notice_to_durable < 2 s for 1 GiB; async_blocking <= 1.5 x
copy_floor. Prints one JSON object.

``--only dcp``: a sharded FSDP2 state (``--dcp-gib``, default 1 GiB, over each of
``--dcp-ranks`` gloo ranks on this machine's cores, default 2 and 1) through
``torch.distributed.checkpoint`` with this storage, against DCP's own filesystem writer and a
raw write of each rank's shards, and DCP's ``async_save`` blocking time against one copy of
the state (``benchmarks/dcp_ranks.py`` under torchrun). Targets: ours >= 0.9 x raw;
async_blocking <= 1.5 x copy_floor.

    python benchmarks/checkpoint.py [--gib 1] [--async-gib 1 4] [--dir /tmp] [--repeat 3]
    python benchmarks/checkpoint.py --only dcp [--dcp-gib 1] [--dcp-ranks 2 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage


def make_state(gib: float, device: str = "cpu") -> dict:
    tensors = max(1, int(gib * 16))
    numel = int(gib * (1 << 30) / 4 / tensors)
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(numel, generator=gen).to(device) for i in range(tensors)
    }


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(state: dict, path: Path) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in state.values():
            view = memoryview(tensor.cpu().numpy()).cast("B")
            while view.nbytes:
                view = view[os.write(fd, view[: 1 << 30]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def ours(state: dict, root: Path, signing_key: str = "") -> float:
    """One save into a fresh key: the write itself, as raw (retention is not timed)."""
    ckpt = Checkpointer(
        LocalStorage(root),
        f"bench-{time.time_ns()}",
        keep=3,
        handle_sigusr1=False,
        signing_key=signing_key,
    )
    t0 = time.perf_counter()
    ckpt.save(state, int(time.time() * 1000))
    return time.perf_counter() - t0


def torch_save(state: dict, path: Path) -> float:
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_path(path)
    return time.perf_counter() - t0


def safetensors_save(state: dict, path: Path) -> float | None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        return None
    t0 = time.perf_counter()
    save_file(state, str(path))
    fsync_path(path)
    return time.perf_counter() - t0


def training_step(a, b) -> None:
    torch.mm(a, b)


def steps_per_second(seconds: float, until=None) -> float:
    """Training steps a second for ``seconds`` (or until ``until()`` is true)."""
    a, b = torch.randn(768, 768), torch.randn(768, 768)
    t0, steps = time.perf_counter(), 0
    while True:
        training_step(a, b)
        steps += 1
        elapsed = time.perf_counter() - t0
        if (until is not None and until()) or (until is None and elapsed >= seconds):
            return steps / elapsed


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def async_figures(gib: float, root: Path, repeat: int) -> dict:
    """Blocking time of a periodic save, synchronous against asynchronous, for one size."""
    state = make_state(gib)
    size = sum(t.numel() * t.element_size() for t in state.values())
    copy_floor, fresh_copy, sync_blocking, async_blocking = [], [], [], []
    idle, during = [], []
    rss_before = peak_rss_bytes()
    ckpt = Checkpointer(LocalStorage(root), "async", every=1e-9, keep=1, handle_sigusr1=False)
    sync = Checkpointer(
        LocalStorage(root), "sync", every=1e-9, keep=1, handle_sigusr1=False, background=False
    )
    first_async = None
    for i in range(repeat + 1):  # first, alone: the peak memory is the staging's
        idle.append(steps_per_second(1.0))
        t0 = time.perf_counter()
        ckpt.maybe_save(state, i)
        blocked = time.perf_counter() - t0
        pending = ckpt._in_flight
        during.append(steps_per_second(0, until=pending.done))
        ckpt.wait()
        if i == 0:
            first_async = blocked
        else:
            async_blocking.append(blocked)
    rss_added = peak_rss_bytes() - rss_before
    floor = torch.empty(size // 4)
    for i in range(repeat):
        t0 = time.perf_counter()
        at = 0
        for tensor in state.values():
            floor[at : at + tensor.numel()].copy_(tensor)
            at += tensor.numel()
        copy_floor.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copies = {k: v.clone() for k, v in state.items()}
        fresh_copy.append(time.perf_counter() - t0)
        del copies
        t0 = time.perf_counter()
        sync.maybe_save(state, i)
        sync_blocking.append(time.perf_counter() - t0)
    staging = ckpt._staging.nbytes
    ckpt.close()
    median = statistics.median
    floor_s = median(copy_floor)
    return {
        "state_bytes": size,
        "seconds": {
            "copy_floor": round(floor_s, 3),
            "fresh_copy": round(median(fresh_copy), 3),
            "sync_blocking": round(median(sync_blocking), 3),
            "async_blocking": round(median(async_blocking), 3),
            "async_blocking_first": round(first_async, 3),
        },
        "async_blocking_over_copy_floor": round(median(async_blocking) / floor_s, 3),
        "async_blocking_over_sync": round(median(async_blocking) / median(sync_blocking), 3),
        "steps_per_second": {
            "no_save": round(median(idle), 1),
            "during_background_write": round(median(during), 1),
        },
        "staging_bytes_over_state": round(staging / size, 4),
        "peak_rss_added_over_state": round(rss_added / size, 3),
        "target_async_le_1_5_copy_floor": median(async_blocking) <= 1.5 * floor_s,
    }


NOTICE_SCRIPT = """
import sys, time, torch
sys.path.insert(0, sys.argv[3])
from checkpoint import make_state
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
state = make_state(float(sys.argv[2]))
ckpt = Checkpointer(LocalStorage(sys.argv[1]), "notice", every=3600,
                    ack_file=sys.argv[1] + "/ack.json")
print("ready", flush=True)
step = 0
while not ckpt.notice_received:
    time.sleep(0.001)  # one training step
    step += 1
    ckpt.maybe_save(state, step)
"""


def notice_to_durable(gib: float, root: Path) -> float:
    proc = subprocess.Popen(
        [sys.executable, "-c", NOTICE_SCRIPT, str(root), str(gib), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    ack = root / "ack.json"
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGUSR1)
    while not ack.exists():
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    proc.wait(timeout=60)
    return elapsed


def dcp_figures(gib: float, ranks: int, repeat: int, where: str | None) -> dict:
    """``benchmarks/dcp_ranks.py`` on ``ranks`` processes (torchrun, gloo): its figures."""
    base = Path(tempfile.mkdtemp(dir=where))
    try:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(ranks), str(Path(__file__).with_name("dcp_ranks.py")),
                   str(base), str(gib), str(repeat)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"dcp_ranks.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    figures["targets"] = {
        "ours_ge_0_9_raw": figures["ours_vs_raw"] >= 0.9,
        "async_blocking_le_1_5_copy_floor": figures["async_blocking_vs_copy_floor"] <= 1.5,
    }
    return {**figures, "dir": str(base.parent)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--async-gib", type=float, nargs="*", default=[1.0, 4.0])
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the state lives: cpu, or cuda (device-to-host included)",
    )
    parser.add_argument("--only", choices=["dcp"], default=None, help="one section alone")
    parser.add_argument("--dcp-gib", type=float, default=1.0)
    parser.add_argument("--dcp-ranks", type=int, nargs="+", default=[2, 1])
    args = parser.parse_args()
    if args.only == "dcp":
        cells = {n: dcp_figures(args.dcp_gib, n, args.repeat, args.dir) for n in args.dcp_ranks}
        print(json.dumps({"benchmark": "checkpoint_dcp", "ranks": cells}, indent=2))
        return
    base = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        state = make_state(args.gib, args.device)
        size = sum(t.numel() * t.element_size() for t in state.values())
        times: dict[str, list[float]] = {
            "raw": [],
            "ours": [],
            "ours_signed": [],
            "torch_save": [],
            "safetensors": [],
        }
        cpu_state = state if args.device == "cpu" else {k: v.cpu() for k, v in state.items()}
        for i in range(args.repeat):
            times["raw"].append(raw_write(cpu_state, base / f"raw{i}.bin"))
            times["ours"].append(ours(state, base / "ours"))
            times["ours_signed"].append(ours(state, base / "ours", signing_key="bench-key"))
            times["torch_save"].append(torch_save(state, base / f"t{i}.pt"))
            st = safetensors_save(state, base / f"s{i}.safetensors")
            if st is not None:
                times["safetensors"].append(st)
            for leftover in base.glob("*.*"):
                leftover.unlink()
            shutil.rmtree(base / "ours", ignore_errors=True)
        median = {k: statistics.median(v) for k, v in times.items() if v}
        bandwidth = {k: size / v / 1e9 for k, v in median.items()}
        notice_root = base / "notice"
        notice_root.mkdir()
        durable = notice_to_durable(args.gib, notice_root)
        del state, cpu_state
        periodic = {}
        for gib in args.async_gib:
            periodic[f"{gib:g}GiB"] = async_figures(gib, base / f"async{gib:g}", args.repeat)
            shutil.rmtree(base / f"async{gib:g}", ignore_errors=True)
        out = {
            "benchmark": "checkpoint",
            "state_bytes": size,
            "seconds": {k: round(v, 3) for k, v in median.items()},
            "gb_per_second": {k: round(v, 3) for k, v in bandwidth.items()},
            "ratio_to_raw": {k: round(bandwidth[k] / bandwidth["raw"], 3) for k in bandwidth},
            "notice_to_durable_seconds": round(durable, 3),
            "periodic_saves": periodic,
            "targets": {
                "ours_ge_0_9_raw": bandwidth["ours"] >= 0.9 * bandwidth["raw"],
                "notice_to_durable_lt_2s": durable < 2.0,
                "async_blocking_le_1_5_copy_floor": all(
                    p["target_async_le_1_5_copy_floor"] for p in periodic.values()
                ),
            },
            "dir": str(base.parent),
            "device": args.device,
        }
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
