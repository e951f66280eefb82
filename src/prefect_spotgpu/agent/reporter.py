"""Sending what the agent reports of its jobs to the market (``POST /allocations/{id}/report``).

``reports`` decides what a report says (pure); this sends it. A report that ends an
allocation (``saved``, ``save_failed``, ``finished``, ``failed``) is retried until the market
answers it: a lost ``saved`` or ``finished`` would leave the run waiting for the notice's
deadline. A ``checkpoint`` report is sent once per durable save the job's saved file records
(a failed send is tried again at the next look); the last one sent is remembered per job.
An image pull's progress (``pulling``) is sent in order by one thread per allocation, retried
as the ending reports are; a line that a newer one replaces before it was sent is dropped
(progress, not a change), and so is one the market refuses (a stale epoch, an ended
allocation).
"""

from __future__ import annotations

import logging
import threading
import time
from weakref import WeakKeyDictionary

import httpx

from prefect_spotgpu.agent.isolation import read_job_file
from prefect_spotgpu.agent.metrics import AgentMetrics
from prefect_spotgpu.agent.reports import checkpoint_report, one_line, save_marker
from prefect_spotgpu.agent.runners import JobHandle
from prefect_spotgpu.messages import AllocationReport
from prefect_spotgpu.protocol import ReportOutcome

logger = logging.getLogger("prefect_spotgpu.agent")


class Reporter:
    """The agent's reports, over its node's ``client``; retries end when ``stopped`` is set.
    How each notice ended is counted in ``metrics`` (``AgentMetrics.notice_ended``)."""

    def __init__(
        self, client: httpx.Client, stopped: threading.Event, metrics: AgentMetrics | None = None
    ) -> None:
        self.client = client
        self.stopped = stopped
        self.metrics = metrics or AgentMetrics()
        self._lock = threading.Lock()
        # job -> the save last reported (the agent's loop and a notice thread may both look)
        self._reported: WeakKeyDictionary[JobHandle, tuple[float, int | None] | None] = (
            WeakKeyDictionary()
        )
        # allocation -> its progress report waiting to be sent (None: none waits); present
        # while its sender thread runs
        self._progress: dict[int, AllocationReport | None] = {}
        self._progress_sent = threading.Condition()

    def report(self, alloc_id: int, body: AllocationReport) -> httpx.Response | None:
        """POST a report until the market answers it. Transport errors, 5xx and 429 are
        retried with backoff (0.5 s doubling to 5 s); any other answer is final. None when the
        agent stops first."""
        delay = 0.5
        while True:
            try:
                response = self.client.post(f"/allocations/{alloc_id}/report", json=body.body())
            except httpx.HTTPError as exc:
                problem = type(exc).__name__
            else:
                if response.status_code < 500 and response.status_code != 429:
                    if response.status_code >= 400:
                        logger.warning(
                            "allocation %s: report %s refused: %s %s",
                            alloc_id,
                            body.outcome,
                            response.status_code,
                            response.text[:200],
                        )
                    return response
                problem = str(response.status_code)
            logger.warning(
                "allocation %s: report %s not delivered (%s); again in %.1f s",
                alloc_id,
                body.outcome,
                problem,
                delay,
            )
            if self.stopped.wait(delay):
                return None
            delay = min(delay * 2, 5.0)

    def report_later(self, alloc_id: int, body: AllocationReport) -> None:
        """``report`` in a thread of its own: the agent's loop (and its lock) never wait on
        the market."""
        threading.Thread(
            target=self.report,
            args=(alloc_id, body),
            name=f"spotgpu-report-{alloc_id}",
            daemon=True,
        ).start()

    def report_failed(self, alloc_id: int, epoch: int, detail: str | None = None) -> None:
        """Report (in the background) that the allocation's job failed, saying why in
        ``detail`` (made one line of plain text, as the market takes it)."""
        detail = one_line(detail) if detail else None
        self.report_later(
            alloc_id, AllocationReport(epoch=epoch, outcome=ReportOutcome.FAILED, detail=detail)
        )

    def report_notice(self, alloc_id: int, body: AllocationReport, ack: dict | None) -> None:
        """``report`` a notice's outcome (``reports.notice_report``: ``body``; ``ack``: the
        job's acknowledgement, if any), and log what it was (and count it, as decided)."""
        self.metrics.notice_ended(body)
        response = self.report(alloc_id, body)
        if response is None:
            return
        if body.outcome == ReportOutcome.SAVED:
            logger.info(
                "allocation %s: final save at step %s acknowledged (%s)",
                alloc_id,
                body.step,
                response.status_code,
            )
        elif body.outcome == ReportOutcome.FINISHED:
            logger.info(
                "allocation %s: finished during its notice (%s)", alloc_id, response.status_code
            )
        else:  # the market decides whether that is compensated, by its cause
            logger.warning(
                "allocation %s: no final save (cause: %s%s); reported (%s)",
                alloc_id,
                body.cause,
                f", {str(ack.get('error'))[:200]!r}" if ack and ack.get("error") else "",
                response.status_code,
            )

    def report_progress(self, alloc_id: int, body: AllocationReport) -> None:
        """Send a progress report in the background, after the ones before it: it replaces
        one still waiting (only the newest line is worth sending)."""
        with self._progress_sent:
            sending = alloc_id in self._progress
            self._progress[alloc_id] = body
        if not sending:
            threading.Thread(
                target=self._send_progress,
                args=(alloc_id,),
                name=f"spotgpu-progress-{alloc_id}",
                daemon=True,
            ).start()

    def _send_progress(self, alloc_id: int) -> None:
        while True:
            with self._progress_sent:
                body = self._progress[alloc_id]
                if body is None:
                    del self._progress[alloc_id]
                    self._progress_sent.notify_all()
                    return
                self._progress[alloc_id] = None
            self.report(alloc_id, body)

    def progress_sent(self, alloc_id: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the allocation's progress reports are
        answered; False if they are not by then."""
        with self._progress_sent:
            return self._progress_sent.wait_for(lambda: alloc_id not in self._progress, timeout)

    def report_save(self, handle: JobHandle, *, epoch: int) -> None:
        """Report the job's latest durable save if it is new (the final one is the notice's)."""
        alloc_id = handle.request.allocation_id
        saved = read_job_file(handle.request.saved_file)
        with self._lock:  # one look reports it
            last = self._reported.get(handle)
            body = checkpoint_report(epoch=epoch, saved=saved, last=last, now=time.time())
            if body is None:
                return
            self._reported[handle] = save_marker(saved)
        try:
            response = self.client.post(f"/allocations/{alloc_id}/report", json=body.body())
        except httpx.HTTPError as exc:
            with self._lock:
                self._reported[handle] = last  # the next look tries again
            logger.warning("allocation %s: checkpoint report failed (%s)", alloc_id, exc)
            return
        logger.log(
            logging.INFO if response.status_code == 200 else logging.WARNING,
            "allocation %s: checkpoint at step %s reported (%s)",
            alloc_id,
            body.step,
            response.status_code,
        )
