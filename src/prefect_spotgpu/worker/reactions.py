"""PURE: what each event of a flow run's bid means for the run — the worker's rules.

The worker follows one market bid per flow run (``attempt.py``). Every event of the bid is
folded into a :class:`Track` and handed to :func:`react`, with what the worker knows of the
run (:class:`Facts`), its configuration and the clock; the answer is one :class:`Reaction`,
which ``attempt.py`` carries out against Prefect and the market. Nothing here does I/O, reads
the clock or imports Prefect or httpx: every rule is a unit test on plain data
(``tests/test_worker_reactions.py``). The rules, for a bid's events in order::

    allocated (the current one)   Go: hand the run to the allocation's launcher
    reserved                      Nothing (a log line: GPUs held for the next allocation)
    pulling (the current one)     Nothing (a log line: the node's image pull, how far)
    noticed (the current one)     Nothing (a warning and the event spotgpu.bid.noticed)
    preempted (not a failed job)  Reschedule "Preempted" (now, or at the next cheap window),
                                  or Fail beyond max_preemptions (the bid is cancelled);
                                  a lost node's allocation never noticed: Crashed first
    finished, the run not final   Ask for the bid: held (out of credit) -> Reschedule, keep it
    the job's own end             Ended (the engine wrote the run's final state) or
                                  CancelBid (a failed job, or an end without a final state);
                                  a job that failed before its run ended, with the node's
                                  word on why (a missing image): Fail, saying it

``Ask`` is how a rule asks for a fact it needs before it decides (the run's state, the bid):
the caller reads it and calls :func:`react` again. The rules around an attempt are here too:
a preemption no worker saw (:func:`missed_preemption`), whether to propose ``Pending`` to a
run being handed to its job (:func:`hand_over`), what a reschedule does after the engine's
last word (:func:`after_engine`), and which runs a worker may adopt (:func:`adoptable`).

    >>> from datetime import UTC, datetime
    >>> now, track = datetime(2026, 12, 1, 12, tzinfo=UTC), Track()
    >>> settings = Settings(max_preemptions=3)
    >>> started = EventResponse(id=1, kind="allocated", bid_id=7, node_id=2, allocation_id=11,
    ...                         payload={}, created_at=now)
    >>> react(started, track.apply(started), track, settings, now)
    Go(log=None, emit=None, allocation_id=11, node_id=2, preemptions=0)
    >>> lost = started.model_copy(
    ...     update={"kind": "preempted", "payload": EventPayload(reason="node lost")})
    >>> reaction = react(lost, track.apply(lost), track, settings, now)
    >>> reaction.crashed, reaction.message.split(";")[0]  # never noticed: a crash
    (True, 'Crashed on node 2 (node lost, no notice)')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from prefect_spotgpu.economics.schedules import aware, cheap_window
from prefect_spotgpu.messages import BidResponse, EventPayload, EventResponse
from prefect_spotgpu.protocol import (
    HELD_UNSERVED,
    BidStatus,
    EndReason,
    EventKind,
    MarketTerms,
    NoticeReason,
    WorkerEvent,
)
from prefect_spotgpu.worker.report import describe


class Phase(StrEnum):
    """A flow run's Prefect state type, as plain data (``attempt.phase_of`` maps a state)."""

    SCHEDULED = "SCHEDULED"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CRASHED = "CRASHED"
    CANCELLING = "CANCELLING"
    CANCELLED = "CANCELLED"

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({Phase.COMPLETED, Phase.FAILED, Phase.CRASHED, Phase.CANCELLED})


@dataclass(frozen=True)
class RunView:
    """What the worker read of the flow run: its state (None: it has none) and its name."""

    phase: Phase | None
    name: str = ""


@dataclass(frozen=True)
class Settings:
    """The parts of the run's job configuration the rules read."""

    max_preemptions: int
    cheap_window_only: bool = False
    timezone: str = "UTC"
    notice_seconds: float = MarketTerms().notice_seconds
    """The market's notice (``MarketTerms``): a window closing sooner cannot start a run."""

    @classmethod
    def of(cls, configuration, terms: MarketTerms | None = None) -> Settings:
        return cls(
            max_preemptions=configuration.max_preemptions,
            cheap_window_only=configuration.cheap_window_only,
            timezone=configuration.timezone,
            notice_seconds=(terms or MarketTerms()).notice_seconds,
        )


