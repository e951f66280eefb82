"""One rank of a gang that saves and restores on command (run as a separate process per rank).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python shard_ops.py STORAGE_URL KEY OP [OP ...]

OPs, in order: ``save:STEP`` (a gang save of this rank's state for STEP), ``maybe:STEP``
(``maybe_save``: a final save if a notice is pending, prints its ``error`` if it raised),
``broken:STEP`` (``maybe_save`` whose state callable raises on rank 1), ``wait`` (the
background save in flight written and committed: prints the newest committed step),
``notice`` (writes this rank's notice file), ``restore`` (prints
``{"op": "restore", "rank", "step", "value"}``), ``gate:PATH`` (rank 0's next shard write
waits until PATH exists, ``PATH.held`` made while it waits: the test kills another rank in
between). Every op prints one JSON
line. ``{rank}`` in STORAGE_URL is the rank (storage that is not shared);
``SPOTGPU_TEST_S3_ENDPOINT`` points an ``s3://`` storage at moto; ``SPOTGPU_TEST_EVERY``,
``_KEEP`` and ``_SYNC_EVERY`` are the checkpointer's options (default 3600 s, 5, 1); notice,
ack and saved files and the signing key are the usual ``SPOTGPU_*`` variables. Rank ``r``'s
state at step ``s`` is ``{"w": torch.full((1000,), 10 * s + r), "rank": r}``.
"""

import functools
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from prefect_spotgpu.checkpoint import Checkpointer, storage_from_url

url, key, ops = sys.argv[1], sys.argv[2], sys.argv[3:]
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world_size = dist.get_rank(), dist.get_world_size()
endpoint = os.environ.get("SPOTGPU_TEST_S3_ENDPOINT")
options = {"endpoint_url": endpoint, "region_name": "us-east-1"} if endpoint else {}
storage = storage_from_url(url.format(rank=rank), **options)


class Gated:
    """The storage, whose next write of this rank's shard waits for a file to exist."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate: Path | None = None

    def write(self, name, step, buffers, size, manifest):
        if self.gate is not None and "/rank-" in name:
            Path(f"{self.gate}.held").touch()  # (what a test waits for before it opens it)
            while not self.gate.exists():
                time.sleep(0.01)
            self.gate = None
        return self.inner.write(name, step, buffers, size, manifest)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


gated = Gated(storage)
ckpt = Checkpointer(
    gated,
    key,
    rank=rank,
    world_size=world_size,
    keep=int(os.environ.get("SPOTGPU_TEST_KEEP", 5)),
    handle_sigusr1=False,
    every=float(os.environ.get("SPOTGPU_TEST_EVERY", 3600)),
    sync_every=int(os.environ.get("SPOTGPU_TEST_SYNC_EVERY", 1)),
)


def say(**fields) -> None:
    print(json.dumps({"rank": rank, **fields}), flush=True)


def state_of(step: int) -> dict:
    return {"w": torch.full((1000,), float(10 * step + rank)), "rank": rank}


def broken_on_rank_1(step: int):
    if rank == 1:
        raise RuntimeError("this rank's state cannot be built")
    return state_of(step)


for op in ops:
    name, _, arg = op.partition(":")
    if name == "save":
        step = int(arg)
        say(op=name, step=ckpt.save(state_of(step), step).step)
    elif name in ("maybe", "broken"):
        step = int(arg)
        build = state_of if name == "maybe" else broken_on_rank_1
        state = functools.partial(build, step)
        try:
            result = ckpt.maybe_save(state, step)
        except Exception as exc:
            say(op=name, step=None, error=type(exc).__name__)
        else:
            say(op=name, step=result and result.step, final=result and result.final, error=None)
    elif name == "notice":
        Path(os.environ["SPOTGPU_NOTICE_FILE"]).write_text("{}")
        say(op=name, step=None)
    elif name == "wait":
        result = ckpt.wait()
        say(op=name, step=result and result.step)
    elif name == "restore":
        got = ckpt.restore()
        if got is None:
            say(op=name, step=None, value=None)
        else:
            assert got.state["rank"] == rank, "a rank got another rank's shard"
            say(op=name, step=got.step, value=float(got.state["w"][0]))
    elif name == "gate" and rank == 0:
        gated.gate = Path(arg)
dist.destroy_process_group()
