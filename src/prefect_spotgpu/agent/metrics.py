"""The node agent's own Prometheus metrics (``spotgpu agent start --metrics-port``), in the
text exposition format on ``/metrics`` (docs/operators/agent-metrics.md).

What is measured, and who writes it (each counter in one place, from this process's start):

- **Jobs** — ``spotgpu_agent_job_starts_total``: a job the runner started (``Agent._launch``);
  ``spotgpu_agent_job_start_failures_total{reason}``: one that never ran (``StartFailure``:
  ``job``, the job's own fault; ``node``, the node's; ``gpus``, its GPUs never freed).
  ``spotgpu_agent_jobs_running`` and ``spotgpu_agent_jobs_preparing`` (an image being pulled)
  are read from the agent at each scrape.
- **Notices** — ``spotgpu_agent_notices_total``: each notice the agent acts on
  (``Agent.notice``: the market's, an adopted job's, its own when it leaves unannounced);
  ``spotgpu_agent_notice_ends_total{outcome}``: how a running job's notice ended, as reported
  (``Reporter.report_notice``; ``NoticeEnd``: its final save acknowledged, the deadline first,
  a failed save, or the job finished meanwhile).
- **Heartbeats** — ``spotgpu_agent_heartbeats_total{result}`` (``accepted``, ``refused``: any
  answer but 200, ``unanswered``: no answer) by ``heartbeat.send_heartbeat``;
  ``spotgpu_agent_heartbeat_age_seconds``: since the last accepted one (+Inf before it), at each
  scrape: the market declares a node lost after its heartbeat timeout (30 s by default).
- **Image pulls** — ``spotgpu_agent_image_pulls_total{outcome}`` and
  ``spotgpu_agent_image_pull_seconds``: each preparation of a job the runner was not ready for
  (``Agent._prepare``: the Docker runner pulling an image the node lacks).
- **The guard** — ``spotgpu_agent_guard_alive``: 1 while the process that kills the jobs of a
  dead agent runs (``guard``), at each scrape.
- **Hand-overs** — ``spotgpu_agent_handed_over_jobs_total{outcome}``: the jobs the last agent
  handed over (``adopted``, or ``gone`` by the time this one looked; ``Lifecycle._adopt``).
- ``spotgpu_agent_info{version, runner, node_id}``: 1, with this agent's release (the market
  judges it: docs/operators/version-skew.md).

Every series with a label exists from the start, at zero. The registry is this agent's own,
never the process-global one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from enum import StrEnum
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer

from prefect_spotgpu import __version__
from prefect_spotgpu.agent.runners import JobFault
from prefect_spotgpu.messages import AllocationReport
from prefect_spotgpu.protocol import ReportOutcome

logger = logging.getLogger("prefect_spotgpu.agent")

PULL_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
"""Seconds: an image already in a nearby registry's cache, up to a large base over a slow link."""


class StartFailure(StrEnum):
    """Why a job the market placed here never ran."""

    JOB = "job"
    """The job's own fault, whatever the node (``runners.JobFault``: its program missing, its
    checkpoint URL refused), or an assignment this node cannot run."""
    NODE = "node"
    """The node's: its job interpreter out of reach, its engine down, its disk full (several
    in a row drain it: ``start_failures``)."""
    GPUS = "gpus"
    """The GPUs it needs were not freed by a stopping job in time."""

    @classmethod
    def of(cls, exc: BaseException) -> StartFailure:
        """Whose fault a start that raised ``exc`` was.

        >>> StartFailure.of(JobFault("no such file: 'trian.py'")), StartFailure.of(OSError())
        (<StartFailure.JOB: 'job'>, <StartFailure.NODE: 'node'>)
        """
        return cls.JOB if isinstance(exc, JobFault) else cls.NODE


