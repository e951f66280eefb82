"""The Prefect worker type ``spot-gpu``: flow runs bid for GPUs, preemption is a resumable state.

One market bid serves a flow run for its whole life, across preemptions: the market reserves
capacity for the *bid* when it notices an allocation (a migration), so keeping the bid is what
makes a resume fast. The bid is created once (idempotency key = flow run id + run count) and
named on the flow run by the label ``spotgpu.bid``; a re-picked run finds it there.

Every allocation of the bid runs ``python -m prefect_spotgpu.launch`` on its node, which waits
for this worker's go before it becomes the engine (``prefect_spotgpu.launch``). Single writer:
between attempts only this worker changes the flow run's state. One attempt (``run``)::

    Pending -> Submitting             BaseWorker
    Pending "AwaitingGPU"             bid created or found; the message shows bid and quote
    Pending "Starting"                an allocation runs: label spotgpu.allocation = its id
    Running                           the engine on the node (the launcher exec'd it)
    notice                            log line + event spotgpu.bid.noticed
    preempted                         Scheduled "Preempted" (now); run() returns 0; picked up
                                      again within a second, and the next allocation starts
    finished                          the engine wrote the final state; run() returns 0

A run with ``gpu_hours`` and a deadline is paced by a bidding policy (``placement``,
``pacing``): its spot bid is repriced, or replaced by an on-demand bid when spot can no longer
meet the deadline. Beyond ``max_preemptions`` the run is Failed and the bid cancelled.
Cancelling the flow run cancels the bid; the market stops the job. A worker that restarts
adopts the runs whose bids it finds open and whose worker is gone (no duplicate bid, no
orphaned job). A worker told to stop (SIGTERM, SIGINT) leaves its runs to the next worker and
exits within a few seconds (see ``SpotGPUWorker``).

This module is the BaseWorker glue only: start, run, kill_infrastructure, adoption. Each rule
above is decided in ``reactions`` (pure, unit-tested on plain data) and carried out by
``attempt``; ``placement`` places and paces the bids through ``market_api``.
"""

from __future__ import annotations

import asyncio
import os
import re
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import anyio
from prefect.exceptions import InfrastructureNotFound, ObjectNotFound, PrefectHTTPStatusError
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
from prefect.workers.base import BaseVariables, BaseWorker, BaseWorkerResult

from prefect_spotgpu.blocks import DOCS, LOGO
from prefect_spotgpu.messages import BidResponse
from prefect_spotgpu.prefect_internals import flush_prefect_queues
from prefect_spotgpu.protocol import LABELS, PID_PREFIX
from prefect_spotgpu.worker import reactions as rules
from prefect_spotgpu.worker.attempt import Attempt, PrefectRun, open_bid, view_of
from prefect_spotgpu.worker.bid_batch import BidBatchers
from prefect_spotgpu.worker.config import (
    SpotGPUJobConfiguration,
    check_storage,
    market_of,
)
from prefect_spotgpu.worker.market_api import MarketApi
from prefect_spotgpu.worker.placement import Placement, SwitchBid

QUERY_SECONDS = 1.0
"""How often the worker asks for scheduled runs, unless PREFECT_WORKER_QUERY_SECONDS is set:
Prefect's default of 10 s would make every resume wait up to 10 s."""
RELEASE_SECONDS = 2.0
"""How long a stopping worker may take to mark the runs it follows as released (one label
update per run, concurrently; 1 s proved too tight for a Prefect server under load)."""
FLUSH_SECONDS = 1.5
"""How long a stopping worker may take to hand Prefect the logs and events it still holds."""


class SpotGPUWorkerResult(BaseWorkerResult):
    """The end of one attempt: 0 when the run completed, was rescheduled or was failed by us."""


def infrastructure_id(bid: BidResponse) -> str:
    return f"{PID_PREFIX}{bid.id}"


