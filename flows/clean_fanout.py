"""Cleaning fanned out over many spot runs, with the decisions of one uninterrupted run.

    from clean_fanout import clean_fanout
    clean_fanout(source="pairs", out="pairs-clean", per_child=4, work_pool="spot")

The costly part of cleaning (decoding every image, hashing it) depends on a pair alone: each
child (a ``@spot_gpu`` run of ``clean.py:clean_signatures``) computes it for a few input shards
and stores it once. Deduplication depends on every pair before it in the set's order; it is
cheap, so the parent does it in order once every shard's signatures are stored
(``clean.decide_and_write``), writing the clean shards and the report. How the work was split,
and which children were reclaimed, changes no decision: the report and the clean shards are
byte for byte an uninterrupted ``clean``'s.

The clean shards pass through the parent (it reads each input shard once more to write its
kept pairs): at the scale of billions of pairs that copy belongs in a second fan-out of writers.
"""

from __future__ import annotations

from clean import clean_signatures, decide_and_write, make_dataset, shard_names
from prefect import flow

from prefect_spotgpu import spot_gpu
from prefect_spotgpu.checkpoint.flow import OUTPUTS
from prefect_spotgpu.fanout import fan_out, storage_of


@flow(name="clean-fanout")
def clean_fanout(
    source: str,
    out: str,
    per_child: int = 4,
    work_pool: str = "spot",
    gpu_model: str = "RTX-4090",
    max_price: float = 0.4,
    cap: int = 8,
    make_test_set: int = 0,
    pace_seconds: float = 0.0,
    child_env: dict[str, str] | None = None,
    pool_worker: bool | None = None,
) -> dict:
    """Clean ``outputs/<source>/shard-*.jsonl`` of the pool's storage into
    ``outputs/<out>/``, ``per_child`` input shards a spot run; the manifest and the report."""
    child = spot_gpu(
        work_pool=work_pool, gpu_model=gpu_model, max_price=max_price, env=child_env or {}
    )(clean_signatures)
    store = storage_of(child)
    src, dst = f"{OUTPUTS}/{source}", f"{OUTPUTS}/{out}"
    if make_test_set and not shard_names(store, src):
        make_dataset(store, make_test_set, prefix=src)
    names = shard_names(store, src)
    shards = [
        {"names": names[i : i + per_child], "out": out, "pace_seconds": pace_seconds}
        for i in range(0, len(names), per_child)
    ]
    manifest = fan_out(child, shards, cap=cap, pool_worker=pool_worker)
    report = decide_and_write(store, names, store, dst)
    return {
        **manifest,
        "report": report,
        "outputs": [*shard_names(store, dst), f"{dst}/report.json"],
    }