class NoticeEnd(StrEnum):
    """How a running job's notice ended (``reports.notice_report``'s outcome and cause)."""

    ACKNOWLEDGED = "acknowledged"
    """The job acknowledged its final save: the run resumes from it."""
    TIMED_OUT = "timed_out"
    """The deadline came first: the job was killed before it acknowledged."""
    STORAGE_FAILED = "storage_failed"
    """The job's checkpoint storage refused the final save (it said so)."""
    JOB_FAILED = "job_failed"
    """The job exited or crashed without acknowledging."""
    FINISHED = ReportOutcome.FINISHED.value
    """It finished its work during the notice."""

    @classmethod
    def of(cls, report: AllocationReport) -> NoticeEnd:
        """The end a notice's report says.

        >>> NoticeEnd.of(AllocationReport(epoch=1, outcome="save_failed", cause="deadline"))
        <NoticeEnd.TIMED_OUT: 'timed_out'>
        """
        if report.outcome == ReportOutcome.SAVED:
            return cls.ACKNOWLEDGED
        if report.outcome == ReportOutcome.FINISHED:
            return cls.FINISHED
        return {"deadline": cls.TIMED_OUT, "storage": cls.STORAGE_FAILED}.get(
            report.cause or "", cls.JOB_FAILED
        )


class Beat(StrEnum):
    """What became of a heartbeat."""

    ACCEPTED = "accepted"
    REFUSED = "refused"  # an answer other than 200 (the agent logs it)
    UNANSWERED = "unanswered"  # no answer: the market unreachable, or a timeout


PULLED, NOT_PULLED = "ok", "error"
ADOPTED, GONE = "adopted", "gone"


class AgentMetrics:
    """One agent's counters and histograms, and what is read from ``agent`` at each scrape
    (its jobs, its guard, its node): an :class:`~prefect_spotgpu.agent.agent.Agent`, or
    None (only the counters)."""

    def __init__(self, agent=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.agent = agent
        self.clock = clock
        self.last_accepted: float | None = None  # the last accepted heartbeat, by ``clock``
        self._guard_gone = False
        self.registry = CollectorRegistry()
        counter = self._counter  # (label name, then its values)
        self.job_starts = counter("job_starts", "Jobs the runner started.")
        self.start_failures = counter(
            "job_start_failures",
            "Jobs placed here that never ran, by reason (job: the job's own fault; node: the "
            "node's; gpus: its GPUs were not freed in time).",
            "reason",
            StartFailure,
        )
        self.notices = counter("notices", "Notices the agent acted on.")
        self.notice_ends = counter(
            "notice_ends",
            "How running jobs' notices ended, by outcome (acknowledged: the final save; "
            "timed_out: the deadline came first; storage_failed, job_failed; finished).",
            "outcome",
            NoticeEnd,
        )
        self.heartbeats = counter(
            "heartbeats",
            "Heartbeats sent, by result (accepted; refused: any other answer; unanswered).",
            "result",
            Beat,
        )
        self.pulls = counter(
            "image_pulls",
            "Preparations of a job the runner was not ready for (an image pull), by outcome.",
            "outcome",
            (PULLED, NOT_PULLED),
        )
        self.pull_seconds = Histogram(
            "spotgpu_agent_image_pull_seconds",
            "Seconds each image pull (a job's preparation) took.",
            buckets=PULL_BUCKETS,
            registry=self.registry,
        )
        self.handed_over = counter(
            "handed_over_jobs",
            "Jobs the last agent handed over (an upgrade), by outcome (adopted; gone: ended "
            "or no longer assigned here by the time this agent looked).",
            "outcome",
            (ADOPTED, GONE),
        )
        self.registry.register(_AtScrape(self))

    def _counter(self, name: str, help_text: str, label: str = "", values=()) -> Counter:
        """``spotgpu_agent_<name>_total``, by ``label`` (one series per value, at zero)."""
        labels = [label] if label else []
        made = Counter(f"spotgpu_agent_{name}", help_text, labels, registry=self.registry)
        for value in values:
            made.labels(str(value))
        return made

    # ------------------------------------------------------------ what the agent calls

    def job_started(self) -> None:
        self.job_starts.inc()

    def start_failed(self, reason: StartFailure) -> None:
        self.start_failures.labels(reason.value).inc()

    def noticed(self) -> None:
        self.notices.inc()

    def notice_ended(self, report: AllocationReport) -> None:
        self.notice_ends.labels(NoticeEnd.of(report).value).inc()

    def heartbeat(self, beat: Beat) -> None:
        self.heartbeats.labels(beat.value).inc()
        if beat is Beat.ACCEPTED:
            self.last_accepted = self.clock()

    @contextlib.contextmanager
    def image_pull(self) -> Iterator[None]:
        """Around a job's preparation: counted by how it ended, and timed."""
        started = self.clock()
        outcome = NOT_PULLED
        try:
            yield
            outcome = PULLED
        finally:
            self.pulls.labels(outcome).inc()
            self.pull_seconds.observe(self.clock() - started)

    def handover_job(self, adopted: bool) -> None:
        self.handed_over.labels(ADOPTED if adopted else GONE).inc()

    # ------------------------------------------------------------ read at each scrape

    def heartbeat_age(self) -> float:
        """Seconds since the last accepted heartbeat; +Inf before the first."""
        return math.inf if self.last_accepted is None else self.clock() - self.last_accepted

    def guard_alive(self) -> bool:
        """Whether the agent's guard still runs (no guard: False). Its exit status is read
        (it is this process's child) once; its pid is never waited on again after, when it
        could be another child's."""
        guard = getattr(self.agent, "guard", None)
        if guard is None or self._guard_gone:
            return False
        try:
            pid, _ = os.waitpid(guard.pid, os.WNOHANG)
        except ChildProcessError:
            pid = guard.pid
        self._guard_gone = pid == guard.pid
        return not self._guard_gone

    def exposition(self) -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry)

    def serve(self, address: str, port: int) -> tuple[str, int] | None:
        """Serve ``/metrics`` on ``address:port`` (port 0: any free one) from a thread of its
        own (start it after the guard's fork); where it listens. One that cannot (the port
        taken) logs why and serves nothing: the agent runs on without its metrics, since
        exiting would have its guard kill the jobs a hand-over just gave it."""
        try:
            app = make_wsgi_app(self.registry)
            server = make_server(address, port, app, ThreadingWSGIServer, _ScrapeHandler)
        except OSError as exc:
            logger.error("the metrics cannot be served on %s:%s (%s)", address, port, exc)
            return None
        name = "spotgpu-agent-metrics"
        threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
        host, bound = server.server_address[:2]
        logger.info("metrics at http://%s:%s/metrics", host, bound)
        return host, bound