@dataclass(frozen=True)
class Facts:
    """What the caller has read for this event so far; ``None``: not read (yet)."""

    run: RunView | None = None
    bid: BidResponse | None = None


class Track:
    """What a bid's events say: its running allocations, the ended ones, the preemptions.

    Normally one allocation runs at a time; when a node is lost the market may place the bid
    anew in the same tick, and that placement's event comes *before* the lost allocation's
    end. So running allocations queue in order, and the first one is the current one.

    A gang's events (``lead``: rank 0's bid, whose events cover every member) are followed
    through rank 0's allocations: the market notices, ends and finishes the gang whole, so
    rank 0's allocation sees every end of the gang, and one preemption counts once. The other
    members' allocations are ``members``; a member whose job failed is ``member_failure``,
    which rank 0's end that follows (``GANG_MEMBER_ENDED``) stands for."""

    def __init__(self, lead: int | None = None) -> None:
        self.lead = lead
        self.running: list[int] = []
        self.ended: set[int] = set()
        self.nodes: dict[int, int] = {}
        self.members: set[int] = set()
        self.member_failure: EventResponse | None = None
        self.preemptions = 0
        self.noticed: set[int] = set()

    @property
    def live(self) -> int | None:
        return self.running[0] if self.running else None

    @classmethod
    def from_events(cls, events: list[EventResponse], lead: int | None = None) -> Track:
        track = cls(lead)
        for event in events:
            track.apply(event)
        return track

    def is_member(self, event: EventResponse) -> bool:
        """Whether the event is of a gang member other than rank 0."""
        return self.lead is not None and event.bid_id != self.lead

    def apply(self, event: EventResponse) -> bool:
        """Fold one event in; True when it ended the current allocation."""
        kind, alloc = event.kind, event.allocation_id
        self.nodes[alloc] = event.node_id
        if self.is_member(event):
            self.members.add(alloc)
            if kind == EventKind.PREEMPTED and event.payload.reason == JOB_FAILED:
                self.member_failure = event
            return False
        if kind == EventKind.ALLOCATED and alloc not in self.ended and alloc not in self.running:
            self.running.append(alloc)
            self.member_failure = None  # the gang starts anew
        elif kind == EventKind.NOTICED:
            self.noticed.add(alloc)
        elif kind in (EventKind.PREEMPTED, EventKind.FINISHED, EventKind.RELEASED):
            self.ended.add(alloc)
            reason = event.payload.reason
            failed = reason == JOB_FAILED or (
                reason == GANG_MEMBER_ENDED and self.member_failure is not None
            )
            if kind == EventKind.PREEMPTED and not failed:
                self.preemptions += 1
            if alloc in self.running:
                current = alloc == self.running[0]
                self.running.remove(alloc)
                return current
        return False


JOB_FAILED = EndReason.JOB_FAILED
SAVED_AND_STOPPED = EndReason.SAVED_AND_STOPPED
GANG_MEMBER_ENDED = EndReason.GANG_MEMBER_ENDED
WITHOUT_NOTICE = frozenset({EndReason.NODE_LOST, EndReason.GANG_MEMBER_ENDED})
"""End reasons that may come with no notice: a crash, unless the allocation was noticed."""

# ---------------------------------------------------------------- reactions

Level = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class Emit:
    """A Prefect event ``spotgpu.bid.<what>`` on the bid, with this payload."""

    what: WorkerEvent
    payload: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Reaction:
    """What to do; first, for every kind: log ``log`` (level, message) and emit ``emit``."""

    log: tuple[Level, str] | None = None
    emit: Emit | None = None

    ends_attempt = False


@dataclass(frozen=True, kw_only=True)
class Nothing(Reaction):
    """Go on following the bid."""


@dataclass(frozen=True, kw_only=True)
class Ask(Reaction):
    """Read this fact and call ``react`` again: ``run`` (the flow run's state) or ``bid``."""

    what: Literal["run", "bid"]


@dataclass(frozen=True, kw_only=True)
class Go(Reaction):
    """Hand the run to the allocation now running: label it, and (see ``hand_over``) propose
    ``Pending("Starting")`` so the launcher on the node execs the engine."""

    allocation_id: int
    node_id: int | None
    preemptions: int

    @property
    def resumed(self) -> bool:
        return self.preemptions > 0


