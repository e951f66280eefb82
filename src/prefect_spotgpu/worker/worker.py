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
"""

from __future__ import annotations

import inspect
import json
import os
import re
import time
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import anyio
import httpx
from prefect.client.schemas.actions import ArtifactCreate
from prefect.events import emit_event
from prefect.exceptions import Abort, InfrastructureNotFound
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
from prefect.states import Cancelled, Failed, Pending, Scheduled
from prefect.utilities.engine import propose_state
from prefect.workers.base import BaseWorker, BaseWorkerResult

from prefect_spotgpu.blocks import DOCS, LOGO
from prefect_spotgpu.launch import ALLOCATION_LABEL, BID_LABEL
from prefect_spotgpu.worker.config import (
    IMAGES,
    LAUNCH_COMMAND,
    SpotGPUJobConfiguration,
    SpotGPUVariables,
)
from prefect_spotgpu.worker.market_api import (
    JOB_FAILED,
    PID_PREFIX,
    SAVED_AND_STOPPED,
    MarketError,
    Track,
    allocation_report,
    cancel_bid,
    check_storage,
    checked,
    describe,
    infrastructure_id,
    is_transient,
    market_client,
    market_of,
    plain,
    quote_text,
    resume_time,
    window_over,
)
from prefect_spotgpu.worker.pacing import PACE_SECONDS
from prefect_spotgpu.worker.placement import (
    FLOW_RUN_LABEL,
    POOL_LABEL,
    RELEASED_LABEL,
    REPLACES_LABEL,
    Attempt,
    BidPlacement,
    SwitchBid,
)

__all__ = [
    "IMAGES",
    "LAUNCH_COMMAND",
    "MarketError",
    "SpotGPUJobConfiguration",
    "SpotGPUVariables",
    "SpotGPUWorker",
    "SpotGPUWorkerResult",
]

QUERY_SECONDS = 1.0
"""How often the worker asks for scheduled runs, unless PREFECT_WORKER_QUERY_SECONDS is set:
Prefect's default of 10 s would make every resume wait up to 10 s."""
POLL_SECONDS = 2.0
"""Long-poll window on the bid's events; the flow run's state is checked between windows."""
ENGINE_EXIT_SECONDS = 10.0
"""How long a preempted run's engine may take to report its own end before we reschedule."""
RELEASE_SECONDS = 1.0
"""How long a stopping worker may take to mark the runs it follows as released."""
FLUSH_SECONDS = 1.5
"""How long a stopping worker may take to hand Prefect the logs and events it still holds."""


class SpotGPUWorkerResult(BaseWorkerResult):
    """The end of one attempt: 0 when the run completed, was rescheduled or was failed by us."""


