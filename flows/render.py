"""Render an animation with a numpy ray marcher, one checkpoint per frame.

The scene: a torus and two spheres over a checkered floor, lit by one sun with soft shadows
and ambient occlusion, the camera circling once over the animation. Each frame is sphere-traced
(signed distance fields), shaded, written as ``frame-NNNN.png`` into the run's storage
(``outputs/<out>/``, atomically: the next attempt may run on another host), and then recorded
in the checkpoint; a resumed run skips the frames already done. At the end the frames become
``animation.gif``. Rendering is deterministic: an interrupted and an uninterrupted run write the
same bytes. ``render_frames`` renders one range of frames of a render queue (``render_queue``
in ``flows/render_queue.py`` fans a queue out over many spot runs).

    python flows/render.py OUT [--frames 24] [--width 160 --height 120]
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from prefect_spotgpu.checkpoint import Checkpointer
from prefect_spotgpu.checkpoint.objects import ObjectStore

MAX_STEPS, FAR, EPSILON = 96, 30.0, 1e-3


def scene(p: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Signed distance to the scene at points ``p`` (N x 3), and each point's material id."""
    x, y, z = p[:, 0], p[:, 1], p[:, 2]
    floor = y + 1.0
    # a torus, lying down and spinning with the animation
    c, s = np.cos(t * 2 * np.pi), np.sin(t * 2 * np.pi)
    tx, tz = c * x - s * z, s * x + c * z
    q = np.hypot(np.hypot(tx, tz) - 1.0, y - 0.0)
    torus = q - 0.35
    sphere_a = np.linalg.norm(p - np.array([1.9, -0.3, 0.8]), axis=1) - 0.7
    sphere_b = np.linalg.norm(p - np.array([-1.7, -0.45, -0.9]), axis=1) - 0.55
    stack = np.stack([floor, torus, sphere_a, sphere_b])
    return stack.min(axis=0), stack.argmin(axis=0)


def normals(p: np.ndarray, t: float) -> np.ndarray:
    e = 1e-3
    offsets = np.eye(3) * e
    n = np.stack(
        [scene(p + offsets[i], t)[0] - scene(p - offsets[i], t)[0] for i in range(3)], axis=1
    )
    return n / np.linalg.norm(n, axis=1, keepdims=True)


