"""Outputs exactly once from Dask tasks that may run more than once.

Dask recomputes the tasks of a lost worker (a node that died with no notice), and a worker
whose agent was killed may still finish a task that is also computed elsewhere. So a task
never writes an output with a plain ``put``: it writes with ``put_new`` (``checkpoint.objects``:
the first writer wins, atomically, locally or on S3), and a recomputed task first looks
whether its output is stored and, if so, returns it without computing again. Every output is
then stored once, and every reader sees the first attempt's bytes.

    from prefect_spotgpu.checkpoint.objects import objects_from_url
    from prefect_spotgpu.dask import put_once

    @task
    def render(store_url: str, shard: int) -> str:
        store = objects_from_url(store_url)
        name = f"outputs/frames/{shard:05d}.png"
        put_once(store, name, lambda: render_frame(shard))
        return name
"""

from __future__ import annotations

from collections.abc import Callable

from prefect_spotgpu.checkpoint.objects import ObjectStore


def put_once(store: ObjectStore, name: str, compute: Callable[[], bytes]) -> tuple[bytes, bool]:
    """The stored bytes of ``name``, computed with ``compute`` and stored only when no attempt
    stored them before; and whether this call stored them. When two attempts race, the first
    ``put_new`` wins and both return its bytes."""
    try:
        return store.get(name), False
    except FileNotFoundError:
        pass
    data = compute()
    if store.put_new(name, data):
        return data, True
    return store.get(name), False