class SpotGPUWorker(BaseWorker[SpotGPUJobConfiguration, BaseVariables, SpotGPUWorkerResult]):
    """Runs each flow run on spot GPUs bought from a prefect-spotgpu market.

    **Stopping.** On SIGTERM or SIGINT (``prefect worker start`` turns both into a
    cancellation of the worker) the worker stops asking for runs and stops following the
    ones it follows, and it leaves them as they are: their bids stay open, their jobs keep
    running on their nodes, their flow runs keep their states. Nothing is cancelled. Each
    such run is labelled ``spotgpu.released-by`` = this worker's name (within
    ``RELEASE_SECONDS``), so the next worker of the pool adopts it on its first pass, at
    its start, whatever its name; a run that could not be labelled (Prefect unreachable)
    is adopted once this worker's last heartbeat is three heartbeat intervals old. A
    preemption that completes meanwhile is caught up by the adopting worker.
    Then the logs and events still queued for Prefect get ``FLUSH_SECONDS``; what an
    unreachable API has not taken by then is dropped (Prefect would retry each event for
    ~7 s and each batch of logs for ~1 min at exit, and drop it after). So the process
    exits within a few seconds, with status 0. A second SIGTERM or SIGINT kills it at once
    (Prefect's handler): its runs are then adopted as after a crash, by heartbeat age.
    """

    type = "spot-gpu"
    job_configuration = SpotGPUJobConfiguration
    # no job_configuration_variables: Prefect derives the pool's form from the configuration
    _description = (
        "Run flows on idle GPUs bought by the second from a prefect-spotgpu market, at a "
        "maximum price you set; a reclaimed node gives a 5-minute notice and the run resumes "
        "from its checkpoint on another node."
    )
    _display_name = "Spot GPU"
    _documentation_url = DOCS
    _logo_url = LOGO

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._following: set[str] = set()
        self._polling = False  # True under start(): Prefect's loop picks rescheduled runs
        self._beats: asyncio.Task | None = None  # a caller's worker: heartbeats while it follows
        self._callers = 0  # runs a caller's worker follows now (``run`` outside Prefect's loop)
        self.claims_runs = False  # a fan-out's worker: label its runs, beat while it follows
        self.batchers = BidBatchers()  # its runs' new bids, placed together; closed with it

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """Prefect's worker loop, asking for scheduled runs every second (see QUERY_SECONDS);
        when it ends, a bounded flush of Prefect's logs and events (see the class docstring)."""
        self._polling = True
        try:
            if "PREFECT_WORKER_QUERY_SECONDS" in os.environ:
                return await super().start(*args, **kwargs)
            with temporary_settings({PREFECT_WORKER_QUERY_SECONDS: QUERY_SECONDS}):
                return await super().start(*args, **kwargs)
        finally:
            local = getattr(self._logger, "logger", self._logger)  # no worker id: never queued
            with anyio.CancelScope(shield=True):
                await flush_prefect_queues(FLUSH_SECONDS, local)

    async def teardown(self, *exc_info: Any) -> None:
        """Prefect's teardown; a worker stopped while following runs first releases them."""
        if self._beats is not None:
            self._beats.cancel()
        if exc_info and exc_info[0] is not None:
            await self._release_runs()
        await anyio.to_thread.run_sync(self.batchers.close)  # its bids' threads end with it
        await super().teardown(*exc_info)

    async def _release_runs(self) -> None:
        """Label the runs this worker follows ``spotgpu.released-by`` (bounded, best effort):
        the next worker adopts them at once (``_adopt_orphans``)."""
        runs = sorted(self._following)
        if not runs or self._client is None:
            return

        async def release(run_id: str) -> None:
            try:
                await self.client.update_flow_run_labels(
                    UUID(run_id), {LABELS.RELEASED_BY: self.name}
                )
            except Exception as exc:
                self._logger.debug("could not release flow run %s: %s", run_id, exc)

        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_SECONDS) as bounded:
            async with anyio.create_task_group() as group:
                for run_id in runs:
                    group.start_soon(release, run_id)
        if bounded.cancelled_caught:
            self._logger.warning(
                "Stopping: could not release flow run(s) %s in %.1f s; the next worker "
                "adopts them once this worker's last heartbeat is 3 intervals old",
                ", ".join(runs),
                RELEASE_SECONDS,
            )
        else:
            self._logger.info(
                "Stopping: flow run(s) %s left to the next worker (bids open, jobs running)",
                ", ".join(runs),
            )

    # ---------------------------------------------------------------- one attempt

    async def run(
        self,
        flow_run,
        configuration: SpotGPUJobConfiguration,
        task_status: anyio.abc.TaskStatus | None = None,
    ) -> SpotGPUWorkerResult:
        """One attempt of the run; for a worker that Prefect's loop does not drive (a flow
        called from code: ``BaseWorker.submit`` in the caller's process), every attempt until
        the run is over, so the caller's call follows the run across its preemptions. A
        rescheduled run is taken again as Prefect's loop would take it (Pending, compare-and-
        set on the server): when the pool's own worker takes it first, this one lets it go."""
        if self._polling:
            return await self._attempt(flow_run, configuration, task_status)
        self._callers += 1
        if self.claims_runs:
            self._keep_beating()
        try:
            result = await self._attempt(flow_run, configuration, task_status)
            while result.status_code == 0:
                flow_run = await self._take_again(flow_run)
                if flow_run is None:
                    break
                result = await self._attempt(flow_run, configuration, None)
            return result
        finally:
            self._callers -= 1
            if self._callers == 0 and self._beats is not None:
                self._beats.cancel()

    async def follow(self, flow_run) -> None:
        """Follow a run this worker did not take from Prefect's loop (a fan-out's child, made
        Pending by its parent) until it is over or another worker took it; an end without a
        final state is proposed Crashed, as ``BaseWorker.submit`` does for its own runs."""
        configuration = await self.job_configuration.resolve_for_flow_run(
            flow_run, client=self.client, work_pool=self.work_pool, worker_name=self.name
        )
        result = await self.run(flow_run, configuration)
        if result.status_code != 0:
            await self._propose_crashed_state(
                flow_run, f"The spot-gpu job ended with status {result.status_code}"
            )

    async def _claim(self, flow_run) -> None:
        """Label the run with this worker's name (``prefect.worker.name``), as Prefect's loop
        does for the runs it takes: the pool's worker then leaves it to this one while this
        one sends its heartbeat. A run Prefect does not know is not labelled."""
        try:
            await self.client.update_flow_run_labels(flow_run.id, {LABELS.WORKER: self.name})
        except (ObjectNotFound, PrefectHTTPStatusError) as exc:
            self._logger.debug("flow run %s not labelled: %s", flow_run.id, exc)

    def _keep_beating(self) -> None:
        """A worker that Prefect's loop does not drive (a caller's) sends its heartbeat while
        it follows runs, as a polling worker does: the pool's worker adopts a run only when
        the worker that labelled it ``prefect.worker.name`` is silent (``_adopt_orphans``), so
        a caller that is alive keeps its runs and one that died loses them."""
        if self._beats is not None and not self._beats.done():
            return

        async def beat() -> None:  # a bare heartbeat: sync_with_backend would start tasks
            while True:  # in the runs' task group, which a caller's worker then waits on
                try:
                    await self.client.send_worker_heartbeat(
                        work_pool_name=self._work_pool_name,
                        worker_name=self.name,
                        heartbeat_interval_seconds=self.heartbeat_interval_seconds,
                    )
                except Exception as exc:  # Prefect briefly unreachable: the next beat
                    self._logger.debug("heartbeat failed: %s", exc)
                await anyio.sleep(self.heartbeat_interval_seconds)

        self._beats = asyncio.get_running_loop().create_task(beat())

    async def _take_again(self, flow_run):
        """The run, Pending again for this worker, once it is rescheduled (Preempted now, or
        paused until its window opens); None when it is over or another worker took it."""
        while True:
            flow_run = await self.client.read_flow_run(flow_run.id)
            state = flow_run.state
            if state is None or not state.is_scheduled():
                self._logger.info(
                    "Flow run %s is %s: this worker follows it no further",
                    flow_run.id,
                    state.name if state else "without a state",
                )
                return None
            wait = (state.state_details.scheduled_time or datetime.now(UTC)).timestamp() - (
                datetime.now(UTC).timestamp()
            )
            if wait <= 0:
                break
            self._logger.info("Flow run %s resumes in %.0f s (its schedule)", flow_run.id, wait)
            await anyio.sleep(min(wait, 60.0))
        if not await self._propose_pending_state(flow_run):
            self._logger.info("Flow run %s was taken by another worker", flow_run.id)
            return None
        self._logger.info("Following flow run %s again after its preemption", flow_run.id)
        return await self.client.read_flow_run(flow_run.id)

    async def _attempt(
        self,
        flow_run,
        configuration: SpotGPUJobConfiguration,
        task_status: anyio.abc.TaskStatus | None,
    ) -> SpotGPUWorkerResult:
        market = market_of(configuration)
        check_storage(configuration)
        self._following.add(str(flow_run.id))  # from its first step: no adoption pass takes it
        try:
            if self.claims_runs and not self._polling:  # Prefect's loop labels its own
                await self._claim(flow_run)
            async with market.get_async_client() as http:
                prefect_run, api = PrefectRun(self, flow_run), MarketApi(http, self.batchers)
                placement = Placement(api, prefect_run, configuration, self._work_pool_name)
                bid = await open_bid(prefect_run, api, placement, configuration)
                if task_status is not None:
                    task_status.started(infrastructure_id(bid))
                return await self._follow_bids(prefect_run, api, placement, bid)
        finally:
            self._following.discard(str(flow_run.id))

    async def _follow_bids(
        self, run: PrefectRun, api: MarketApi, placement: Placement, bid: BidResponse
    ) -> SpotGPUWorkerResult:
        """Follow the run's bid; when pacing moves a waiting run to on-demand capacity,
        follow the new bid instead (once: on-demand is never left)."""
        while True:
            outcome = await Attempt(run, api, placement, placement.configuration, bid).follow()
            if not isinstance(outcome, SwitchBid):
                return SpotGPUWorkerResult(identifier=infrastructure_id(bid), status_code=outcome)
            bid = outcome.bid

    async def kill_infrastructure(
        self,
        infrastructure_pid: str,
        configuration: SpotGPUJobConfiguration,
        grace_seconds: int = 30,
    ) -> None:
        """Cancel the bid named by ``infrastructure_pid``; the market stops its job."""
        match = re.fullmatch(rf"{PID_PREFIX}(\d+)", infrastructure_pid or "")
        if match is None:
            raise InfrastructureNotFound(f"{infrastructure_pid!r} is not a spot-gpu bid")
        async with market_of(configuration).get_async_client() as http:
            if not await MarketApi(http).cancel_known(match[1]):
                raise InfrastructureNotFound(f"bid {match[1]} not found on the market")

    # ---------------------------------------------------------------- restarts

    async def sync_with_backend(self) -> None:
        """Prefect's heartbeat, and then a look for runs an earlier worker left behind."""
        await super().sync_with_backend()
        # a worker in a caller's process (a flow called from code) follows its own run only
        if self._polling and self._work_pool is not None and self._runs_task_group:
            try:
                await self._adopt_orphans()
            except Exception:
                self._logger.exception("could not look for runs left by an earlier worker")

    async def _adopt_orphans(self) -> None:
        """Follow the runs of this pool that an earlier worker left Pending or Running."""
        work_pool = self.work_pool
        pool_config = await self.job_configuration.from_template_and_values(
            work_pool.base_job_template, {}, client=self.client
        )
        if pool_config.market is None:
            return
        now = datetime.now(UTC).timestamp()
        live_workers = {
            w.name
            for w in await self.client.read_workers_for_work_pool(work_pool.name)
            if w.name != self.name
            and rules.is_live(
                w.last_heartbeat_time and w.last_heartbeat_time.timestamp(),
                w.heartbeat_interval_seconds or self.heartbeat_interval_seconds,
                now,
            )
        }
        async with pool_config.market.get_async_client() as http:
            bids = await MarketApi(http).live_bids()
        for bid in bids:
            labels = bid.labels or {}
            if (
                labels.get(LABELS.POOL) != work_pool.name
                or labels.get(LABELS.FLOW_RUN) in self._following
            ):
                continue
            try:
                flow_run = await self.client.read_flow_run(labels[LABELS.FLOW_RUN])
            except Exception as exc:  # deleted, or Prefect unreachable: the next pass retries
                self._logger.debug("cannot read flow run of bid %s: %s", bid.id, exc)
                continue
            run_labels = flow_run.labels or {}
            owner = run_labels.get(LABELS.WORKER)
            if not rules.adoptable(
                view_of(flow_run), owner, run_labels.get(LABELS.RELEASED_BY), live_workers
            ):
                continue
            self._logger.info(
                "Adopting flow run %s (bid %s) left by worker %s", flow_run.id, bid.id, owner
            )
            await self.client.update_flow_run_labels(  # claim it: others see a live owner
                flow_run.id, {LABELS.WORKER: self.name}
            )
            self._following.add(str(flow_run.id))
            self._runs_task_group.start_soon(self._adopt, flow_run, bid)

    async def _adopt(self, flow_run, bid: BidResponse) -> None:
        try:
            configuration = await self.job_configuration.resolve_for_flow_run(
                flow_run, client=self.client, work_pool=self.work_pool, worker_name=self.name
            )
            async with market_of(configuration).get_async_client() as http:
                run, api = PrefectRun(self, flow_run), MarketApi(http, self.batchers)
                placement = Placement(api, run, configuration, self._work_pool_name)
                result = await self._follow_bids(run, api, placement, bid)
            if result.status_code != 0:
                await self._propose_crashed_state(
                    flow_run, "The spot-gpu job ended without a final state"
                )
        except Exception:  # never take the worker down; a later pass adopts it again
            self._logger.exception("following adopted flow run %s failed", flow_run.id)
        finally:
            self._following.discard(str(flow_run.id))