class SpotGPUWorker(
    BidPlacement, BaseWorker[SpotGPUJobConfiguration, SpotGPUVariables, SpotGPUWorkerResult]
):
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
    job_configuration_variables = SpotGPUVariables
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

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """Prefect's worker loop, asking for scheduled runs every second (see QUERY_SECONDS);
        when it ends, a bounded flush of Prefect's logs and events (see the class docstring)."""
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
        if exc_info and exc_info[0] is not None:
            await self._release_runs()
        await super().teardown(*exc_info)

    async def _release_runs(self) -> None:
        """Label the runs this worker follows ``spotgpu.released-by`` (bounded, best effort):
        the next worker adopts them at once (``_adopt_orphans``)."""
        runs = sorted(self._following)
        if not runs or self._client is None:
            return

        async def release(run_id: str) -> None:
            try:
                await self.client.update_flow_run_labels(UUID(run_id), {RELEASED_LABEL: self.name})
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
        market = market_of(configuration)
        check_storage(configuration)
        self._following.add(str(flow_run.id))  # from its first step: no adoption pass takes it
        try:
            async with market_client(market) as http:
                bid = await self._bid_for(http, flow_run, configuration)
                if task_status is not None:
                    task_status.started(infrastructure_id(bid))
                return await self._follow_bids(http, flow_run, configuration, bid)
        finally:
            self._following.discard(str(flow_run.id))

    async def _follow_bids(self, http, flow_run, configuration, bid: dict) -> SpotGPUWorkerResult:
        """Follow the run's bid; when pacing moves a waiting run to on-demand capacity,
        follow the new bid instead (once: on-demand is never left)."""
        while True:
            result = await self._follow(http, flow_run, configuration, bid)
            if not isinstance(result, SwitchBid):
                return result
            bid = result.bid

    async def _bid_for(
        self, http: httpx.AsyncClient, flow_run, configuration: SpotGPUJobConfiguration
    ) -> dict:
        """The flow run's open bid (a resumed run), or a new one; then Pending "AwaitingGPU"."""
        bid = None
        known = (flow_run.labels or {}).get(BID_LABEL)
        if known:
            try:
                found = await self._retry_checked(
                    flow_run, "read the bid", lambda: http.get(f"/bids/{known}")
                )
            except MarketError as exc:
                if exc.status != 404:
                    raise
                found = None
            if found is not None and found["status"] in ("open", "held"):
                bid = found
                if window_over(bid):  # a cheap-window run paused: bid for the next window
                    await cancel_bid(http, bid["id"])
                    bid = None
        pace, course, replaced = configuration.pace(flow_run), None, None
        if pace is not None:
            bid, course, replaced = await self._retry(
                flow_run, "pace the run", lambda: self._steer(http, flow_run, pace, bid)
            )
        if bid is None:
            bid = await self._place_bid(http, flow_run, configuration, course, replaced)
        quote, refused = await quote_text(http, bid)
        if refused:  # it would wait for ever: say so at once, in the run's logs too
            self.get_flow_run_logger(flow_run).warning("Bid %s: %s", bid["id"], quote)
        if bid.get("window_start"):
            quote += f"; runs in the cheap window {bid['window_start']} to {bid['window_end']}"
        await self._set_state(
            flow_run,
            Pending(name="AwaitingGPU", message=f"Bid {bid['id']}: {describe(bid)}; {quote}"),
        )
        return bid

    async def _follow(
        self,
        http: httpx.AsyncClient,
        flow_run,
        configuration: SpotGPUJobConfiguration,
        bid: dict,
    ) -> SpotGPUWorkerResult | SwitchBid:
        """Follow the bid's events until this attempt ends; see the module docstring.

        The market or Prefect being briefly unreachable does not end the attempt: every call
        is retried with backoff (``_retry``); each event is folded into the track once and its
        effects (idempotent: labels, state proposals, cancels) are retried until they land."""
        logger = self.get_flow_run_logger(flow_run)
        bid_id = bid["id"]
        history = await self._retry_checked(
            flow_run,
            "read the bid's events",
            lambda: http.get(f"/bids/{bid_id}/events", params={"after": 0, "timeout": 0}),
        )
        track = Track.from_events(history["events"])
        attempt = Attempt(http, flow_run, configuration, bid, track)
        cursor = history["cursor"]
        logger.info("Following bid %s after its event %s", bid_id, cursor)
        pace, paced_at = configuration.pace(flow_run), time.monotonic()
        missed = await self._missed_preemption(flow_run, history["events"])
        if missed is not None:  # while no worker followed the run (an adoption)
            return await self._preempted(attempt, missed)
        if track.live is not None:
            await self._retry(flow_run, "start the job", lambda: self._go(attempt))
        while True:
            outcome = await self._retry(
                flow_run, "check for a cancellation", lambda: self._check_cancelled(attempt)
            )
            if outcome is not None:
                return outcome
            if pace is not None and time.monotonic() - paced_at >= PACE_SECONDS:
                paced_at = time.monotonic()
                switch = await self._retry(
                    flow_run, "pace the run", lambda: self._pace_running(attempt, pace)
                )
                if switch is not None:
                    return switch
            page = await self._retry_checked(
                flow_run,
                "follow the bid",
                lambda after=cursor: http.get(
                    f"/bids/{bid_id}/events",
                    params={"after": after, "timeout": POLL_SECONDS},
                    timeout=POLL_SECONDS + 30,
                ),
            )
            for event in page["events"]:
                cursor = event["id"]
                ended = track.apply(event)
                outcome = await self._retry(
                    flow_run,
                    f"handle the {event['kind']} event",
                    lambda e=event, ended=ended: self._on_event(attempt, e, ended),
                )
                if outcome is not None:
                    await self._publish_summary(http, flow_run, bid)
                    logger.debug("attempt over after event %s", event["kind"])
                    return outcome
            cursor = max(cursor, page["cursor"])

    async def _missed_preemption(self, flow_run, events: list[dict]) -> dict | None:
        """The ``preempted`` event of the allocation the run last ran on, when the run has not
        been rescheduled since (it is still Running or Crashed from that allocation's engine):
        a preemption that completed while no worker followed the run."""
        run = await self.client.read_flow_run(flow_run.id)
        label = (run.labels or {}).get(ALLOCATION_LABEL)
        if not label or run.state is None or not (run.state.is_running() or run.state.is_crashed()):
            return None
        for event in events:
            if (
                event["kind"] == "preempted"
                and str(event["allocation_id"]) == str(label)
                and event["payload"].get("reason") != JOB_FAILED
            ):
                return event
        return None

    async def _retry(self, flow_run, doing: str, call):
        """``await call()``, retried with backoff (1 s doubling to 30 s) while the failure is
        transient: a network error, a 5xx from the market or Prefect. Others are raised."""
        delay = 1.0
        while True:
            try:
                return await call()
            except (httpx.HTTPError, MarketError) as exc:
                if not is_transient(exc):
                    raise
                self.get_flow_run_logger(flow_run).warning(
                    "Could not %s (%s); retrying in %.0f s", doing, exc, delay
                )
                await anyio.sleep(delay)
                delay = min(30.0, delay * 2)

    async def _retry_checked(self, flow_run, doing: str, request) -> Any:
        async def call():
            return checked(await request(), doing)

        return await self._retry(flow_run, doing, call)

    async def _on_event(
        self, attempt: Attempt, event: dict, ended_current: bool
    ) -> SpotGPUWorkerResult | None:
        """The effects of one event already folded into the attempt's track (safe to repeat)."""
        http, flow_run, bid, track = attempt.http, attempt.flow_run, attempt.bid, attempt.track
        logger = self.get_flow_run_logger(flow_run)
        kind, alloc, payload = event["kind"], event["allocation_id"], event["payload"]
        if kind == "allocated" and track.live == alloc:
            await self._go(attempt)
        elif kind == "reserved":
            logger.info(
                "GPUs reserved for this run on node %s (allocation %s)", event["node_id"], alloc
            )
        elif kind == "noticed" and alloc == track.live:
            left = float(payload.get("deadline") or time.time()) - time.time()
            logger.warning(
                "Notice: allocation %s on node %s ends (%s); final save due within %.0f s",
                alloc,
                event["node_id"],
                payload.get("reason", "reclaimed"),
                left,
            )
            self._event("noticed", flow_run, bid, **plain(payload))
        if not ended_current:
            return None
        reason = str(payload.get("reason") or kind)
        if kind == "preempted" and reason != JOB_FAILED:
            return await self._preempted(attempt, event)
        # The job ended by itself: the engine has written the run's final state.
        state = (await self.client.read_flow_run(flow_run.id)).state
        if kind == "finished" and not (state and state.is_final()):
            current = checked(await http.get(f"/bids/{bid['id']}"), "read the bid")
            if current["status"] == "held":  # e.g. out of credit: wait for it, keep the bid
                message = f"Bid {bid['id']} is held ({current['hold_reason']}); the run resumes"
                message += " when the market releases it"
                logger.warning(message)
                await self._reschedule(flow_run, message, datetime.now(UTC))
                return SpotGPUWorkerResult(identifier=infrastructure_id(bid), status_code=0)
        if kind == "preempted":  # the process exited non-zero
            await cancel_bid(http, bid["id"])
        if state is not None and state.is_final():
            logger.info("Flow run ended %s on allocation %s", state.name, alloc)
            return SpotGPUWorkerResult(
                identifier=infrastructure_id(bid), status_code=0 if state.is_completed() else 1
            )
        await cancel_bid(http, bid["id"])
        logger.error(
            "The job on allocation %s ended (%s) without a final flow run state", alloc, reason
        )
        return SpotGPUWorkerResult(identifier=infrastructure_id(bid), status_code=1)

    async def _go(self, attempt: Attempt) -> None:
        """Hand the flow run to the running allocation: the launcher there waits for this.

        A run adopted while its job runs is past its launcher: its engine has it Running, or
        has just finished it. Proposing Pending then would knock a finished run back to
        Pending (Prefect refuses Pending only from Pending, Running and Cancel*): the worker
        proposes nothing and follows the job."""
        flow_run, bid, track = attempt.flow_run, attempt.bid, attempt.track
        alloc = track.live
        await self.client.update_flow_run_labels(flow_run.id, {ALLOCATION_LABEL: str(alloc)})
        node = track.nodes.get(alloc)
        state = (await self.client.read_flow_run(flow_run.id)).state
        if state is not None and (state.is_running() or state.is_final()):
            self.get_flow_run_logger(flow_run).info(
                "Following the job on node %s (allocation %s): the run is %s",
                *(node, alloc, state.name),
            )
            return
        resumed = track.preemptions > 0
        await self._set_state(
            flow_run,
            Pending(
                name="Starting",
                message=f"Allocation {alloc} on node {node}: {describe(bid)}"
                + (f" (resuming after {track.preemptions} preemption(s))" if resumed else ""),
            ),
        )
        self.get_flow_run_logger(flow_run).info(
            "%s on node %s (allocation %s)", "Resuming" if resumed else "Starting", node, alloc
        )
        self._event(
            "resumed" if resumed else "allocated", flow_run, bid, allocation_id=alloc, node_id=node
        )

    async def _preempted(self, attempt: Attempt, event: dict) -> SpotGPUWorkerResult:
        http, flow_run, bid, track = attempt.http, attempt.flow_run, attempt.bid, attempt.track
        configuration = attempt.configuration
        logger = self.get_flow_run_logger(flow_run)
        payload = event["payload"]
        reason = payload.get("reason", "preempted")
        self._event("preempted", flow_run, bid, **plain(payload))
        if track.preemptions > configuration.max_preemptions:
            await cancel_bid(http, bid["id"])
            message = (
                f"Preempted {track.preemptions} times, more than max_preemptions="
                f"{configuration.max_preemptions}; bid {bid['id']} cancelled"
            )
            logger.error(message)
            await self._set_state(flow_run, Failed(message=message), force=True)
            return SpotGPUWorkerResult(identifier=infrastructure_id(bid), status_code=0)
        message = (
            f"Preempted on node {event['node_id']} ({reason}); resumes from its checkpoint "
            f"on the next allocation of bid {bid['id']}"
        )
        logger.warning(message)
        when = resume_time(datetime.now(UTC), configuration)
        if when > datetime.now(UTC):
            message += f"; the cheap window reopens at {when.isoformat(timespec='minutes')}"
        rescheduled = await self._reschedule(
            flow_run, message, when, job_stopped=reason == SAVED_AND_STOPPED
        )
        if not rescheduled:  # the run is over: its bid must not go on (and bill) without it
            await cancel_bid(http, bid["id"])
        return SpotGPUWorkerResult(identifier=infrastructure_id(bid), status_code=0)

    async def _reschedule(
        self, flow_run, message: str, when: datetime, job_stopped: bool = False
    ) -> bool:
        """``Scheduled("Preempted")``, after the engine's own last word; False when the run
        turned out to be over (Completed or Failed by its engine), and was left so.

        A stopped engine reports Crashed itself, forcibly; that must not land after our
        Scheduled, or the run would never be picked up again. After an acknowledged final
        save the agent stops the job before the market ends the allocation, so Crashed is
        usually there already; otherwise (a notice deadline, a lost node) wait a little for it.
        """
        state = await self._engine_done(flow_run, 0 if job_stopped else ENGINE_EXIT_SECONDS)
        if state is not None and state.is_final() and not state.is_crashed():
            self.get_flow_run_logger(flow_run).info(
                "Not rescheduled: the run is %s; its bid is cancelled", state.name
            )
            return False
        engine_may_still_report = not job_stopped and state is not None and state.is_running()
        await self._insist(
            flow_run,
            lambda: Scheduled(name="Preempted", scheduled_time=when, message=message),
            force=False,
            check=engine_may_still_report,
        )
        return True

    async def _engine_done(self, flow_run, seconds: float):
        """The run's state once it has left Running (its engine's last word), or after
        ``seconds`` (an engine that was killed outright never reports)."""
        deadline = time.monotonic() + seconds
        while True:
            state = (await self.client.read_flow_run(flow_run.id)).state
            if state is None or not state.is_running() or time.monotonic() > deadline:
                return state
            await anyio.sleep(0.5)

    async def _insist(self, flow_run, new_state, force: bool, check: bool = True) -> None:
        """Set ``new_state()``; with ``check``, set it again (up to three times) while a
        stopped engine's forced Crashed lands on top of it."""
        for _ in range(3):
            await self._set_state(flow_run, new_state(), force=force)
            if not check:
                return
            await anyio.sleep(1.0)
            now = (await self.client.read_flow_run(flow_run.id)).state
            if now is None or not now.is_crashed():
                return
        self.get_flow_run_logger(flow_run).error(
            "The run stays Crashed: its engine had the last word"
        )

    async def _check_cancelled(self, attempt: Attempt) -> SpotGPUWorkerResult | None:
        http, flow_run, track = attempt.http, attempt.flow_run, attempt.track
        bid_id = attempt.bid["id"]
        state = (await self.client.read_flow_run(flow_run.id)).state
        if state is None or not (state.is_cancelling() or state.is_cancelled()):
            return None
        logger = self.get_flow_run_logger(flow_run)
        await cancel_bid(http, bid_id)
        deadline = time.monotonic() + 30  # wait (bounded) for the market to stop the job
        while track.live is not None and time.monotonic() < deadline:
            allocations = checked(await http.get(f"/bids/{bid_id}/allocations"), "list")
            if not any(a["status"] in ("running", "noticed") for a in allocations):
                break
            await anyio.sleep(0.2)
        await self._engine_done(flow_run, max(0.0, deadline - time.monotonic()))
        message = f"Cancelled: bid {bid_id} cancelled and its job stopped"
        logger.info(message)
        await self._insist(flow_run, lambda: Cancelled(message=message), force=True)
        return SpotGPUWorkerResult(identifier=infrastructure_id(attempt.bid), status_code=0)

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
        async with market_client(market_of(configuration)) as http:
            response = await http.post(f"/bids/{match[1]}/cancel")
        if response.status_code == 404:
            raise InfrastructureNotFound(f"bid {match[1]} not found on the market")
        checked(response, "cancel the bid")

    # ---------------------------------------------------------------- restarts

    async def sync_with_backend(self) -> None:
        """Prefect's heartbeat, and then a look for runs an earlier worker left behind."""
        await super().sync_with_backend()
        if self._work_pool is not None and self._runs_task_group:
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
        recent = datetime.now(UTC).timestamp() - 3 * self.heartbeat_interval_seconds
        live_workers = {
            w.name
            for w in await self.client.read_workers_for_work_pool(work_pool.name)
            if w.name != self.name
            and w.last_heartbeat_time is not None
            and w.last_heartbeat_time.timestamp() > recent
        }
        async with market_client(pool_config.market) as http:
            bids = []
            for status in ("open", "held"):  # every page (newest first, by the Link header)
                response = await http.get("/bids", params={"status": status, "limit": 1000})
                while True:
                    bids += checked(response, "list bids")
                    if "next" not in response.links:
                        break
                    response = await http.get(response.links["next"]["url"])
        for bid in bids:
            labels = bid.get("labels") or {}
            if (
                labels.get(POOL_LABEL) != work_pool.name
                or labels.get(FLOW_RUN_LABEL) in self._following
            ):
                continue
            try:
                flow_run = await self.client.read_flow_run(labels[FLOW_RUN_LABEL])
            except Exception as exc:  # deleted, or Prefect unreachable: the next pass retries
                self._logger.debug("cannot read flow run of bid %s: %s", bid["id"], exc)
                continue
            state = flow_run.state
            owner = (flow_run.labels or {}).get("prefect.worker.name")
            released = owner is not None and (flow_run.labels or {}).get(RELEASED_LABEL) == owner
            if (
                state is None
                or not (state.is_running() or state.is_pending() or state.is_crashed())
                or (owner in live_workers and not released)
            ):  # released: its owner stopped and said so (see the class docstring)
                continue  # Crashed: its engine was stopped by a preemption no one followed
            self._logger.info(
                "Adopting flow run %s (bid %s) left by worker %s", flow_run.id, bid["id"], owner
            )
            await self.client.update_flow_run_labels(  # claim it: others see a live owner
                flow_run.id, {"prefect.worker.name": self.name}
            )
            self._following.add(str(flow_run.id))
            self._runs_task_group.start_soon(self._adopt, flow_run, bid)

    async def _adopt(self, flow_run, bid: dict) -> None:
        try:
            configuration = await self.job_configuration.resolve_for_flow_run(
                flow_run, client=self.client, work_pool=self.work_pool, worker_name=self.name
            )
            async with market_client(market_of(configuration)) as http:
                result = await self._follow_bids(http, flow_run, configuration, bid)
            if result.status_code != 0:
                await self._propose_crashed_state(
                    flow_run, "The spot-gpu job ended without a final state"
                )
        except Exception:  # never take the worker down; a later pass adopts it again
            self._logger.exception("following adopted flow run %s failed", flow_run.id)
        finally:
            self._following.discard(str(flow_run.id))

    # ---------------------------------------------------------------- UI: states, events, artifacts

    async def _set_state(self, flow_run, state, force: bool = False):
        try:
            return await propose_state(self.client, state, flow_run_id=flow_run.id, force=force)
        except Abort as exc:  # the run moved on (e.g. cancelled); network errors propagate
            self.get_flow_run_logger(flow_run).debug("state %s not set: %s", state.name, exc)
            return None

    def _event(self, what: str, flow_run, bid: dict, **payload: Any) -> None:
        emit_event(
            event=f"spotgpu.bid.{what}",
            resource={
                "prefect.resource.id": f"spotgpu.bid.{bid['id']}",
                "prefect.resource.name": f"bid {bid['id']}",
                "spotgpu.gpu-model": str(bid["gpu_model"]),
            },
            related=[
                {
                    "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                    "prefect.resource.role": "flow-run",
                    "prefect.resource.name": flow_run.name,
                },
                {
                    "prefect.resource.id": f"prefect.work-pool.{self.work_pool.id}",
                    "prefect.resource.role": "work-pool",
                    "prefect.resource.name": self.work_pool.name,
                },
            ],
            payload={"bid_id": bid["id"], **payload},
        )

    async def _publish_summary(self, http: httpx.AsyncClient, flow_run, bid: dict) -> None:
        """The run's allocations as a keyed table, and a markdown cost summary (over every bid
        of the run: an on-demand bid names the spot bid it replaced)."""
        try:
            allocations, current = [], bid
            for _ in range(8):
                path = f"/bids/{current['id']}/allocations"
                allocations = checked(await http.get(path), "list") + allocations
                earlier = (current.get("labels") or {}).get(REPLACES_LABEL)
                if not earlier:
                    break
                current = checked(await http.get(f"/bids/{earlier}"), "read the replaced bid")
            table, summary = allocation_report(bid, allocations)
            key = f"spotgpu-{flow_run.id}"
            await self.client.create_artifact(
                ArtifactCreate(
                    key=f"{key}-allocations",
                    type="table",
                    data=json.dumps(table),
                    description=f"GPU allocations of bid {bid['id']}",
                    flow_run_id=flow_run.id,
                )
            )
            await self.client.create_artifact(
                ArtifactCreate(
                    key=f"{key}-cost",
                    type="markdown",
                    data=summary,
                    description="Spot cost, preemptions and work lost",
                    flow_run_id=flow_run.id,
                )
            )
        except Exception:
            self.get_flow_run_logger(flow_run).exception("could not publish the cost summary")


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