@dataclass(frozen=True, kw_only=True)
class Reschedule(Reaction):
    """``Scheduled("Preempted", message)`` at ``when``, after the engine's last word
    (``after_engine``). ``job_stopped``: the agent stopped the job after an acknowledged save
    (its engine has reported already). ``cancel_if_over``: when the run turns out to be over,
    cancel the bid (a preemption) or keep it (a held bid waits for its tenant's credit)."""

    message: str
    when: datetime
    job_stopped: bool = False
    cancel_if_over: bool = True
    crashed: bool = False
    """The allocation ended without a notice (its node was lost): the run shows ``Crashed``
    first, as Prefect's own crashes do, then is rescheduled. A noticed preemption never
    shows Crashed (the agent SIGKILLs its job: its engine cannot write one)."""
    ends_attempt = True


@dataclass(frozen=True, kw_only=True)
class Fail(Reaction):
    """Cancel the bid and force the run ``Failed(message)``; the attempt returns 0."""

    message: str
    ends_attempt = True


@dataclass(frozen=True, kw_only=True)
class CancelBid(Reaction):
    """The job ended without a run to go on: cancel the bid; the attempt returns
    ``status_code`` (0 only when the engine completed the run)."""

    status_code: int
    ends_attempt = True


@dataclass(frozen=True, kw_only=True)
class Ended(Reaction):
    """The job ended by itself and its engine wrote the run's final state; the market has
    finished the bid. The attempt returns ``status_code``."""

    status_code: int
    ends_attempt = True


def react(
    event: EventResponse,
    ended_current: bool,
    track: Track,
    settings: Settings,
    now: datetime,
    facts: Facts = Facts(),
) -> Reaction:
    """The worker's answer to one event already folded into ``track`` (``ended_current``:
    it ended the current allocation). See the module docstring; examples in the tests."""
    if track.is_member(event):
        return member_event(event)
    if (
        ended_current
        and event.payload.reason == GANG_MEMBER_ENDED
        and track.member_failure is not None
    ):
        event = track.member_failure  # the gang ended because this member's job failed
    kind, alloc, payload, node = event.kind, event.allocation_id, event.payload, event.node_id
    if not ended_current:
        if kind == EventKind.ALLOCATED and track.live == alloc:
            return Go(
                allocation_id=alloc, node_id=track.nodes.get(alloc), preemptions=track.preemptions
            )
        if kind == EventKind.PULLING and alloc == track.live:  # the pull's progress, in its log
            return Nothing(
                log=("info", f"Node {node}: {payload.detail or EventKind.PULLING.value}")
            )
        if kind == EventKind.RESERVED:
            return Nothing(
                log=("info", f"GPUs reserved for this run on node {node} (allocation {alloc})")
            )
        if kind == EventKind.NOTICED and alloc == track.live:
            left = (payload.deadline or now.timestamp()) - now.timestamp()
            return Nothing(
                log=(
                    "warning",
                    f"Notice: allocation {alloc} on node {node} ends "
                    f"({payload.reason or NoticeReason.RECLAIMED.value}); final save due "
                    f"within {left:.0f} s",
                ),
                emit=Emit(WorkerEvent.NOTICED, plain(payload)),
            )
        return Nothing()
    reason = str(payload.reason or kind)
    if kind == EventKind.PREEMPTED and reason != JOB_FAILED:
        return preempted(event, track, settings, now)
    # The job ended by itself: the engine has written the run's final state.
    if facts.run is None:
        return Ask(what="run")
    phase = facts.run.phase
    final = phase is not None and phase.is_final
    if kind == EventKind.FINISHED and not final:
        if facts.bid is None:
            return Ask(what="bid")
        bid = facts.bid
        if bid.status == BidStatus.HELD:  # e.g. out of credit: wait for it, keep the bid
            message = (
                f"Bid {bid.id} is held ({bid.hold_reason}); the run resumes when the "
                "market releases it"
            )
            return Reschedule(
                message=message, when=now, cancel_if_over=False, log=("warning", message)
            )
    if final:
        status = 0 if phase is Phase.COMPLETED else 1
        log: tuple[Level, str] = ("info", f"Flow run ended {facts.run.name} on allocation {alloc}")
        if kind == EventKind.PREEMPTED:  # the process exited non-zero: the bid must not go on
            return CancelBid(status_code=status, log=log)
        return Ended(status_code=status, log=log)
    detail = payload.detail
    if kind == EventKind.PREEMPTED and detail:  # the node said why (e.g. a missing image)
        message = f"The job on allocation {alloc} failed on node {node}: {detail}"
        return Fail(message=message, log=("error", message))
    return CancelBid(
        status_code=1,
        log=(
            "error",
            f"The job on allocation {alloc} ended ({reason}) without a final flow run state",
        ),
    )


