"""``@spot_gpu``: a flow that runs on spot GPUs when it is called, as Prefect's integration
decorators do (``prefect_docker.docker``, ``prefect.flows.bind_flow_to_infrastructure``).

Example:
    ```python
    from prefect import flow
    from prefect_spotgpu import spot_gpu

    @spot_gpu(work_pool="spot", gpu_model="A100-80G", max_price=1.2)
    @flow
    def train(steps: int) -> float:
        ...

    loss = train(steps=500)            # runs on a spot GPU; returns the flow's result
    future = train.submit(steps=500)   # returns at once; future.result() waits
    future = train.submit_to_work_pool(steps=500)  # the pool's running worker takes it
    ```

A call runs a ``spot-gpu`` worker in the caller's process (``BaseWorker.submit``): it creates
the flow run, uploads the flow as a bundle into the pool's storage (``prefect_spotgpu.bundles``),
bids, and follows the run **across its preemptions** until it is over, so the call returns the
final result, not an error of the first attempt. When the pool's own long-running worker takes
a rescheduled run first, the call waits for that worker to finish it. Ctrl-C cancels the run
and its bid. A run that is Crashed only while a worker turns it into Preempted is not taken for
the end (``SpotRunFuture``).

Job variables are checked when the flow is decorated, against the worker's own variables
(``SpotGPUJobConfiguration``): a mistake names the variable, and an
unknown GPU model lists the ones the market sells.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar
from uuid import UUID

from prefect.flows import Flow, InfrastructureBoundFlow, bind_flow_to_infrastructure
from prefect.futures import PrefectFlowRunFuture
from prefect.utilities.asyncutils import run_coro_as_sync
from prefect.utilities.callables import get_call_parameters
from pydantic import ValidationError

from prefect_spotgpu.prefect_internals import work_pool_of

R = TypeVar("R")

CRASH_SETTLE_SECONDS = 20.0
"""How long a run may stay Crashed before a waiting caller takes it for its end: a spot-gpu
worker proposes Preempted from the engine's own Crashed (at a reclaim's SIGTERM) within a
second or two, so only a real, unfollowed crash lasts this long."""
NO_WORKER_SECONDS = 30.0
"""How long a run may wait for a worker, with none of its pool alive, before the caller is
told what to start (instead of waiting for ever)."""


def check_job_variables(job_variables: dict[str, Any]) -> None:
    """Refuse, at decoration time, job variables the spot-gpu worker does not take or values
    it would refuse, with an error that names the variable (and the choices, where a field
    has them)."""
    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    known = set(SpotGPUJobConfiguration.model_fields)
    unknown = sorted(set(job_variables) - known)
    if unknown:
        raise ValueError(
            f"unknown spot-gpu job variable(s) {', '.join(unknown)}; the worker takes: "
            f"{', '.join(sorted(known))}"
        )
    plain = {k: v for k, v in job_variables.items() if k not in ("market", "checkpoint_storage")}
    try:  # any spelling of a GPU model the market knows ("H100" is H100-80G)
        SpotGPUJobConfiguration.model_validate(plain)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "job variables"
        message = error["msg"].removeprefix("Value error, ")
        raise ValueError(f"job variable {where}: {message}") from None


def spot_gpu(
    work_pool: str, *, launcher: Any = None, **job_variables: Any
) -> Callable[[Flow[..., R]], SpotGPUFlow[..., R]]:
    """Bind a flow to spot GPUs of the ``spot-gpu`` pool ``work_pool`` (module doc).

    ``job_variables`` override the pool's defaults for this flow: ``gpu_model``,
    ``gpu_count``, ``max_price``, ``region``, ``image``, ``deadline_hours``, ... (the pool's
    form in the Prefect UI lists them). ``launcher``: Prefect's bundle launcher override; by
    default this process's own Python uploads the bundle and the node's Python runs it.
    """
    check_job_variables(job_variables)

    def decorator(flow: Flow[..., R]) -> SpotGPUFlow[..., R]:
        bound = bind_flow_to_infrastructure(
            flow,
            work_pool=work_pool,
            worker_cls=_worker_cls(),
            job_variables=job_variables,
            launcher=launcher or {"upload": [sys.executable], "execution": ["python"]},
        )
        return SpotGPUFlow.of(bound)

    return decorator


def _worker_cls():
    from prefect_spotgpu.worker import SpotGPUWorker

    return SpotGPUWorker


CALLER_WORKER_PREFIX = "spot-gpu caller"
"""The name of a worker that runs in a caller's process: it follows its own run only (it
takes no other run and adopts none), so it does not count as one serving the pool."""


class SpotGPUFlow(InfrastructureBoundFlow):
    """A flow bound to a spot-gpu pool: calling it runs it on spot GPUs (module doc)."""

    @classmethod
    def of(cls, bound: InfrastructureBoundFlow) -> SpotGPUFlow:
        """``bound`` as a spot-gpu flow: a new one with all its attributes, as Prefect's
        ``bind_flow_to_infrastructure`` makes a bound copy of a flow."""
        flow = cls(
            bound.fn, work_pool=bound.work_pool, job_variables={}, worker_cls=bound.worker_cls
        )
        flow.__dict__.update(bound.__dict__)
        return flow

    def with_options(self, **options: Any) -> SpotGPUFlow:
        if options.get("job_variables") is not None:
            check_job_variables(options["job_variables"])
        return SpotGPUFlow.of(super().with_options(**options))

    def __call__(self, *args: Any, return_state: bool = False, wait_for=None, **kwargs: Any):
        parameters = get_call_parameters(self, args, kwargs)
        if inspect.iscoroutinefunction(self.fn):
            return self._call(parameters, return_state)
        holder = _Submission()
        try:
            return run_coro_as_sync(self._call(parameters, return_state, holder))
        except KeyboardInterrupt:
            if holder.flow_run_id is not None:
                cancel_run(self, holder.flow_run_id, "cancelled by its caller (Ctrl-C)")
            raise

    async def _call(self, parameters: dict, return_state: bool, holder=None):
        future = SpotRunFuture(await self._follow(parameters, holder), self.work_pool)
        if return_state:
            await future.wait_async()
            return future.state
        return await future.aresult()

    async def _follow(self, parameters: dict, holder=None) -> UUID:
        """Run the flow through a spot-gpu worker in this process until the run is over (or
        the pool's worker took it over); the flow run's id."""
        _check_upload_sees_prefect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "ad-hoc submission is experimental"
            async with self.worker_cls(
                work_pool_name=self.work_pool,
                name=f"{CALLER_WORKER_PREFIX} {os.uname().nodename}:{os.getpid()}",
                create_pool_if_not_found=False,
            ) as worker:
                check_pool(work_pool_of(worker), self.work_pool)
                future = await worker.submit(
                    flow=self, parameters=parameters, job_variables=self.job_variables
                )
                if holder is not None:
                    holder.flow_run_id = future.flow_run_id
        return future.flow_run_id

    def submit(self, *args: Any, **kwargs: Any) -> SpotRunFuture:
        """Start the run and return at once: the run is followed in a background thread of
        this process, across its preemptions; ``.result()`` waits for it."""
        parameters = get_call_parameters(self, args, kwargs)
        holder = _Submission()

        def follow() -> None:
            try:
                asyncio.run(self._follow(parameters, holder))
            except BaseException as exc:  # handed to the future's waiter
                holder.error = exc
            finally:
                holder.started.set()

        _check_upload_sees_prefect()
        context = contextvars.copy_context()  # this caller's Prefect settings, in the thread
        thread = threading.Thread(
            target=context.run, args=(follow,), name=f"spot-gpu {self.name}", daemon=True
        )
        thread.start()
        while holder.flow_run_id is None and not holder.started.wait(0.05):
            pass
        if holder.flow_run_id is None:
            raise holder.error or RuntimeError("the flow run could not be submitted")
        return SpotRunFuture(holder.flow_run_id, self.work_pool, thread=thread, holder=holder)

    def submit_to_work_pool(self, *args: Any, **kwargs: Any) -> SpotRunFuture:
        """Create the run for the pool's running worker to take (no worker in this process).
        Refused at once, saying what to start, when no worker of the pool is alive."""
        _check_upload_sees_prefect()
        if not run_coro_as_sync(live_workers(self.work_pool)):
            raise RuntimeError(
                f"no worker of work pool {self.work_pool!r} is running to take the run: start "
                f"one with `prefect worker start --pool {self.work_pool} --type spot-gpu`, or "
                "call the flow (or .submit() it) to run a worker in this process"
            )
        future = super().submit_to_work_pool(*args, **kwargs)
        return SpotRunFuture(future.flow_run_id, self.work_pool)


class _Submission:
    def __init__(self) -> None:
        self.flow_run_id: UUID | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()


class SpotRunFuture(PrefectFlowRunFuture):
    """A spot run's future: waits through preemptions (a transient Crashed is not the end)
    and for the thread of this process that follows the run, if any; never for ever when no
    worker is left to run it."""

    def __init__(self, flow_run_id: UUID, work_pool: str, *, thread=None, holder=None) -> None:
        super().__init__(flow_run_id)
        self.work_pool, self._thread, self._holder = work_pool, thread, holder
        self._crashed_since: float | None = None

    def following(self) -> bool:
        """Whether a thread of this process still follows the run (``submit``)."""
        return self._thread is not None and self._thread.is_alive()

    def settled(self) -> bool:
        """Whether the run's state is its end (``_settles``)."""
        return self._settles(self.state, time.monotonic())

    def _settles(self, state, now: float) -> bool:
        """Whether ``state`` is the run's end: final, and if Crashed, Crashed for
        ``CRASH_SETTLE_SECONDS`` (no worker turned it into Preempted meanwhile)."""
        if state is None or not state.is_crashed():
            self._crashed_since = None
            return state is not None and state.is_final()
        self._crashed_since = self._crashed_since or now
        return now - self._crashed_since >= CRASH_SETTLE_SECONDS

    async def wait_async(self, timeout: float | None = None) -> None:
        from prefect.client.orchestration import get_client

        start = time.monotonic()
        while self._thread is not None and self._thread.is_alive():
            if timeout is not None and time.monotonic() - start >= timeout:
                return
            await asyncio.sleep(0.2)
        if self._holder is not None and self._holder.error is not None:
            raise self._holder.error
        idle_since = None
        async with get_client() as client:
            while self._final_state is None:
                state = (await client.read_flow_run(self.flow_run_id)).state
                now = time.monotonic()
                if self._settles(state, now):
                    self._final_state = state
                elif state is None or not state.is_crashed():
                    if state is not None and state.is_scheduled():
                        idle_since = idle_since or now
                        if now - idle_since >= NO_WORKER_SECONDS:
                            if not await live_workers(self.work_pool):
                                raise RuntimeError(
                                    f"flow run {self.flow_run_id} waits for a worker, and no "
                                    f"worker of pool {self.work_pool!r} is running: start one "
                                    f"with `prefect worker start --pool {self.work_pool} "
                                    "--type spot-gpu`"
                                )
                            idle_since = now
                    else:
                        idle_since = None
                if timeout is not None and now - start >= timeout:
                    return
                if self._final_state is None:
                    await asyncio.sleep(0.3)

    def wait(self, timeout: float | None = None) -> None:
        return run_coro_as_sync(self.wait_async(timeout=timeout))


def cancel_run(flow: SpotGPUFlow, flow_run_id: UUID, message: str) -> None:
    """Cancel the run's bid on the market (its job stops at the next tick) and the flow run
    (once a running job's engine has reported the stop: at most 15 s)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    from prefect_spotgpu.protocol import LABELS
    from prefect_spotgpu.worker.config import market_of

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        bid = (run.labels or {}).get(LABELS.BID)
        if bid is not None:
            with market_of(flow_configuration(flow)).get_client() as market:
                market.post(f"/bids/{bid}/cancel")
        running = bid is not None and run.state is not None and run.state.is_running()
        state = _state_once_the_job_stopped(client, flow_run_id) if running else run.state
        # The job's engine reports Crashed on the SIGTERM of its stop, which this replaces.
        if state is None or not state.is_final() or state.is_crashed():
            client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)


def flow_configuration(flow):
    """The job configuration of a bound flow's runs: its pool's template with the flow's job
    variables (its market, its checkpoint storage)."""
    from prefect.client.orchestration import get_client

    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(flow.work_pool)
    return run_coro_as_sync(
        SpotGPUJobConfiguration.from_template_and_values(pool.base_job_template, flow.job_variables)
    )


def _state_once_the_job_stopped(client, flow_run_id: UUID, timeout: float = 15.0):
    """The run's state once its engine has reported its end (Crashed, on the SIGTERM of the
    stop of a cancelled bid's job), or as it is after ``timeout`` (a job killed outright)."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.read_flow_run(flow_run_id).state
        if (state is not None and state.is_final()) or time.monotonic() > deadline:
            return state
        time.sleep(0.25)


def check_pool(work_pool, pool: str) -> None:
    """A clear error for a pool that cannot run decorated flows (before anything is bid);
    ``work_pool`` is None when there is no such pool."""
    if work_pool is None:
        raise RuntimeError(
            f"there is no work pool {pool!r}: create it with `spotgpu pool setup {pool}` "
            "(after `spotgpu blocks save`, which saves the market and storage blocks it uses)"
        )
    if work_pool.type != "spot-gpu":
        raise RuntimeError(
            f"work pool {pool!r} is of type {work_pool.type!r}, not spot-gpu: recreate it with "
            f"`spotgpu pool setup {pool} --replace` (its queued runs stay)"
        )
    storage = work_pool.storage_configuration
    if storage.bundle_upload_step is None or storage.bundle_execution_step is None:
        raise RuntimeError(
            f"work pool {pool!r} has no bundle storage, so a flow called from code cannot "
            f"reach its node: run `spotgpu pool setup {pool}` (it configures the "
            "pool's checkpoint storage for bundles and results)"
        )


async def live_workers(pool: str) -> list[str]:
    """Names of the pool's workers whose last heartbeat is recent."""
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client

    async with get_client() as client:
        workers = await client.read_workers_for_work_pool(pool)
    from prefect_spotgpu.worker.reactions import is_live

    now = datetime.now(UTC).timestamp()
    return [
        w.name
        for w in workers
        if not w.name.startswith(CALLER_WORKER_PREFIX)
        and is_live(
            w.last_heartbeat_time and w.last_heartbeat_time.timestamp(),
            w.heartbeat_interval_seconds or 30,
            now,
        )
    ]


def _check_upload_sees_prefect() -> None:
    """The bundle upload runs as a child process of this one (the pool's upload step, started
    by Prefect with this process's environment), and finds the Prefect API as a new process
    does: from the environment and the active profile. A caller whose API (or key) is set in
    this process's memory alone (``temporary_settings``) would upload nowhere: refused here,
    saying what to set, before anything is created."""
    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL, Settings

    child = Settings()  # (what a new process reads: the environment and the profile)
    for setting, seen, name in (
        (PREFECT_API_URL, child.api.url, "PREFECT_API_URL"),
        (PREFECT_API_KEY, child.api.key, "PREFECT_API_KEY"),
    ):
        value = setting.value()
        if value and _plain(value) != _plain(seen):
            raise RuntimeError(
                f"this process's {name} is set in memory only (temporary_settings?), and "
                "the flow's bundle is uploaded by a child process, which would not see it: "
                f"set {name} in the environment or the active profile (prefect config set "
                f"{name}=...)"
            )


def _plain(value) -> str | None:
    if value is None:
        return None
    return str(value.get_secret_value() if hasattr(value, "get_secret_value") else value)
