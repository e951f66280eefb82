"""The worker's rules on plain data (``worker/reactions.py``): no Prefect server, no market.

Every branch the end-to-end tests (``test_worker_e2e.py``, ``test_worker_shutdown.py``) drive
through real processes is decided here, plus the orders of events only a slow machine used to
produce. Each test is milliseconds.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from helpers import bid, bid_event
from prefect_spotgpu.messages import EventResponse
from prefect_spotgpu.protocol import BidStatus, EndReason, WorkerEvent
from prefect_spotgpu.worker.reactions import (
    ENGINE_EXIT_SECONDS,
    Ask,
    CancelBid,
    Ended,
    Facts,
    Fail,
    Go,
    Nothing,
    Phase,
    Reschedule,
    RunView,
    Settings,
    Track,
    adoptable,
    after_engine,
    cancel_requested,
    engine_wait_seconds,
    hand_over,
    missed_preemption,
    react,
    starting_message,
    window_over,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SETTINGS = Settings(max_preemptions=3)
BID = bid(id=7, gpu_model="A100-80G", gpu_count=1, region="any", max_price=1.5)


def event(kind: str, alloc: int, node: int = 1, **payload):
    return bid_event(kind, alloc, bid=BID.id, node=node, **payload)


def run(phase: Phase | None, name: str | None = None) -> RunView:
    return RunView(phase, name or (phase.name.title() if phase else ""))


class Follow:
    """A track and the reactions to events as a worker folds them in."""

    def __init__(self, *earlier: EventResponse, settings: Settings = SETTINGS) -> None:
        self.track = Track.from_events(list(earlier))
        self.settings = settings

    def react(self, e: EventResponse, facts: Facts | None = None, now: datetime = NOW):
        ended = self.track.apply(e)
        return react(e, ended, self.track, self.settings, now, facts or Facts())


# ---------------------------------------------------------------- starting and resuming


def test_the_current_allocation_starting_is_a_go():
    reaction = Follow().react(event("allocated", 11, node=2))
    assert reaction == Go(allocation_id=11, node_id=2, preemptions=0)
    assert not reaction.resumed and not reaction.ends_attempt
    assert starting_message(reaction, BID) == (
        "Allocation 11 on node 2: 1 x A100-80G in any, at most 1.50 per GPU-hour"
    )


def test_the_allocation_after_a_preemption_is_a_resume():
    follow = Follow(event("allocated", 11), event("preempted", 11, reason="node lost"))
    go = follow.react(event("allocated", 12, node=3))
    assert go == Go(allocation_id=12, node_id=3, preemptions=1) and go.resumed
    assert starting_message(go, BID).endswith("(resuming after 1 preemption(s))")


def test_a_placement_queued_behind_the_lost_allocation_waits_for_its_end():
    """A lost node: the market places the bid anew in the same tick, and that placement's
    event comes before the lost allocation's end (a slow machine saw this order)."""
    follow = Follow(event("allocated", 11))
    assert follow.react(event("allocated", 12, node=3)) == Nothing()
    lost = follow.react(event("preempted", 11, reason="node lost"))
    assert isinstance(lost, Reschedule)
    # the next attempt starts from the bid's history: the queued allocation is current
    assert follow.track.live == 12 and follow.track.nodes[12] == 3


def test_an_allocation_that_ended_before_it_was_seen_starting_is_not_a_go():
    follow = Follow(event("preempted", 11, reason="node lost"))
    assert follow.react(event("allocated", 11)) == Nothing()
    assert follow.track.live is None


@pytest.mark.parametrize(
    ("phase", "proposes_pending"),
    [
        (None, True),
        (Phase.SCHEDULED, True),
        (Phase.PENDING, True),
        (Phase.CRASHED, False),  # final: a preemption no worker saw (missed_preemption)
        (Phase.RUNNING, False),  # adopted while its job runs: past its launcher
        (Phase.COMPLETED, False),  # adopted just as it ended: Pending would knock it back
        (Phase.FAILED, False),
        (Phase.CANCELLED, False),
    ],
)
def test_go_proposes_pending_only_to_a_run_not_past_its_launcher(phase, proposes_pending):
    assert hand_over(run(phase)) is proposes_pending


# ---------------------------------------------------------------- notices and reservations


def test_a_reservation_is_a_log_line():
    reaction = Follow(event("allocated", 11)).react(event("reserved", 12, node=4))
    assert reaction == Nothing(log=("info", "GPUs reserved for this run on node 4 (allocation 12)"))