def march(origin: np.ndarray, direction: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Sphere tracing: distance travelled along each ray, and whether it hit."""
    depth = np.zeros(len(direction))
    hit = np.zeros(len(direction), dtype=bool)
    active = np.ones(len(direction), dtype=bool)
    for _ in range(MAX_STEPS):
        if not active.any():
            break
        idx = np.flatnonzero(active)
        d, _ = scene(origin[idx] + direction[idx] * depth[idx, None], t)
        depth[idx] += d
        hit[idx[d < EPSILON]] = True
        active[idx[(d < EPSILON) | (depth[idx] > FAR)]] = False
    return depth, hit


def soft_shadow(p: np.ndarray, light: np.ndarray, t: float) -> np.ndarray:
    shade = np.ones(len(p))
    travelled = np.full(len(p), 0.05)
    for _ in range(32):
        d, _ = scene(p + light * travelled[:, None], t)
        shade = np.minimum(shade, 8.0 * d / travelled)
        travelled += np.clip(d, 0.02, 0.5)
    return np.clip(shade, 0.0, 1.0)


def render_frame(index: int, frames: int, width: int, height: int) -> np.ndarray:
    """One frame as an H x W x 3 uint8 array."""
    t = index / frames
    angle = 2 * np.pi * t
    eye = np.array([5.0 * np.sin(angle), 1.6, 5.0 * np.cos(angle)])
    forward = -eye / np.linalg.norm(eye)
    right = np.cross(forward, [0.0, 1.0, 0.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    ys, xs = np.mgrid[0:height, 0:width]
    u = (2 * (xs + 0.5) / width - 1) * width / height
    v = 1 - 2 * (ys + 0.5) / height
    rays = forward + 0.8 * (u[..., None] * right + v[..., None] * up)
    rays = (rays / np.linalg.norm(rays, axis=2, keepdims=True)).reshape(-1, 3)
    origins = np.broadcast_to(eye, rays.shape)
    depth, hit = march(origins, rays, t)
    sky = np.array([0.55, 0.7, 0.95]) * (0.6 + 0.4 * rays[:, 1:2].clip(0, 1))
    colour = np.broadcast_to(sky, rays.shape).copy()
    p = origins[hit] + rays[hit] * depth[hit, None]
    if len(p):
        _, material = scene(p, t)
        n = normals(p, t)
        light = np.array([0.6, 0.8, 0.3])
        light /= np.linalg.norm(light)
        diffuse = np.clip(n @ light, 0, 1) * soft_shadow(p + n * 2e-3, light, t)
        occlusion = np.clip(scene(p + n * 0.2, t)[0] / 0.2, 0, 1)
        palette = np.array([[0.8, 0.8, 0.8], [0.9, 0.45, 0.15], [0.2, 0.5, 0.9], [0.3, 0.8, 0.4]])
        base = palette[material]
        checker = (np.floor(p[:, 0]) + np.floor(p[:, 2])) % 2 == 0
        base[(material == 0) & checker] *= 0.55
        colour[hit] = base * (0.15 + 0.85 * diffuse[:, None]) * (0.5 + 0.5 * occlusion[:, None])
    image = np.clip(colour, 0, 1) ** (1 / 2.2)
    return (image.reshape(height, width, 3) * 255 + 0.5).astype(np.uint8)


def render(
    ckpt: Checkpointer,
    out: ObjectStore,
    on_notice: Callable[[Checkpointer], None],
    frames: int = 24,
    width: int = 160,
    height: int = 120,
    on_frame: Callable[[int, int], None] = lambda done, total: None,
    prefix: str = "",
) -> dict:
    """Render every frame not yet done (per the checkpoint) into ``out`` (the run's storage:
    ``<prefix>/frame-NNNN.png``, each written atomically), then the GIF; a summary."""
    restored = ckpt.restore()
    done = np.zeros(frames, dtype=bool) if restored is None else restored.state["done"].copy()
    for index in range(frames):
        if done[index]:
            continue
        out.put(frame_name(prefix, index), png(render_frame(index, frames, width, height)))
        done[index] = True
        on_frame(int(done.sum()), frames)
        ckpt.maybe_save({"done": done}, index)
        if ckpt.notice_received:
            on_notice(ckpt)
    gif = join(prefix, "animation.gif")
    out.put(gif, animation(out, [frame_name(prefix, i) for i in range(frames)]))
    return {"frames": frames, "size": [width, height], "animation": gif}


def render_range(
    ckpt: Checkpointer,
    out: ObjectStore,
    on_notice: Callable[[Checkpointer], None],
    first: int,
    stop: int,
    frames: int,
    width: int,
    height: int,
    prefix: str,
    pace_seconds: float = 0.0,
) -> list[str]:
    """Frames ``first`` to ``stop - 1`` of the animation into ``out``, each **once**: a frame
    already there (an earlier attempt of this shard, on any host) is not rendered again, and
    of two writers of one frame only the first stores it (``put_new``). The frames' names.
    ``pace_seconds``: a frame takes at least this long (a GPU's time, where the CPU of a test
    machine is the limit)."""
    names = [frame_name(prefix, i) for i in range(first, stop)]
    for index, name in zip(range(first, stop), names, strict=True):
        if not out.exists(name):
            log_work(name)
            began = time.monotonic()
            pixels = render_frame(index, frames, width, height)
            time.sleep(max(0.0, pace_seconds - (time.monotonic() - began)))
            out.put_new(name, png(pixels))
        ckpt.maybe_save({"next": np.array([index + 1])}, index)  # acknowledges a notice
        if ckpt.notice_received:
            on_notice(ckpt)
    return names


def log_work(name: str) -> None:
    """A unit of work begun: one line in ``$FLOWS_WORK_LOG``, when it is set (the fan-out
    benchmark counts the units begun more than once with it: work redone after a reclaim; a
    shared file, as on the local stack)."""
    path = os.environ.get("FLOWS_WORK_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{name}\n")


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def animation(out: ObjectStore, names: list[str]) -> bytes:
    """The frames as one looping GIF (deterministic: the same frames, the same bytes)."""
    images = [Image.open(io.BytesIO(out.get(name))) for name in names]
    buffer = io.BytesIO()
    images[0].save(
        buffer, format="GIF", save_all=True, append_images=images[1:], duration=80, loop=0
    )
    return buffer.getvalue()


def frame_name(prefix: str, index: int) -> str:
    return join(prefix, f"frame-{index:04d}.png")


def join(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def render_one(store_url: str, prefix: str, index: int, frames: int, width: int, height: int,
               pace_seconds: float = 0.0) -> str:  # fmt: skip
    """One frame as a Dask task on a spot worker (``render_on_dask``): rendered and stored
    once (``put_once``: a task Dask recomputes after a lost worker finds its frame stored);
    its name. ``store_url``: storage every node reaches (S3, or a shared directory)."""
    from prefect_spotgpu.checkpoint.objects import objects_from_url
    from prefect_spotgpu.dask import put_once

    name = frame_name(prefix, index)

    def draw() -> bytes:
        log_work(name)
        began = time.monotonic()
        pixels = render_frame(index, frames, width, height)
        time.sleep(max(0.0, pace_seconds - (time.monotonic() - began)))
        return png(pixels)

    put_once(objects_from_url(store_url), name, draw)
    return name


def _prefect_flow():
    from prefect import flow, get_run_logger
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from prefect_spotgpu.checkpoint.flow import (
        checkpointer_for_run,
        run_outputs,
        wait_to_be_stopped,
    )

    @flow(name="render-animation")
    def render_animation(out: str, frames: int = 24, width: int = 160, height: int = 120):
        """Render the ray-marched animation into ``outputs/<out>/`` of the run's storage
        (durable, seen from every host); done frames are skipped on resume."""
        logger = get_run_logger()
        progress = create_progress_artifact(0.0, description="frames rendered (%)")

        def on_frame(done: int, total: int) -> None:
            update_progress_artifact(progress, 100.0 * done / total)
            logger.info("frame %d/%d", done, total)

        ckpt = checkpointer_for_run(every=0.001)  # every frame: a frame is the unit of work
        store, prefix = run_outputs(out)
        return render(ckpt, store, wait_to_be_stopped, frames, width, height, on_frame, prefix)

    @flow(name="render-frames")
    def render_frames(
        out: str,
        first: int,
        stop: int,
        frames: int,
        width: int = 160,
        height: int = 120,
        pace_seconds: float = 0.0,
    ) -> list[str]:
        """One shard of a render queue (``render_queue``): frames ``first`` to ``stop - 1``
        into ``outputs/<out>/`` of the run's storage, each exactly once."""
        store, prefix = run_outputs(out)
        ckpt = checkpointer_for_run(every=0.001)
        return render_range(
            ckpt, store, wait_to_be_stopped, first, stop, frames, width, height, prefix,
            pace_seconds,
        )  # fmt: skip

    return render_animation, render_frames


def render_on_dask(store_url: str, out: str, frames: int = 96, *, cluster: dict,
                   workers: int = 16, width: int = 160, height: int = 120,
                   pace_seconds: float = 0.0) -> dict:  # fmt: skip
    """The render queue for many short frames: one Dask task a frame on a
    ``SpotGPUCluster`` (``cluster``: its keyword arguments: market, GPU model, price, ...)
    of at most ``workers`` spot workers, under prefect-dask's ``DaskTaskRunner``; the frames
    into ``outputs/<out>/`` of the storage at ``store_url``, then the GIF. A reclaimed
    worker retires and hands its frames on; no task run fails for a preemption."""
    from prefect import flow, task
    from prefect_dask import DaskTaskRunner

    from prefect_spotgpu.checkpoint.objects import objects_from_url

    frame = task(name="render-frame", retries=2)(render_one)
    runner = DaskTaskRunner(
        cluster_class="prefect_spotgpu.dask.SpotGPUCluster",
        cluster_kwargs=cluster,
        adapt_kwargs={"minimum": 1, "maximum": workers},
    )

    @flow(name="render-on-dask", task_runner=runner)
    def queue() -> dict:
        prefix = f"outputs/{out}"
        names = frame.map(store_url, prefix, range(frames), frames, width, height,
                          pace_seconds).result()  # fmt: skip
        store = objects_from_url(store_url)
        gif = join(prefix, "animation.gif")
        store.put(gif, animation(store, names))
        return {"frames": names, "animation": gif}

    return queue()


render_animation, render_frames = _prefect_flow()


if __name__ == "__main__":
    import argparse
    import tempfile

    from _cli import add_flow_parameters  # flows/_cli.py: the flow's parameters as arguments

    from prefect_spotgpu.checkpoint import LocalStorage
    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped
    from prefect_spotgpu.checkpoint.objects import LocalObjects

    parser = argparse.ArgumentParser(
        description="Render the ray-marched animation here, without Prefect's server: the "
        "frames and the GIF into the directory OUT."
    )
    add_flow_parameters(parser, __file__, "render_animation")
    args = parser.parse_args()
    args.out = Path(args.out)
    ckpt = Checkpointer(LocalStorage(tempfile.mkdtemp(prefix="render-")), "render", every=0.001)
    summary = render(
        ckpt,
        LocalObjects(args.out),
        wait_to_be_stopped,
        args.frames,
        args.width,
        args.height,
        lambda done, total: print(f"frame {done}/{total}"),
    )
    print(summary)
