"""A fan-out child written out: embed a corpus on spot GPUs, a range of its parts per child run,
each part's embeddings stored exactly once (docs/users/fan-out-child.md, run by
tests/test_buyer_examples.py through a notice, a resume and a retried shard).

The corpus lies in the run's storage as ``inputs/<source>/part-NNNNN.npy`` (float32 rows); the
parent, ``embed_corpus``, gives each child a range of part numbers. A child, ``embed_shard``,
writes ``outputs/<out>/part-NNNNN.npy`` (one unit vector a row) for each part of its range into
that same storage, never into a path of its own: its next attempt, or a child given the same
shard again, may run on another host.

    from embed_corpus import embed_corpus, embed_shard, write_corpus
    from prefect_spotgpu import spot_gpu
    from prefect_spotgpu.fanout import storage_of

    write_corpus(storage_of(spot_gpu(work_pool="spot")(embed_shard)), "night-1", parts=64)
    embed_corpus(source="night-1", out="night-1", parts=64, per_child=8, work_pool="spot")
"""

from __future__ import annotations

import io

import numpy as np
import torch
from prefect import flow
from torch import nn
from torch.nn import functional as F

from prefect_spotgpu import spot_gpu
from prefect_spotgpu.checkpoint import Checkpointer
from prefect_spotgpu.checkpoint.flow import checkpointer_for_run, run_outputs, wait_to_be_stopped
from prefect_spotgpu.checkpoint.objects import ObjectStore
from prefect_spotgpu.fanout import fan_out

INPUTS = "inputs"
"""Where a corpus's parts lie in the run's storage: ``inputs/<source>/part-NNNNN.npy``."""
FEATURES, DIMENSIONS = 64, 32


def part_name(folder: str, index: int) -> str:
    return f"{folder}/part-{index:05d}.npy"


def encoder(device: torch.device) -> nn.Module:
    """The model every child runs: the same weights on every node and in every attempt (seeded
    here; a real child loads its weights from storage or from its image)."""
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(FEATURES, 256), nn.GELU(), nn.Linear(256, DIMENSIONS))
    return model.to(device).eval()


@torch.no_grad()
def embed(model: nn.Module, rows: np.ndarray, device: torch.device) -> np.ndarray:
    """One unit vector a row, back on the CPU as float32."""
    vectors = F.normalize(model(torch.from_numpy(rows).to(device)), dim=1)
    return vectors.cpu().numpy()


def embed_range(
    ckpt: Checkpointer,
    store: ObjectStore,
    source: str,
    out: str,
    first: int,
    stop: int,
    on_notice=wait_to_be_stopped,
) -> list[str]:
    """Parts ``first`` to ``stop - 1`` of ``source``, embedded into ``out``, each stored once;
    the names of the outputs, in order.

    The outputs are the record of what is done, not the checkpoint: a part already stored (by
    an earlier attempt of this run, or by another child given this shard) is skipped, and of
    two writers of one part only the first stores it (``put_new``). The checkpoint is still
    saved after every part, because a notice is answered by a save: the final one, after which
    the checkpointer acknowledges and the node's agent stops this process."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = encoder(device)
    names = []
    for index in range(first, stop):
        name = part_name(out, index)
        if not store.exists(name):
            rows = np.load(io.BytesIO(store.get(part_name(source, index))))
            buffer = io.BytesIO()
            np.save(buffer, embed(model, rows, device))
            store.put_new(name, buffer.getvalue())  # False: another writer stored it first
        names.append(name)
        ckpt.maybe_save({"next": index + 1}, index)  # at a notice: the final save, the ack
        if ckpt.notice_received:
            on_notice(ckpt)
    return names


@flow(name="embed-shard")
def embed_shard(source: str, out: str, first: int, stop: int) -> list[str]:
    """One child of ``embed_corpus``: parts ``first`` to ``stop - 1`` of the corpus
    ``source`` into ``outputs/<out>/`` of the run's storage, each exactly once."""
    store, prefix = run_outputs(out)  # the run's storage (SPOTGPU_CHECKPOINT_URL), outputs/<out>
    ckpt = checkpointer_for_run()  # keyed by this child's flow run
    return embed_range(ckpt, store, f"{INPUTS}/{source}", prefix, first, stop)


@flow(name="embed-corpus")
def embed_corpus(
    source: str,
    out: str,
    parts: int,
    per_child: int = 8,
    work_pool: str = "spot",
    gpu_model: str = "RTX-4090",
    max_price: float = 0.4,
    cap: int = 8,
) -> dict:
    """Embed the ``parts`` parts of ``source``, ``per_child`` parts a spot run, at most ``cap``
    runs at once; the fan-out's manifest and the names of the outputs, in order."""
    child = spot_gpu(work_pool=work_pool, gpu_model=gpu_model, max_price=max_price)(embed_shard)
    shards = [
        {"source": source, "out": out, "first": first, "stop": min(first + per_child, parts)}
        for first in range(0, parts, per_child)
    ]
    manifest = fan_out(child, shards, cap=cap)
    return {**manifest, "outputs": [name for shard in manifest["results"] for name in shard]}


def write_corpus(store: ObjectStore, source: str, parts: int, rows: int = 512, seed: int = 0):
    """A synthetic corpus of ``parts`` parts into ``store`` (``storage_of(child)`` for a pool's
    children to find it); the names of its parts."""
    draw = np.random.default_rng(seed)
    names = []
    for index in range(parts):
        buffer = io.BytesIO()
        np.save(buffer, draw.standard_normal((rows, FEATURES), dtype=np.float32))
        names.append(part_name(f"{INPUTS}/{source}", index))
        store.put(names[-1], buffer.getvalue())
    return names