def test_an_image_pull_of_the_current_allocation_is_a_log_line_in_the_run():
    follow = Follow(event("allocated", 11))
    line = "pulling pytorch/pytorch:2.5.1: 1.2 of 3.4 GB (35 %)"
    assert follow.react(event("pulling", 11, node=4, detail=line)) == Nothing(
        log=("info", f"Node 4: {line}")
    )
    assert follow.react(event("pulling", 9, node=3, detail=line)) == Nothing()  # an old one
    assert follow.track.live == 11 and follow.track.preemptions == 0  # no change of state


def test_a_notice_of_the_current_allocation_warns_with_the_seconds_left_and_an_event():
    deadline = (NOW + timedelta(seconds=300)).timestamp()
    follow = Follow(event("allocated", 11))
    reaction = follow.react(
        event("noticed", 11, node=2, reason="reclaimed", deadline=deadline, extra={"x": 1})
    )
    assert isinstance(reaction, Nothing) and not reaction.ends_attempt
    assert reaction.log == (
        "warning",
        "Notice: allocation 11 on node 2 ends (reclaimed); final save due within 300 s",
    )
    assert reaction.emit.what is WorkerEvent.NOTICED
    assert reaction.emit.payload == {"reason": "reclaimed", "deadline": deadline}  # scalars


def test_a_notice_of_another_allocation_is_ignored():
    follow = Follow(event("allocated", 11))
    assert follow.react(event("noticed", 99, reason="outbid")) == Nothing()


# ---------------------------------------------------------------- preemptions


def test_a_preemption_reschedules_the_run_now_and_keeps_the_bid():
    follow = Follow(event("allocated", 11, node=2))
    reaction = follow.react(event("preempted", 11, node=2, reason="notice deadline passed"))
    assert isinstance(reaction, Reschedule) and reaction.ends_attempt
    assert reaction.when == NOW and not reaction.job_stopped and reaction.cancel_if_over
    assert reaction.message == (
        "Preempted on node 2 (notice deadline passed); resumes from its checkpoint on the "
        "next allocation of bid 7"
    )
    assert reaction.log == ("warning", reaction.message)
    assert reaction.emit.what is WorkerEvent.PREEMPTED
    assert engine_wait_seconds(reaction) == ENGINE_EXIT_SECONDS


def test_after_an_acknowledged_final_save_the_engine_is_not_waited_for():
    follow = Follow(event("allocated", 11))
    reaction = follow.react(event("preempted", 11, reason=EndReason.SAVED_AND_STOPPED))
    assert isinstance(reaction, Reschedule) and reaction.job_stopped
    assert engine_wait_seconds(reaction) == 0


def test_a_preemption_of_an_allocation_that_is_not_current_does_not_end_the_attempt():
    follow = Follow(event("allocated", 11), event("allocated", 12))
    assert follow.react(event("preempted", 12, reason="node lost")) == Nothing()
    assert follow.track.live == 11 and follow.track.preemptions == 1


def test_up_to_max_preemptions_the_run_resumes_and_beyond_it_fails():
    settings = Settings(max_preemptions=1)
    follow = Follow(settings=settings)
    follow.react(event("allocated", 11))
    assert isinstance(follow.react(event("preempted", 11, reason="node lost")), Reschedule)
    follow.react(event("allocated", 12))
    failed = follow.react(event("preempted", 12, reason="node lost"))
    assert isinstance(failed, Fail) and failed.ends_attempt
    assert failed.message == "Preempted 2 times, more than max_preemptions=1; bid 7 cancelled"
    assert failed.log == ("error", failed.message)
    assert failed.emit.what is WorkerEvent.PREEMPTED


def test_a_cheap_window_run_preempted_as_its_window_closes_resumes_when_it_reopens():
    settings = Settings(max_preemptions=3, cheap_window_only=True, timezone="Europe/Berlin")
    closing = datetime(2026, 12, 3, 7, 58, tzinfo=UTC)  # Thursday 08:58 in Berlin
    follow = Follow(event("allocated", 11), settings=settings)
    reaction = follow.react(event("preempted", 11, reason="window_closing"), now=closing)
    assert reaction.when == datetime(2026, 12, 3, 17, 0, tzinfo=UTC)
    assert reaction.message.endswith("; the cheap window reopens at 2026-12-03T17:00+00:00")


