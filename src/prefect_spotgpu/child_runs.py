"""A fan-out's children as Prefect flow runs: one bundle for all, created concurrently.

``prefect_spotgpu.fanout`` decides which shards to give to new children; this module makes
them. Calling a ``@spot_gpu`` flow once per shard would upload a bundle per child, each
through a new Python process (Prefect's upload step: ~3.5 s of imports on 2 cores), one after
another in the parent's loop: the width never passed a child's lifetime / 3.5 s. Here:

- **One bundle.** The child flow is bundled and written to the pool's storage once
  (``bundles/<key>``, in this process); every child's flow run carries the same execution
  command and the bundle's SHA-256 (label ``spotgpu.bundle-sha256``), so the node's
  ``bundles.execute`` checks the bytes as for a single call. A child's parameters are its
  flow run's, as for any run.
- **Concurrent creation.** Each child is two calls to Prefect's API (its subflow task run in
  the parent, its flow run), ``CREATE_CONCURRENCY`` children at a time, from one event loop
  in a thread of this process: no process per child.
- **One follower.** Handed to the pool's worker (``to_pool``), a child is created
  ``Scheduled`` and the pool's running worker takes it (it places the bids together). Followed
  from here, a child is created ``Pending`` (no polling worker takes a Pending run) and one
  spot-gpu worker in this process follows it: it labels the run ``prefect.worker.name`` with
  its own name and sends its heartbeat while it follows, so the pool's worker never adopts it
  while this process lives. After a preemption, the rescheduled run is taken by exactly one
  worker (Prefect's compare-and-set to Pending): the other lets go.
- **States in bulk.** The parent reads its running children's states in pages of
  ``READ_PAGE`` flow runs, one call each, not one call per child.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

CREATE_CONCURRENCY = 4
"""How many children are being created at once (each: two calls to Prefect's API)."""
READ_PAGE = 200
"""Flow runs read per call when the parent looks at its children's states (Prefect's limit)."""


@dataclass(frozen=True)
class SharedBundle:
    """The one bundle of a fan-out's children, as stored."""

    key: str
    sha256: str
    command: str
    """The job variable ``command`` of every child: the pool's execution step on ``key``."""
    flow: Any
    """The child flow, with the pool's result storage when it had none the caller can read."""
    flow_id: UUID


class Children:
    """Creates and follows the children of one fan-out (module doc). Use as a context
    manager; its methods are called from the parent's thread and run on its own loop."""

    def __init__(self, child, *, to_pool: bool) -> None:
        self.child, self.to_pool = child, to_pool
        self.bundle: SharedBundle | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=contextvars.copy_context().run,  # the caller's Prefect settings
            args=(self._loop.run_forever,),
            name=f"fan-out {child.name}",
            daemon=True,
        )
        self._worker = None
        self._follows: dict[UUID, asyncio.Task] = {}
        self.errors: dict[UUID, BaseException] = {}
        """Children whose follower in this process failed (not their flow: its own code)."""

    def __enter__(self) -> Children:
        from prefect.context import FlowRunContext

        self._parent = FlowRunContext.get()
        self._thread.start()
        try:
            self._call(self._open())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            if self._thread.is_alive():
                self._call(self._close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---------------------------------------------------------------- on the loop

    async def _open(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound
        from prefect.tasks import Task

        from prefect_spotgpu.decorators import CALLER_WORKER_PREFIX, check_pool

        self._client = get_client()
        await self._client.__aenter__()
        try:
            work_pool = await self._client.read_work_pool(self.child.work_pool)
        except ObjectNotFound:
            work_pool = None
        check_pool(work_pool, self.child.work_pool)
        self.bundle = await self._bundle(work_pool)
        flow = self.bundle.flow
        self._subflow_task = Task(name=flow.name, fn=flow.fn, version=flow.version)
        if not self.to_pool:
            from prefect_spotgpu.worker import SpotGPUWorker

            worker = SpotGPUWorker(
                work_pool_name=self.child.work_pool,
                name=f"{CALLER_WORKER_PREFIX} {os.uname().nodename}:{os.getpid()} fan-out",
                create_pool_if_not_found=False,
            )
            worker.claims_runs = True  # the pool's worker leaves its children to it
            ready, self._stop = asyncio.Event(), asyncio.Event()
            self._host = asyncio.get_running_loop().create_task(self._host_worker(worker, ready))
            await asyncio.wait(
                [self._host, asyncio.ensure_future(ready.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self._host.done():  # it could not start: say why
                self._host.result()

    async def _host_worker(self, worker, ready: asyncio.Event) -> None:
        """The worker of this process, entered and left in this one task (anyio's rule)."""
        async with worker:
            self._worker = worker
            ready.set()
            await self._stop.wait()

    async def _close(self) -> None:
        for task in self._follows.values():  # the parent is done or failed: stop following
            task.cancel()
        await asyncio.gather(*self._follows.values(), return_exceptions=True)
        if self._worker is not None:
            self._stop.set()
            await self._host
        await self._client.__aexit__(None, None, None)

    async def _bundle(self, work_pool) -> SharedBundle:
        """Bundle the child flow once and store it where the pool's upload step would."""
        from prefect.bundles import convert_step_to_command, create_bundle_for_flow_run
        from prefect.client.schemas.objects import FlowRun
        from prefect.utilities.processutils import command_to_string
        from prefect.workers.base import resolve_bundle_step_with_launcher

        from prefect_spotgpu.blocks import CheckpointStorage
        from prefect_spotgpu.bundles import UPLOAD_STEP, bundle_name
        from prefect_spotgpu.prefect_internals import with_pool_result_storage

        flow = await with_pool_result_storage(
            self.child, work_pool.storage_configuration.default_result_storage_block_id
        )
        flow_id = await self._client.create_flow(flow)
        key = str(uuid.uuid4())
        storage = work_pool.storage_configuration
        block = storage.bundle_upload_step.get(UPLOAD_STEP, {}).get("block")
        if block is None:
            raise RuntimeError(
                f"work pool {work_pool.name!r} uploads bundles with another step than "
                f"{UPLOAD_STEP}: run `spotgpu pool setup {work_pool.name}`"
            )
        made = create_bundle_for_flow_run(
            flow=flow, flow_run=FlowRun(flow_id=flow_id), context=_bundle_context()
        )
        if made["zip_path"] is not None:  # include_files: not carried by this pool's steps
            made["zip_path"].unlink(missing_ok=True)
            raise RuntimeError(
                "a fan-out's child flow cannot take include_files: its code travels in its "
                "bundle; put data in the pool's storage (prefect_spotgpu.fanout.storage_of)"
            )
        data = json.dumps(made["bundle"]).encode()
        objects = (await CheckpointStorage.aload(block)).objects()
        await asyncio.to_thread(objects.put, bundle_name(key), data)
        execute = resolve_bundle_step_with_launcher(
            storage.bundle_execution_step, getattr(self.child, "launcher", None), "execution"
        )
        return SharedBundle(
            key=key,
            sha256=hashlib.sha256(data).hexdigest(),
            command=command_to_string(convert_step_to_command(execute, key)),
            flow=flow,
            flow_id=flow_id,
        )

    def _job_variables(self) -> dict:
        return {**(self.child.job_variables or {}), "command": self.bundle.command}

    async def _create(self, params: dict, gate: asyncio.Semaphore):
        from prefect.client.schemas.actions import FlowRunCreate
        from prefect.client.schemas.objects import FlowRun, FlowRunPolicy
        from prefect.context import TagsContext
        from prefect.states import Pending, Scheduled, to_state_create

        from prefect_spotgpu.protocol import LABELS

        flow = self.bundle.flow
        async with gate:
            parent_task_run = None
            if self._parent is not None:  # the parent's subflow, for Prefect's UI
                parent_task_run = await self._subflow_task.create_run(
                    client=self._client, flow_run_context=self._parent, parameters=params
                )
            create = FlowRunCreate(
                flow_id=self.bundle.flow_id,
                flow_version=flow.version,
                parameters=flow.serialize_parameters(params),
                tags=list(TagsContext.get().current_tags),
                parent_task_run_id=getattr(parent_task_run, "id", None),
                state=to_state_create(Scheduled() if self.to_pool else Pending()),
                empirical_policy=FlowRunPolicy(
                    retries=flow.retries, retry_delay=int(flow.retry_delay_seconds or 0)
                ),
                work_pool_name=self.child.work_pool,
                job_variables=self._job_variables(),
                labels={LABELS.BUNDLE_SHA256: self.bundle.sha256},
            )
            response = await self._client.request(
                "POST", "/flow_runs/", json=create.model_dump(mode="json")
            )
            flow_run = FlowRun.model_validate(response.json())
        if self._worker is not None:
            follow = self._follow(flow_run)
            self._follows[flow_run.id] = asyncio.get_running_loop().create_task(follow)
        return flow_run.id

    async def _follow(self, flow_run) -> None:
        try:
            await self._worker.follow(flow_run)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the parent reads it as this child's end
            self.errors[flow_run.id] = exc

    async def _create_many(self, params: Sequence[dict]) -> list[UUID | Exception]:
        gate = asyncio.Semaphore(CREATE_CONCURRENCY)
        made = await asyncio.gather(
            *(self._create(p, gate) for p in params), return_exceptions=True
        )
        for outcome in made:  # a cancellation or an interrupt is not one child's failure
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        return list(made)

    async def _read_states(self, ids: Sequence[UUID]) -> dict:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        states = {}
        for first in range(0, len(ids), READ_PAGE):
            page = list(ids[first : first + READ_PAGE])
            runs = await self._client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=page)), limit=len(page)
            )
            states.update({run.id: run.state for run in runs})
        return states

    # ---------------------------------------------------------------- the parent's calls

    def create(self, params: Sequence[dict]) -> list[UUID | Exception]:
        """Create one child per item of ``params`` (its keyword arguments), concurrently; their
        flow run ids, in order, or for a child that could not be created the error (the
        others are made all the same: none is lost track of)."""
        return self._call(self._create_many(params)) if params else []

    def states(self, ids: Sequence[UUID]) -> dict:
        """The current state of each of these children, by flow run id."""
        return self._call(self._read_states(ids)) if ids else {}

    def following(self, flow_run_id: UUID) -> bool:
        """Whether the worker of this process still follows the child."""
        task = self._follows.get(flow_run_id)
        return task is not None and not task.done()


def _bundle_context() -> dict:
    """The context a shared bundle carries: the caller's tags, nothing else. Prefect's own
    submission serializes the caller's whole context, the parent flow run's with its flow
    (a parent closing over a thread or a lock cannot be pickled) and the caller's settings
    (its Prefect API key, written into storage); ``bundles.execute`` reads none of it."""
    from prefect.context import TagsContext

    tags = TagsContext.get()
    return {
        "flow_run_context": {},
        "task_run_context": {},
        "tags_context": tags.serialize() if tags else {},
        "settings_context": {},
        "asset_context": {},
        "deployment_id": None,
        "deployment_parameters": None,
    }


def result_of(flow_run_id: UUID) -> Any:
    """A completed child's result, from the storage its engine persisted it to."""
    from prefect.futures import PrefectFlowRunFuture

    return PrefectFlowRunFuture(flow_run_id).result()