def member_event(event: EventResponse) -> Nothing:
    """An event of a gang member other than rank 0: rank 0's allocation has its consequences
    (one notice, one end for the gang); a member's start and a failed job are logged."""
    kind, alloc, node = event.kind, event.allocation_id, event.node_id
    if kind == EventKind.ALLOCATED:
        return Nothing(log=("info", f"Gang member on node {node} started (allocation {alloc})"))
    if kind == EventKind.PREEMPTED and event.payload.reason == JOB_FAILED:
        detail = event.payload.detail or JOB_FAILED
        return Nothing(log=("error", f"Gang member's job on node {node} failed: {detail}"))
    return Nothing()


def preempted(
    event: EventResponse, track: Track, settings: Settings, now: datetime
) -> Fail | Reschedule:
    """A preemption of the run's allocation (``event``): reschedule it to resume from its
    checkpoint, or fail it once it was preempted more than ``max_preemptions`` times."""
    payload = event.payload
    reason = payload.reason or EventKind.PREEMPTED.value
    emit = Emit(WorkerEvent.PREEMPTED, plain(payload))
    if track.preemptions > settings.max_preemptions:
        message = (
            f"Preempted {track.preemptions} times, more than max_preemptions="
            f"{settings.max_preemptions}; bid {event.bid_id} cancelled"
        )
        return Fail(message=message, emit=emit, log=("error", message))
    crashed = reason in WITHOUT_NOTICE and event.allocation_id not in track.noticed
    message = (
        f"{'Crashed' if crashed else 'Preempted'} on node {event.node_id} ({reason}"
        f"{', no notice' if crashed else ''}); resumes from its "
        f"{'last periodic ' if crashed else ''}checkpoint "
        f"on the next allocation of bid {event.bid_id}"
    )
    when = resume_time(now, settings)
    if when > now:
        message += f"; the cheap window reopens at {when.isoformat(timespec='minutes')}"
    return Reschedule(
        message=message,
        when=when,
        job_stopped=reason == SAVED_AND_STOPPED,
        crashed=crashed,
        emit=emit,
        log=("warning", message),
    )


# ---------------------------------------------------------------- around an attempt


def missed_preemption(
    events: list[EventResponse], allocation_label: str | None, run: RunView
) -> EventResponse | None:
    """The ``preempted`` event of the allocation the run last ran on (its label
    ``spotgpu.allocation``), when the run has not been rescheduled since (it is still Running,
    or Crashed by that allocation's stopped engine): a preemption that completed while no
    worker followed the run. A failed job is not a preemption."""
    if not allocation_label or run.phase not in (Phase.RUNNING, Phase.CRASHED):
        return None
    for event in events:
        if (
            event.kind == EventKind.PREEMPTED
            and str(event.allocation_id) == str(allocation_label)
            and event.payload.reason != JOB_FAILED
        ):
            return event
    return None


def hand_over(run: RunView) -> bool:
    """Whether ``Go`` proposes ``Pending("Starting")``: not to a run adopted while its job
    runs. Its engine has it Running, or has just finished it; Pending would knock a finished
    run back to Pending for good (Prefect refuses Pending only from Pending, Running and
    Cancel*). The worker then follows the job."""
    return not (run.phase is Phase.RUNNING or (run.phase is not None and run.phase.is_final))


def starting_message(go: Go, bid: BidResponse) -> str:
    """The message of a ``Pending("Starting")`` state."""
    text = f"Allocation {go.allocation_id} on node {go.node_id}: {describe(bid)}"
    if go.resumed:
        text += f" (resuming after {go.preemptions} preemption(s))"
    return text