def test_a_failed_job_is_the_runs_own_end_not_a_preemption():
    follow = Follow(event("allocated", 11))
    failed = event("preempted", 11, reason=EndReason.JOB_FAILED)
    assert follow.react(failed) == Ask(what="run")
    assert follow.track.preemptions == 0
    ended = react(failed, True, follow.track, SETTINGS, NOW, Facts(run=run(Phase.FAILED)))
    assert ended == CancelBid(status_code=1, log=("info", "Flow run ended Failed on allocation 11"))


# ---------------------------------------------------------------- the job's own end


def finished(facts: Facts) -> object:
    follow = Follow(event("allocated", 11))
    e = event("finished", 11, reason=EndReason.JOB_FINISHED)
    follow.track.apply(e)
    return react(e, True, follow.track, SETTINGS, NOW, facts)


def test_a_finished_job_asks_for_the_run_then_ends_with_its_final_state():
    assert finished(Facts()) == Ask(what="run")
    completed = finished(Facts(run=run(Phase.COMPLETED)))
    assert completed == Ended(
        status_code=0, log=("info", "Flow run ended Completed on allocation 11")
    )
    assert completed.ends_attempt
    assert finished(Facts(run=run(Phase.FAILED))).status_code == 1


def test_a_job_that_finished_while_its_bid_is_held_waits_for_credit_and_keeps_the_bid():
    not_final = Facts(run=run(Phase.RUNNING))
    assert finished(not_final) == Ask(what="bid")
    held = bid(status=BidStatus.HELD, hold_reason="out of credit: balance 0.0000")
    reaction = finished(Facts(run=not_final.run, bid=held))
    assert isinstance(reaction, Reschedule) and reaction.when == NOW
    assert not reaction.cancel_if_over and not reaction.job_stopped
    assert reaction.message == (
        "Bid 7 is held (out of credit: balance 0.0000); the run resumes when the market releases it"
    )


def test_a_job_that_ended_without_a_final_state_cancels_the_bid_and_fails_the_attempt():
    gone = finished(Facts(run=run(Phase.RUNNING), bid=bid(status=BidStatus.FINISHED)))
    assert gone == CancelBid(
        status_code=1,
        log=(
            "error",
            "The job on allocation 11 ended (job finished) without a final flow run state",
        ),
    )


def test_a_released_current_allocation_without_a_final_state_cancels_the_bid():
    follow = Follow(event("allocated", 11))
    e = event("released", 11, reason="node draining")
    assert follow.react(e) == Ask(what="run")
    reaction = react(e, True, follow.track, SETTINGS, NOW, Facts(run=run(Phase.PENDING)))
    assert isinstance(reaction, CancelBid) and reaction.status_code == 1


def test_the_same_event_gives_the_same_reaction_so_retried_effects_are_safe():
    follow = Follow(event("allocated", 11))
    e = event("preempted", 11, reason="node lost")
    ended = follow.track.apply(e)
    first = react(e, ended, follow.track, SETTINGS, NOW)
    assert react(e, ended, follow.track, SETTINGS, NOW) == first


# ---------------------------------------------------------------- around an attempt


@pytest.mark.parametrize(
    ("label", "phase", "reason", "missed"),
    [
        ("11", Phase.RUNNING, "node lost", True),  # its engine never heard: still Running
        ("11", Phase.CRASHED, "notice deadline passed", True),  # stopped engine: Crashed
        ("11", Phase.SCHEDULED, "node lost", False),  # already rescheduled
        ("11", Phase.COMPLETED, "node lost", False),
        ("12", Phase.RUNNING, "node lost", False),  # it runs on another allocation
        (None, Phase.RUNNING, "node lost", False),
        ("11", Phase.RUNNING, EndReason.JOB_FAILED, False),  # its own end, not a preemption
    ],
)
def test_a_preemption_no_worker_saw_is_found_in_the_bids_history(label, phase, reason, missed):
    events = [event("allocated", 11), event("preempted", 11, reason=reason)]
    found = missed_preemption(events, label, run(phase))
    assert (found is events[1]) if missed else found is None


@pytest.mark.parametrize(
    ("phase", "job_stopped", "over", "insist"),
    [
        (Phase.COMPLETED, False, True, False),  # the engine finished it: leave it
        (Phase.FAILED, False, True, False),
        (Phase.CRASHED, True, False, False),  # the stopped engine's last word is in
        (Phase.RUNNING, False, False, True),  # its Crashed may still land on our Scheduled
        (Phase.RUNNING, True, False, False),
        (Phase.PENDING, False, False, False),
        (None, False, False, False),
    ],
)
def test_after_the_engines_last_word(phase, job_stopped, over, insist):
    reschedule = Reschedule(message="m", when=NOW, job_stopped=job_stopped)
    then = after_engine(run(phase), reschedule)
    assert (then.over, then.insist) == (over, insist)


