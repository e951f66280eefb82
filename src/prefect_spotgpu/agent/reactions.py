"""The node agent's decisions, pure: an event, an assignment or a job's exit, and the agent's
local view, in; a typed action out. The agent (``agent.py``) is the executor: it reads its view
under its lock, asks a function here, and does what the answer names — the HTTP calls and the
runner's calls outside the lock. Nothing here reads a clock, a file or the network.

What the agent does, by what it hears (``react``)::

    allocated                       StartJob: start the job (``start_decision`` says how)
    reserved, placement migration   StartJob: a migration target starts warm, if given its job
    reserved, another placement     Ignore: it starts when promoted (an ``allocated``)
    noticed (with a deadline)       NoticeJob: the job's notice, then its final save
    noticed without a deadline      Refused: this event fails alone (logged); its epoch kept
    preempted                       StopJob, grace 0: SIGKILL only, as at a notice's end
    finished, released              StopJob, the agent's grace
    pulling                         Ignore: progress, no change of the allocation

Before it starts a job (``start_decision``)::

    running or being prepared here          Already
    noticed before its job started          Decline, noticed: never started; answered now
    not assigned here, or not startable     Ended: its GPUs are no longer awaited
    the agent is leaving (asked to stop)    Decline: never started; its notice is answered
    reserved and no job given               NotYet: it starts when promoted
    no job                                  NoJob: logged
    a gang whose rendezvous is malformed    Fail: reported failed, saying why
    otherwise                               Go: with its gang's place (None: one node)

A job that exits by itself (``exit_report``) is reported finished (exit 0) or failed, with its
exit code and last line, at the epoch it was started with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect_spotgpu.agent.reports import exit_detail, notice_before_start_report
from prefect_spotgpu.agent.runners.runner import GangPlace, JobRequest
from prefect_spotgpu.messages import AllocationReport, Assignment, EventResponse
from prefect_spotgpu.protocol import (
    ENDING_EVENTS,
    STARTABLE,
    AllocationStatus,
    EventKind,
    EventPlacement,
    ReportOutcome,
)

# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class StartJob:
    alloc_id: int


@dataclass(frozen=True, slots=True)
class NoticeJob:
    alloc_id: int
    deadline: float
    epoch: int | None


@dataclass(frozen=True, slots=True)
class StopJob:
    alloc_id: int
    reason: str
    grace: float | None  # None: the agent's own grace


@dataclass(frozen=True, slots=True)
class Ignore:
    alloc_id: int


@dataclass(frozen=True, slots=True)
class Refused:
    """An event the agent cannot act on: it fails alone, saying ``why``."""

    alloc_id: int
    why: str


EventAction = StartJob | NoticeJob | StopJob | Ignore | Refused


def react(event: EventResponse) -> EventAction:
    """What one event of the node's feed asks of the agent (the module's table)."""
    kind, alloc_id, payload = event.kind, event.allocation_id, event.payload
    if kind == EventKind.ALLOCATED or (
        kind == EventKind.RESERVED and payload.placement == EventPlacement.MIGRATION
    ):
        return StartJob(alloc_id)
    if kind == EventKind.NOTICED:
        if payload.deadline is None:
            return Refused(alloc_id, f"notice {event.id} of allocation {alloc_id} has no deadline")
        return NoticeJob(alloc_id, payload.deadline, payload.epoch)
    if kind in ENDING_EVENTS:
        return StopJob(alloc_id, kind, 0 if kind == EventKind.PREEMPTED else None)
    return Ignore(alloc_id)


# ---------------------------------------------------------------- starting a job


@dataclass(frozen=True, slots=True)
class LocalView:
    """What the agent knows of its own jobs when it decides (read under its lock)."""

    jobs: frozenset[int]  # allocations whose job runs here
    preparing: frozenset[int]  # allocations whose job is being prepared (an image pulled)
    leaving: bool  # the agent was asked to stop: it starts nothing more


@dataclass(frozen=True, slots=True)
class Already:
    pass


@dataclass(frozen=True, slots=True)
class Ended:
    pass


@dataclass(frozen=True, slots=True)
class Decline:
    epoch: int
    # noticed already: its notice's answer, sent now, unless a job of it ran on this host (its
    # directory is there: the notice's own wait, or reconcile after a restart, answers it then)
    answer: AllocationReport | None = None


@dataclass(frozen=True, slots=True)
class NotYet:
    pass


@dataclass(frozen=True, slots=True)
class NoJob:
    pass


@dataclass(frozen=True, slots=True)
class Fail:
    epoch: int
    detail: str


@dataclass(frozen=True, slots=True)
class Go:
    assignment: Assignment
    gang: GangPlace | None


StartDecision = Already | Ended | Decline | NotYet | NoJob | Fail | Go


def start_decision(alloc_id: int, assignment: Assignment | None, view: LocalView) -> StartDecision:
    """Whether and how to start allocation ``alloc_id``'s job (the module's second table)."""
    if alloc_id in view.jobs or alloc_id in view.preparing:
        return Already()
    if assignment is not None and assignment.status == AllocationStatus.NOTICED:
        epoch = assignment.epoch  # noticed before its job started here: it never starts
        return Decline(epoch, answer=notice_before_start_report(epoch=epoch))
    if assignment is None or assignment.status not in STARTABLE:
        return Ended()
    if view.leaving:
        return Decline(assignment.epoch)
    if not assignment.job:
        return NotYet() if assignment.status == AllocationStatus.RESERVED else NoJob()
    try:
        gang = GangPlace.from_assignment(assignment.gang)
    except ValueError as exc:  # never run: its ranks could not meet
        return Fail(assignment.epoch, str(exc))
    return Go(assignment, gang)


def cpu_threads(job_gpus: int, node_gpus: int, cpus: int) -> int:
    """A job's share of the host's ``cpus`` cores, as its share of the node's GPUs (at least
    one): its default ``OMP_NUM_THREADS``, so that the jobs of one node do not each start a
    thread per core of the host (torch's default) and spend the cores switching between them."""
    return max(1, cpus * job_gpus // max(1, node_gpus))


def job_request(go: Go, gpu_indices, state_dir: Path, *, node: tuple[int, int]) -> JobRequest:
    """The runner's request for a job the agent starts on ``gpu_indices``; ``node``: the
    node's GPUs and the host's cores."""
    assignment, job = go.assignment, go.assignment.job
    return JobRequest(
        allocation_id=assignment.id,
        epoch=assignment.epoch,
        bid_id=assignment.bid_id,
        command=list(job.command),
        env=dict(job.env),
        gpu_indices=list(gpu_indices),
        workdir=state_dir / f"alloc-{assignment.id}",
        checkpoint_url=job.checkpoint_url,
        checkpoint_key=assignment.checkpoint_key,
        image=job.image,
        tenant_id=assignment.tenant_id,
        gang=go.gang,
        job_address=assignment.job_address,
        cpu_threads=cpu_threads(len(gpu_indices), *node),
    )


# ---------------------------------------------------------------- a job's exit


def exit_report(epoch: int, code: int, last: str | None) -> AllocationReport:
    """The report of a job that exited by itself: finished (0) or failed, with its exit code
    and last line."""
    if code == 0:
        return AllocationReport(epoch=epoch, outcome=ReportOutcome.FINISHED)
    detail = exit_detail(code, last)
    return AllocationReport(epoch=epoch, outcome=ReportOutcome.FAILED, detail=detail)
