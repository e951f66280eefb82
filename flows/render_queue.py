"""A render queue fanned out over many spot runs: the animation of ``render.py``, a range of
frames per child run, each frame stored once in the run's storage, then the GIF.

    from render_queue import render_queue
    render_queue(out="night-1", frames=96, per_child=16, work_pool="spot")

The parent runs wherever it is called (a laptop, a deployment on any pool); each child is a
``@spot_gpu`` run of ``render_frames`` (``prefect_spotgpu.fanout``): a reclaimed child resumes
on another node and renders only the frames not yet stored. The result is the manifest: the
frames, the animation and the cost against on-demand.
"""

from __future__ import annotations

from prefect import flow
from render import animation, join, render_frames

from prefect_spotgpu import spot_gpu
from prefect_spotgpu.checkpoint.flow import OUTPUTS
from prefect_spotgpu.fanout import fan_out, storage_of


@flow(name="render-queue")
def render_queue(
    out: str,
    frames: int = 96,
    per_child: int = 16,
    width: int = 160,
    height: int = 120,
    work_pool: str = "spot",
    gpu_model: str = "RTX-4090",
    max_price: float = 0.4,
    cap: int = 8,
    pace_seconds: float = 0.0,
    child_env: dict[str, str] | None = None,
    pool_worker: bool | None = None,
) -> dict:
    """Render ``frames`` frames into ``outputs/<out>/`` of the pool's storage, ``per_child``
    frames a spot run, at most ``cap`` runs at once; the manifest."""
    child = spot_gpu(
        work_pool=work_pool, gpu_model=gpu_model, max_price=max_price, env=child_env or {}
    )(render_frames)
    shards = [
        {"out": out, "first": first, "stop": min(first + per_child, frames), "frames": frames,
         "width": width, "height": height, "pace_seconds": pace_seconds}
        for first in range(0, frames, per_child)
    ]  # fmt: skip
    manifest = fan_out(child, shards, cap=cap, pool_worker=pool_worker)
    store = storage_of(child)
    names = [name for shard in manifest["results"] for name in shard]
    gif = join(f"{OUTPUTS}/{out}", "animation.gif")
    store.put(gif, animation(store, names))
    return {**manifest, "frames": names, "animation": gif}