ENGINE_EXIT_SECONDS = 10.0
"""How long a preempted run's engine may take to report its own end before we reschedule."""


def engine_wait_seconds(reschedule: Reschedule) -> float:
    """How long to wait for the engine's last word before rescheduling: not at all after an
    acknowledged final save (the agent stopped the job and its engine reported Crashed)."""
    return 0.0 if reschedule.job_stopped else ENGINE_EXIT_SECONDS


@dataclass(frozen=True)
class AfterEngine:
    """What a ``Reschedule`` does once the engine had its say: ``over`` (the run is Completed
    or Failed by its engine: leave it), or set Scheduled; ``insist``: set it again while a
    stopped engine's forced Crashed lands on top (the engine may still report)."""

    over: bool
    insist: bool = False


def after_engine(run: RunView, reschedule: Reschedule) -> AfterEngine:
    """See ``AfterEngine``. A stopped engine reports Crashed itself, forcibly; that must not
    land after our Scheduled, or the run would never be picked up again."""
    if run.phase is not None and run.phase.is_final and run.phase is not Phase.CRASHED:
        return AfterEngine(over=True)
    return AfterEngine(over=False, insist=not reschedule.job_stopped and run.phase is Phase.RUNNING)


def unserved_message(bid: BidResponse) -> str | None:
    """What the worker says (the run's log, ``spotgpu.bid.held``) of a bid the market holds
    because no node can run it as asked (its runner: ``protocol.HELD_UNSERVED``), or None.

        >>> held = BidResponse.model_construct(id=4, status="held", hold_reason=HELD_UNSERVED)
        >>> unserved_message(held.model_copy(update={"hold_reason": HELD_UNSERVED + ": x"}))
        'Bid 4 is held: no node can run it: x'
        >>> unserved_message(held.model_copy(update={"status": "open"})) is None
        True
    """
    reason = bid.hold_reason or ""
    if bid.status != BidStatus.HELD or not reason.startswith(HELD_UNSERVED):
        return None
    return f"Bid {bid.id} is held: {reason}"


def cancel_requested(run: RunView) -> bool:
    """Whether the user cancelled the run (Cancelling, or Cancelled already)."""
    return run.phase in (Phase.CANCELLING, Phase.CANCELLED)


def adoptable(
    run: RunView, owner: str | None, released_by: str | None, live_workers: set[str]
) -> bool:
    """Whether a worker adopts a run of its pool whose bid is open: the run is Pending,
    Running or Crashed (its engine was stopped by a preemption no one followed), and its
    owner is gone — its heartbeat is old, or it stopped and labelled the run released."""
    if run.phase not in (Phase.PENDING, Phase.RUNNING, Phase.CRASHED):
        return False
    released = owner is not None and released_by == owner
    return owner not in live_workers or released


def is_live(last_heartbeat: float | None, interval: float, now: float) -> bool:
    """Whether a worker is alive: its last heartbeat (UNIX time) within three of its own
    heartbeat intervals (a caller's may beat slower than a pool worker's)."""
    return last_heartbeat is not None and now - last_heartbeat < 3 * interval


# ---------------------------------------------------------------- the cheap window


def resume_time(now: datetime, settings: Settings) -> datetime:
    """When a preempted run should be picked up again: now, or for a cheap-window run whose
    window closed, when the next window opens."""
    if not settings.cheap_window_only:
        return now
    start, _ = cheap_window(now + timedelta(seconds=settings.notice_seconds), settings.timezone)
    return max(now, start)


def window_over(
    bid: BidResponse, now: datetime, notice_seconds: float = MarketTerms().notice_seconds
) -> bool:
    """Whether a bid's cheap window has closed (or closes within a notice's length); a naive
    ``window_end`` is UTC."""
    if bid.window_end is None:
        return False
    return aware(bid.window_end).timestamp() <= now.timestamp() + notice_seconds


def plain(payload: EventPayload) -> dict:
    """The scalar fields of an event's payload, as the service wrote it (what a Prefect
    event's payload may carry)."""
    return {
        k: v
        for k, v in payload.model_dump().items()
        if isinstance(v, str | int | float | bool) or v is None
    }
