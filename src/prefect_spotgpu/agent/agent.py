"""The node agent: registers its host, heartbeats, and runs what the market assigns to it.

It talks to the market over HTTP only: a heartbeat every few seconds (GPU telemetry, the images it
holds: ``heartbeat``) and a long-poll on its node's events. On ``allocated`` (or ``reserved``, for
a migration target the market warms up: its job waits for its go in the launcher) it starts the job
on free GPUs — after the runner prepares it (an image pull) on a thread of its own that reports
progress, never for an allocation noticed or ended meanwhile. On ``noticed`` it writes the notice
file, sends SIGUSR1 to the job's main process, waits for the checkpoint library's acknowledgement
(or the deadline), stops the job and reports the outcome with the allocation's epoch (the fencing
token; ``reports``, ``reporter``); on an ending event it stops whatever still runs. A job that
exits by itself is reported ``finished`` (exit 0) or ``failed`` with its exit code and last line
(``reports.exit_detail``); one that cannot start is reported failed, and a node whose jobs cannot
start several times in a row drains itself (``start_failures``). Every durable save in a job's
saved file is reported as a ``checkpoint`` within about a second. On start it reconciles: local
jobs the market no longer assigns here are killed (``Runner.reconcile``). Asked to stop (SIGTERM,
Ctrl-C), it leaves as a reclaim of its node: every job saves and stops, and its run resumes
elsewhere (``leaving``); the CLI's guard kills the jobs of an agent that dies (``guard``).

Its credential is the node's token (``credentials``); the runner isolates the jobs (``runners``,
``isolation``). What it does for each event, assignment and exit is decided by pure functions
(``reactions``); this class executes: never a market or runner call under its lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import httpx

from prefect_spotgpu.agent.ack_wait import AckWait
from prefect_spotgpu.agent.credentials import (
    CredentialError,
    load_cursor,
    register_node,
    save_cursor,
)
from prefect_spotgpu.agent.discovery import GpuInfo
from prefect_spotgpu.agent.gpu_book import GpuBook, Verdict
from prefect_spotgpu.agent.heartbeat import NodeImages, node_telemetry, runner_terms, send_heartbeat
from prefect_spotgpu.agent.isolation import read_job_file
from prefect_spotgpu.agent.leaving import Leaving
from prefect_spotgpu.agent.lifecycle import Lifecycle
from prefect_spotgpu.agent.metrics import AgentMetrics, StartFailure
from prefect_spotgpu.agent.reactions import (
    Already,
    Decline,
    Ended,
    Fail,
    Go,
    LocalView,
    NoJob,
    NoticeJob,
    NotYet,
    Refused,
    StartJob,
    StopJob,
    exit_report,
    job_request,
    react,
    start_decision,
)
from prefect_spotgpu.agent.reporter import Reporter
from prefect_spotgpu.agent.reports import notice_before_start_report, notice_report, one_line
from prefect_spotgpu.agent.runners import JobHandle, JobRequest, Runner
from prefect_spotgpu.agent.runners.runner import last_line
from prefect_spotgpu.agent.start_failures import StartFailures, drain_node, report_not_started
from prefect_spotgpu.api_client import api_client
from prefect_spotgpu.messages import (
    AllocationReport,
    Assignment,
    EventResponse,
    EventsPage,
    NodeRegistration,
)
from prefect_spotgpu.protocol import (
    PULL_REPORT_SECONDS,
    Capacity,
    ReportOutcome,
)

logger = logging.getLogger("prefect_spotgpu.agent")


class AgentError(RuntimeError):
    pass


class Agent(Lifecycle):
    def __init__(
        self,
        *,
        market: str,
        token: str | None,
        runner: Runner,
        gpus: list[GpuInfo],
        declared: bool,
        state_dir: Path,
        name: str,
        region: str | None = None,
        reserve_price: float | None = None,
        capacity: str = Capacity.SPOT,
        heartbeat_seconds: float = 5.0,
        grace_seconds: float = 5.0,
        telemetry=None,
        address: str | None = None,
    ) -> None:
        self.address = address  # where other nodes reach this one (a gang's MASTER_ADDR)
        self.market = market.rstrip("/")
        self.token = token  # a node token, or the owner's key until registration is done
        self.runner = runner
        self.gpus = gpus
        self.cpus = len(os.sched_getaffinity(0))  # (the cores this agent may use)
        self.declared = declared
        self.state_dir = Path(state_dir)
        self.name = name
        self.region = region
        self.reserve_price = reserve_price
        self.capacity = capacity
        self.heartbeat_seconds = heartbeat_seconds
        self.grace_seconds = grace_seconds
        self.telemetry = telemetry
        self.node_id: int | None = None
        self.jobs: dict[int, JobHandle] = {}
        # allocation -> its job being prepared (image pulled), GPUs taken; an end or notice drops it
        self.preparing: dict[int, JobRequest] = {}
        self.epochs: dict[int, int] = {}
        # which GPUs each allocation holds, and who waits for some (``gpu_book``; under lock)
        self.gpu_book = GpuBook(len(gpus), patience=grace_seconds + 30)
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.cursor = 0
        self.client: httpx.Client | None = None
        self.reporter: Reporter | None = None
        self.images = NodeImages(runner.local_images)
        self.start_failures = StartFailures()  # the node's jobs in a row that did not start
        self.leaving = Leaving(grace_seconds)  # asked to stop: by when the jobs must be gone
        self.declined: dict[int, int] = {}  # allocation -> epoch, not started while leaving
        self.notice_threads: list[threading.Thread] = []
        self.metrics = AgentMetrics(self)  # what it counts (``--metrics-port`` serves them)

    # ---------------------------------------------------------------- registration

    def _http(self, token: str) -> httpx.Client:
        return api_client(self.market, token, timeout=60)

    def register(self) -> None:
        """Find this node's token (given, or kept in ``node.json``), or obtain one with the
        owner's key; check it against the market and this host's GPUs
        (``credentials.register_node``)."""
        try:
            token, node = register_node(
                market=self.market,
                key=self.token,
                state_dir=self.state_dir,
                registration=NodeRegistration(
                    name=self.name,
                    gpu_model=self.gpus[0].model,
                    region=self.region,
                    gpu_count=len(self.gpus),
                    reserve_price=self.reserve_price,
                    capacity=self.capacity,
                    declared=self.declared,
                    inventory=[g.to_json() for g in self.gpus],
                    address=self.address,
                    **runner_terms(self.runner).model_dump(),
                ),
                http=self._http,
            )
        except CredentialError as exc:
            raise AgentError(str(exc)) from None
        self.token = None  # the owner's key is not kept past registration
        self.client = self._http(token)
        self.reporter = Reporter(self.client, self.stop_event, self.metrics)
        self.node_id = node.id
        self.cursor = load_cursor(self.state_dir, self.market, self.node_id)
        logger.info(
            "agent for node %s (%s x %s) on %s",
            self.node_id,
            len(self.gpus),
            self.gpus[0].model,
            self.market,
        )

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        if not self.register_when_reachable():
            return
        self.heartbeat()
        self._back()
        self.reconcile()
        beat = threading.Thread(target=self._heartbeats, name="spotgpu-heartbeat", daemon=True)
        beat.start()
        try:
            while not self.stop_event.is_set():
                if self.leaving.asked and self._leave_turn():
                    break
                self._check_exits()
                self._report_saves()
                with self.lock:
                    waiting = self.gpu_book.waiting()
                for alloc_id in waiting:  # GPUs being freed by a stop
                    try:
                        self.start(alloc_id)
                    except Exception:
                        logger.exception("starting allocation %s failed", alloc_id)
                try:
                    page = self.client.get(
                        f"/nodes/{self.node_id}/events",
                        params={"after": self.cursor, "timeout": 1.0},
                    )
                except httpx.HTTPError as exc:
                    logger.warning("market unreachable (%s); retrying", exc)
                    self.stop_event.wait(1.0)
                    continue
                if page.status_code != 200:
                    logger.warning("events: %s %s", page.status_code, page.text[:200])
                    self.stop_event.wait(1.0)
                    continue
                body = EventsPage.model_validate(page.json())
                for event in body.events:
                    try:
                        self.handle(event)
                    except Exception:  # one bad event must not stop the node
                        logger.exception("handling event %s failed", event.id)
                if body.cursor != self.cursor:
                    self.cursor = body.cursor
                    try:
                        save_cursor(self.state_dir, self.market, self.node_id, self.cursor)
                    except OSError as exc:  # e.g. a full disk: keep serving, retry next page
                        logger.error("could not save the event cursor: %s", exc)
        finally:
            self.stop_event.set()

    def heartbeat(self) -> None:
        answer = send_heartbeat(
            self.client,
            self.node_id,
            telemetry=node_telemetry(len(self.jobs), self.declared, self.telemetry),
            images=self.images,
            address=self.address,
            runner=runner_terms(self.runner),
            metrics=self.metrics,
        )
        if answer.status_code == httpx.codes.UPGRADE_REQUIRED and not self.leaving.asked:
            logger.error("this agent is too old for the market: it leaves")
            self.shutdown()  # it cannot serve: its jobs save and stop (``versions.WINDING_DOWN``)

    def _heartbeats(self) -> None:
        while not self.stop_event.wait(self.heartbeat_seconds):
            try:
                self.heartbeat()
            except httpx.HTTPError as exc:
                logger.warning("heartbeat failed: %s", exc)

    # ---------------------------------------------------------------- events

    def handle(self, event: EventResponse) -> None:
        """Do what the event asks (``reactions.react``)."""
        if event.payload.epoch is not None:
            with self.lock:
                self.epochs[event.allocation_id] = event.payload.epoch
        match react(event):
            case StartJob(alloc_id):
                self.start(alloc_id)
            case NoticeJob(alloc_id, deadline, epoch):
                self.notice(alloc_id, deadline, epoch)
            case StopJob(alloc_id, reason, grace):
                self.stop(alloc_id, reason=reason, grace=grace)
            case Refused(_, why):  # fails this event alone (logged), its epoch kept
                raise ValueError(why)

    def assignments(self) -> dict[int, Assignment]:
        response = self.client.get(f"/nodes/{self.node_id}/allocations")
        response.raise_for_status()
        return {a.id: a for a in map(Assignment.model_validate, response.json())}

    def _view(self) -> LocalView:
        """The agent's view of its own jobs, for ``reactions`` (under the lock)."""
        return LocalView(frozenset(self.jobs), frozenset(self.preparing), self.leaving.asked)

    def start(self, alloc_id: int, assignment: Assignment | None = None) -> None:
        """Start the allocation's job (``reactions.start_decision``) on the GPUs it takes,
        prepared on a thread of its own when the runner is not ready for it (an image pull).
        The market and the runner are asked outside the lock: meanwhile the job counts as
        being prepared, so a notice or an end drops it."""
        if assignment is None:
            with self.lock:
                if alloc_id in self.jobs or alloc_id in self.preparing:
                    return
            assignment = self.assignments().get(alloc_id)
        with self.lock:
            decision = start_decision(alloc_id, assignment, self._view())
            match decision:
                case Already() | NotYet():
                    return
                case Ended():
                    self.gpu_book.stop_waiting(alloc_id)
                    return
                case Decline(epoch, answer):  # its notice is answered: now, or when it comes
                    self.gpu_book.stop_waiting(alloc_id)
                    if answer is None:
                        self.declined[alloc_id] = epoch
                    elif not (self.state_dir / f"alloc-{alloc_id}").exists():  # never ran here
                        self.reporter.report_later(alloc_id, answer)
                    return
                case NoJob():
                    logger.warning("allocation %s has no job to run", alloc_id)
                    return
                case Fail(epoch, detail):
                    logger.error("allocation %s: %s", alloc_id, detail)
                    self.metrics.start_failed(StartFailure.JOB)
                    self.reporter.report_failed(alloc_id, epoch, detail)
                    return
            request = self._take_gpus(alloc_id, decision)
            if request is None:
                return
            self.epochs[alloc_id] = request.epoch
            self.preparing[alloc_id] = request
        try:
            ready = self.runner.ready(request)
        except Exception as exc:  # e.g. the engine is down
            self._not_started(request, exc)
            return
        if ready:
            self._launch(request)
            return
        threading.Thread(
            target=self._prepare, args=(request,), name=f"spotgpu-prepare-{alloc_id}", daemon=True
        ).start()

    def _take_gpus(self, alloc_id: int, go: Go) -> JobRequest | None:
        """The job's request on the GPUs it takes (under the lock); None when it waits for
        GPUs a stopping job still holds (retried each loop) or gives up on them."""
        assignment = go.assignment
        count = assignment.gpu_count
        taken = self.gpu_book.take(alloc_id, count, now=time.monotonic())
        if taken.verdict == Verdict.WAIT:
            logger.info("allocation %s waits for %s GPUs to be freed", alloc_id, count)
            return None
        if taken.verdict == Verdict.GIVE_UP:
            logger.error("allocation %s needs %s GPUs, %s free", alloc_id, count, taken.free)
            self.metrics.start_failed(StartFailure.GPUS)
            self.reporter.report_failed(alloc_id, assignment.epoch)
            return None
        return job_request(go, taken.indices, self.state_dir, node=(len(self.gpus), self.cpus))

    def _prepare(self, request: JobRequest) -> None:
        """Prepare the job (pull its image, reporting how far), then start it, unless its
        allocation was noticed or ended meanwhile (``stop``/``notice`` took it out of
        ``preparing``: its GPUs are free again)."""
        alloc_id = request.allocation_id
        try:
            with self.metrics.image_pull():
                self.runner.prepare(request, lambda line: self._report_progress(request, line))
        except Exception as exc:
            self._not_started(request, exc)
            return
        finally:
            self.images.pulled()
        # the last progress line before the job's own output (bounded: a market that is down
        # does not hold the job back)
        self.reporter.progress_sent(alloc_id, timeout=PULL_REPORT_SECONDS)
        self._launch(request)

    def _report_progress(self, request: JobRequest, line: str) -> None:
        """One line of a preparation's progress: to the agent's log and, as a ``pulling``
        report, to the bid's events (and from there its flow run's log)."""
        alloc_id = request.allocation_id
        with self.lock:
            if self.preparing.get(alloc_id) is not request:
                return  # ended meanwhile: nobody waits for it
        logger.info("allocation %s: %s", alloc_id, line)
        body = AllocationReport(
            epoch=request.epoch, outcome=ReportOutcome.PULLING, detail=one_line(line)
        )
        self.reporter.report_progress(alloc_id, body)

    def _launch(self, request: JobRequest) -> None:
        """Start a prepared job, its GPUs taken, unless its allocation was noticed or ended
        meanwhile (``stop``/``notice`` took it out of ``preparing``: its GPUs are free again)
        or the agent stops. The runner starts it outside the lock; one noticed or ended while
        it started is stopped at once."""
        alloc_id = request.allocation_id
        with self.lock:
            if self.preparing.get(alloc_id) is not request:
                logger.info("allocation %s: ended while it was prepared; not started", alloc_id)
                return
            if self.stop_event.is_set() or self.leaving.asked:  # the agent stops: never started
                del self.preparing[alloc_id]
                self.gpu_book.give_back(alloc_id)
                self.declined[alloc_id] = request.epoch
                return
        try:
            handle = self.runner.start(request)
        except Exception as exc:  # e.g. the command does not exist: give the GPUs back
            self._not_started(request, exc)
            return
        with self.lock:
            kept = self.preparing.get(alloc_id) is request
            if kept:
                del self.preparing[alloc_id]
                self.jobs[alloc_id] = handle
                self.start_failures.started()
                self.metrics.job_started()
        if not kept:  # noticed or ended while it started: it never runs here
            logger.info("allocation %s: ended while it started; stopped", alloc_id)
            self.runner.stop(handle, grace=0)
            return
        logger.info(
            "allocation %s: started %s %s on GPUs %s",
            alloc_id,
            self.runner.name,
            handle.ref,
            request.gpu_indices,
        )

    def _not_started(self, request: JobRequest, exc: Exception) -> None:
        """A job that could not start (outside the lock): its GPUs back, its allocation
        reported failed, saying why; the node drained first when it is the node's fault, too
        many times in a row (``start_failures``). Nothing, when its allocation was noticed or
        ended meanwhile (no longer being prepared: the notice or the end answered for it)."""
        alloc_id = request.allocation_id
        with self.lock:
            if self.preparing.get(alloc_id) is not request:
                return
            del self.preparing[alloc_id]
            self.gpu_book.give_back(alloc_id)
        logger.error("allocation %s: the job could not start: %s", alloc_id, exc)
        self.metrics.start_failed(StartFailure.of(exc))
        detail = f"the job could not start: {exc}"
        report_not_started(
            self.start_failures,
            exc,
            drain=lambda why: drain_node(self.client, self.node_id, why),
            report=lambda: self.reporter.report_failed(alloc_id, request.epoch, detail),
        )

    def notice(self, alloc_id: int, deadline: float, epoch: int | None) -> None:
        deadline = self.leaving.deadline(deadline)
        self.metrics.noticed()
        with self.lock:
            handle = self.jobs.get(alloc_id)
            unstarted = self.preparing.pop(alloc_id, None)
            if unstarted is not None:
                self.gpu_book.give_back(alloc_id)
            declined = self.declined.pop(alloc_id, None)
        if unstarted is not None or declined is not None:  # it never starts here
            logger.warning("allocation %s: noticed before its job started; not started", alloc_id)
            body = notice_before_start_report(epoch=epoch or declined or unstarted.epoch)
            self.reporter.report_later(alloc_id, body)
            return
        if handle is None or handle.signalled_at is not None:  # (noticed already)
            return
        try:
            self.runner.notice(handle, deadline)
            logger.info(
                "allocation %s: notice sent (deadline in %.0f s)", alloc_id, deadline - time.time()
            )
        except Exception:  # (what the job did to its directory): still wait, stop, report
            logger.exception("allocation %s: the notice could not be delivered", alloc_id)
        waiting = threading.Thread(
            target=self._await_final_save,
            args=(alloc_id, handle, deadline),
            name=f"spotgpu-notice-{alloc_id}",
            daemon=True,
        )
        with self.lock:
            self.notice_threads = [t for t in self.notice_threads if t.is_alive()] + [waiting]
        waiting.start()

    def _await_final_save(self, alloc_id: int, handle: JobHandle, deadline: float) -> None:
        """Wait for the acknowledgement, the job's exit or the deadline (``ack_wait``: woken,
        not polling), stop the job, then report (``reports.notice_report``). Stopped *before*
        the report, which ends the allocation (the bid's next may start at once), and with
        SIGKILL only: the engine writes Crashed on SIGTERM, and a preemption must never read
        as a crash. The notice was the job's warning; what it saved is durable."""
        ack_file = handle.request.ack_file
        with AckWait(ack_file, getattr(handle, "pid", None)) as waiting:
            waiting.until(
                deadline, lambda: ack_file.exists() or self.runner.poll(handle) is not None
            )
        ack = read_job_file(ack_file)
        exit_code = self.runner.poll(handle)
        self._report_save(alloc_id, handle)  # a periodic save not reported yet
        self.stop(alloc_id, reason="notice", grace=0)
        body = notice_report(
            epoch=self.epochs.get(alloc_id, handle.request.epoch),
            ack=ack,
            exit_code=exit_code,
            now=time.time(),
        )
        self.reporter.report_notice(alloc_id, body, ack)  # retried until the market has it

    def _report_saves(self) -> None:
        with self.lock:
            running = list(self.jobs.items())
        for alloc_id, handle in running:
            try:
                self._report_save(alloc_id, handle)
            except Exception:  # one job's garbage must not stop the node
                logger.exception("allocation %s: reading its saved file failed", alloc_id)

    def _report_save(self, alloc_id: int, handle: JobHandle) -> None:
        self.reporter.report_save(handle, epoch=self.epochs.get(alloc_id, handle.request.epoch))

    def stop(self, alloc_id: int, reason: str, grace: float | None = None) -> None:
        """Stop the allocation's job (``runner.stop``; ``grace`` None: the agent's own)."""
        with self.lock:
            handle = self.jobs.pop(alloc_id, None)
            unstarted = self.preparing.pop(alloc_id, None)
            if unstarted is not None:
                self.gpu_book.give_back(alloc_id)
                logger.info("allocation %s: ended (%s) before its job started", alloc_id, reason)
        if handle is None:
            return
        self.runner.stop(handle, grace=self.grace_seconds if grace is None else grace)
        with self.lock:
            self.gpu_book.give_back(alloc_id)
        logger.info("allocation %s: stopped (%s)", alloc_id, reason)

    def _check_exits(self) -> None:
        with self.lock:  # jobs under notice are the notice thread's to report
            exited = [
                (a, h, self.runner.poll(h))
                for a, h in self.jobs.items()
                if h.signalled_at is None and self.runner.poll(h) is not None
            ]
        for alloc_id, handle, code in exited:
            self._report_save(alloc_id, handle)
            with self.lock:
                if self.jobs.get(alloc_id) is not handle:
                    continue
                del self.jobs[alloc_id]
            last = None if code == 0 else last_line(self.runner, handle)
            self.runner.stop(handle, grace=0)  # what it left running: its processes, container
            with self.lock:
                self.gpu_book.give_back(alloc_id)
                epoch = self.epochs.get(alloc_id, handle.request.epoch)
            body = exit_report(epoch, code, last)
            detail = f" ({body.detail})" if body.detail else ""
            logger.info(
                "allocation %s: job exited %s -> %s%s", alloc_id, code, body.outcome, detail
            )
            self.reporter.report_later(alloc_id, body)