def test_a_cancellation_is_cancelling_or_cancelled():
    assert cancel_requested(run(Phase.CANCELLING)) and cancel_requested(run(Phase.CANCELLED))
    assert not any(cancel_requested(run(p)) for p in Phase if "CANCEL" not in p.value)
    assert not cancel_requested(run(None))


@pytest.mark.parametrize(
    ("phase", "owner", "released_by", "adopted"),
    [
        (Phase.RUNNING, "old", None, True),  # its owner's heartbeat is old
        (Phase.PENDING, "old", None, True),
        (Phase.CRASHED, "old", None, True),  # a preemption no one followed stopped it
        (Phase.RUNNING, None, None, True),
        (Phase.RUNNING, "alive", None, False),  # its owner follows it
        (Phase.RUNNING, "alive", "alive", True),  # its owner stopped and released it
        (Phase.RUNNING, "alive", "someone-else", False),  # released by an earlier owner
        (Phase.SCHEDULED, "old", None, False),  # Prefect hands it to a worker itself
        (Phase.COMPLETED, "old", None, False),
        (None, "old", None, False),
    ],
)
def test_which_runs_a_worker_adopts(phase, owner, released_by, adopted):
    assert adoptable(run(phase), owner, released_by, live_workers={"alive"}) is adopted


def test_a_cheap_window_is_over_a_notice_before_it_closes():
    end = NOW + timedelta(seconds=299)
    assert window_over(bid(window_end=end.isoformat()), NOW)
    assert not window_over(bid(window_end=(NOW + timedelta(seconds=301)).isoformat()), NOW)
    assert window_over(bid(window_end=end.replace(tzinfo=None).isoformat()), NOW)  # naive: UTC
    assert not window_over(bid(window_end=None), NOW)


def test_the_phases_are_prefects_state_types_with_the_same_final_ones():
    from prefect.client.schemas.objects import State, StateType

    assert {p.value for p in Phase} == {t.value for t in StateType}
    for kind in StateType:
        assert Phase(kind.value).is_final is State(type=kind).is_final(), kind


def test_the_rules_read_the_configuration_they_are_given():
    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    config = SpotGPUJobConfiguration(
        max_preemptions=2, cheap_window_only=True, timezone="Europe/Berlin"
    )
    assert Settings.of(config) == Settings(2, True, "Europe/Berlin")


def test_a_job_that_failed_with_the_nodes_word_on_why_fails_the_run_saying_it():
    follow = Follow(event("allocated", 11, node=2))
    detail = "the job could not start: image 'x/y:1' is not on this node and could not be pulled"
    e = event("preempted", 11, node=2, reason=EndReason.JOB_FAILED, detail=detail)
    follow.track.apply(e)
    reaction = react(e, True, follow.track, SETTINGS, NOW, Facts(run=run(Phase.PENDING)))
    assert isinstance(reaction, Fail) and reaction.emit is None
    assert reaction.message == f"The job on allocation 11 failed on node 2: {detail}"
    assert follow.track.preemptions == 0  # not a preemption: no resume
    # a run its engine already ended keeps that end
    ended = react(e, True, follow.track, SETTINGS, NOW, Facts(run=run(Phase.FAILED)))
    assert isinstance(ended, CancelBid) and ended.status_code == 1


def test_a_lost_node_without_a_notice_is_a_crash_and_with_one_a_preemption():
    """A preemption never reads as a crash; a node lost with no notice does (and resumes)."""
    now, settings = datetime(2026, 12, 1, 12, tzinfo=UTC), Settings(max_preemptions=3)
    for noticed in (False, True):
        track = Track()
        started = bid_event("allocated", 11, node=2)
        track.apply(started)
        if noticed:
            track.apply(bid_event("noticed", 11, node=2, deadline=1e12))
        lost = bid_event("preempted", 11, node=2, reason="node lost")
        reaction = react(lost, track.apply(lost), track, settings, now)
        assert isinstance(reaction, Reschedule)
        assert reaction.crashed is not noticed
        assert reaction.message.startswith("Preempted" if noticed else "Crashed")
    reclaimed = bid_event("preempted", 11, node=2, reason="final save acknowledged")
    track = Track()
    track.apply(started)
    reaction = react(reclaimed, track.apply(reclaimed), track, settings, now)
    assert not reaction.crashed and reaction.job_stopped
