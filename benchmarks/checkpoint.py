"""Checkpoint benchmark: our writer against the raw disk, torch.save and safetensors.

For a state of float32 tensors (default 1 GiB), on the file system of --dir, side by side in one
run (each measured --repeat times, alternating, median kept):

- raw: the same bytes written with large sequential writes and fsynced (the ceiling);
- ours: ``Checkpointer.save`` to ``LocalStorage`` (checksums, manifest, atomic rename, fsyncs);
- ours_signed: the same with a signing key (SHA-256 per leaf instead of CRC32, signed manifest);
- torch.save and, when installed, safetensors, each followed by an fsync;
- notice_to_durable: a separate process holds the state and calls ``maybe_save`` every step;
  the time from SIGUSR1 to its acknowledgement file (written after the save is durable).

Targets: ours >= 0.9 x raw; notice_to_durable < 2 s for 1 GiB. Prints one JSON object.

    python benchmarks/checkpoint.py [--gib 1] [--dir /tmp] [--repeat 3]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the state lives: cpu, or cuda (device-to-host included)",
    )
    args = parser.parse_args()
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
        out = {
            "benchmark": "checkpoint",
            "state_bytes": size,
            "seconds": {k: round(v, 3) for k, v in median.items()},
            "gb_per_second": {k: round(v, 3) for k, v in bandwidth.items()},
            "ratio_to_raw": {k: round(bandwidth[k] / bandwidth["raw"], 3) for k in bandwidth},
            "notice_to_durable_seconds": round(durable, 3),
            "targets": {
                "ours_ge_0_9_raw": bandwidth["ours"] >= 0.9 * bandwidth["raw"],
                "notice_to_durable_lt_2s": durable < 2.0,
            },
            "dir": str(base.parent),
            "device": args.device,
        }
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