SCRAPE_SOCKET_SECONDS = 5.0
"""How long a scrape's connection may stay silent before it is dropped: a client that opens
connections and sends nothing (a job on another host, where the port is on a network address)
does not hold the agent's threads."""


class _ScrapeHandler(WSGIRequestHandler):
    timeout = SCRAPE_SOCKET_SECONDS

    def log_message(self, format: str, *args) -> None:
        pass  # (a scrape every few seconds is not worth a log line)


class _AtScrape:
    """A collector of what is read, not counted: the agent's jobs, heartbeat age, guard, info."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # (read at scrape time: nothing to check at registration)

    def collect(self) -> Iterator[Metric]:
        metrics, agent = self.metrics, self.metrics.agent
        jobs = len(getattr(agent, "jobs", ()))
        preparing = len(getattr(agent, "preparing", ()))
        yield _gauge("jobs_running", "Jobs running on this node now.", jobs)
        yield _gauge("jobs_preparing", "Jobs being prepared (an image pull) now.", preparing)
        yield _gauge(
            "heartbeat_age_seconds",
            "Seconds since the market last accepted a heartbeat (+Inf: none yet).",
            metrics.heartbeat_age(),
        )
        yield _gauge(
            "guard_alive",
            "1 while the guard that kills a dead agent's jobs runs.",
            float(metrics.guard_alive()),
        )
        info = GaugeMetricFamily(
            "spotgpu_agent_info",
            "This agent: its prefect-spotgpu version, runner and node.",
            labels=["version", "runner", "node_id"],
        )
        runner = getattr(getattr(agent, "runner", None), "name", "")
        node_id = getattr(agent, "node_id", None)
        info.add_metric([__version__, runner, "" if node_id is None else str(node_id)], 1)
        yield info


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"spotgpu_agent_{name}", help_text, value=value)
