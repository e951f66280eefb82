"""The one module that reaches into Prefect's private internals.

Everything else in the package uses Prefect's public API (and, in the worker, the members a
``BaseWorker`` subclass is meant to use). What Prefect keeps private is touched here only,
each use with what it relies on, as read in prefect 3.9.1's own sources, and what happens
where a later Prefect differs. ``tests/test_architecture.py`` fails when another module
imports a private Prefect name or reads a worker's private attribute from outside it.
"""

from __future__ import annotations

import inspect
import time
from typing import Any
from uuid import UUID

import anyio


def work_pool_of(worker: Any) -> Any:
    """The work pool a ``BaseWorker`` read at its start (``worker._work_pool``), or None when
    there is no such pool (the worker does not create it in that case)."""
    return getattr(worker, "_work_pool", None)


def run_engine(flow, flow_run_id: str) -> int:
    """What ``python -m prefect.engine`` does once it has loaded the flow (prefect 3.9's
    ``prefect/engine.py``: the control listener, the engine's signal handling, run metrics and
    ``_drive_run_flow_result``), on a flow loaded already (ahead, or from a bundle)."""
    from prefect._internal.control_listener import configure_from_env
    from prefect._internal.metrics import RunMetrics
    from prefect.engine import _drive_run_flow_result, handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow_run, run_flow

    configure_from_env()
    with handle_engine_signals(UUID(flow_run_id)):
        flow_run = load_flow_run(flow_run_id=UUID(flow_run_id))
        with RunMetrics(flow_run, flow):
            result = run_flow(flow, flow_run=flow_run, error_logger=flow_run_logger(flow_run))
            _drive_run_flow_result(flow, result)
    return 0


async def flush_prefect_queues(seconds: float, logger) -> None:
    """Let Prefect's log and event services send what they hold for at most ``seconds``, then
    stop those still trying, dropping what they hold.

    Prefect drains them at interpreter exit with no time limit, and with its API unreachable
    it retries each queued event for ~7 s and each batch of logs for ~1 min: a stopping worker
    would hang that long. This reaches into Prefect 3.9's service registry
    (``prefect._internal.concurrency.services``); where that differs, it only waits.
    """
    from prefect._internal.concurrency import services

    base = getattr(services, "_QueueServiceBase", None)
    instances = tuple(getattr(base, "_instances", {}).values())
    busy = [
        (s._loop, s._task)
        for s in instances
        if getattr(s, "_task", None) is not None and getattr(s, "_loop", None) is not None
    ]  # taken first: draining forgets the task
    drained = services.QueueService.drain_all(timeout=seconds, at_exit=False)
    if inspect.isawaitable(drained):
        await drained
    stuck = [(loop, task) for loop, task in busy if not task.done()]
    if not stuck:
        return
    logger.warning(
        "Prefect's API did not take the last logs and events in %.1f s: dropped", seconds
    )
    for loop, task in stuck:
        loop.call_soon_threadsafe(task.cancel)
    deadline = time.monotonic() + 0.5
    while any(not task.done() for _, task in stuck) and time.monotonic() < deadline:
        await anyio.sleep(0.05)


async def with_pool_result_storage(flow: Any, block_id: UUID | None) -> Any:
    """The flow with the pool's result storage (``block_id``) and persisted results, as
    ``InfrastructureBoundFlow.submit_to_work_pool`` gives a flow before bundling it, unless
    the flow has result storage a caller can read already. Relies on prefect 3.9's private
    ``prefect.results._result_storage_is_configured_for_remote_retrieval``; where it is gone,
    the pool's storage is given whenever the flow has none of its own."""
    from prefect import results

    if block_id is None:
        return flow
    remote = getattr(results, "_result_storage_is_configured_for_remote_retrieval", None)
    if remote is not None:
        if remote(flow.result_storage, results.get_result_store().result_storage):
            return flow
    elif flow.result_storage is not None:
        return flow
    storage = await results.aresolve_result_storage(block_id)
    return flow.with_options(result_storage=storage, persist_result=True)
