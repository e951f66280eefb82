"""Shard work for the spot Dask cluster's tests and benchmark, importable on the nodes (the
worker jobs get this directory on ``PYTHONPATH`` through the cluster's ``env``).

A shard's output is a pure function of its index (:func:`shard_bytes`), so every attempt of it,
anywhere, writes the same bytes as one uninterrupted run would; it is stored with ``put_once``.
Each attempt appends ``<shard> <time> begun`` to the work log, and ``<shard> stored`` when its
``put_new`` won: the tests count recomputed shards and outputs stored more than once there.
"""

from __future__ import annotations

import hashlib
import os
import time


def shard_bytes(shard: int) -> bytes:
    """Shard ``shard``'s output: deterministic, a few hundred bytes."""
    seed = hashlib.sha256(f"shard-{shard}".encode()).digest()
    return b"".join(hashlib.sha256(seed + bytes([i])).digest() for i in range(8))


def output_name(prefix: str, shard: int) -> str:
    return f"{prefix}/shard-{shard:06d}.bin"


def _log(path: str | None, line: str) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one write: lines from many processes stay whole
        finally:
            os.close(fd)


def run_shard(store_root: str, prefix: str, shard: int, seconds: float, log: str | None) -> str:
    """Simulated GPU work (``seconds`` asleep), then the shard's output, stored once; the
    output's SHA-256."""
    from prefect_spotgpu.checkpoint.objects import LocalObjects
    from prefect_spotgpu.dask import put_once

    _log(log, f"{shard} {time.time():.3f} begun")
    store = LocalObjects(store_root)

    def compute() -> bytes:
        time.sleep(seconds)
        return shard_bytes(shard)

    data, stored = put_once(store, output_name(prefix, shard), compute)
    if stored:
        _log(log, f"{shard} {time.time():.3f} stored")
    return hashlib.sha256(data).hexdigest()


def read_log(path) -> tuple[list[tuple[int, float]], list[int]]:
    """The work log: (shard, time) of every attempt begun, and the shards stored, in order."""
    begun, stored = [], []
    if not os.path.exists(path):
        return begun, stored
    with open(path) as f:
        for line in f:
            shard, at, what = line.split()
            if what == "begun":
                begun.append((int(shard), float(at)))
            else:
                stored.append(int(shard))
    return begun, stored
