"""Deadline pacing: what the worker bids for a run with ``gpu_hours`` and a deadline, on
tabled cases (``prefect_spotgpu.worker.pacing``, over the policies of
``prefect_spotgpu.economics.deadline``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from helpers import allocation, bid, quote
from prefect_spotgpu.economics.policies import POLICIES
from prefect_spotgpu.protocol import MarketTerms
from prefect_spotgpu.worker.config import PolicyChoice, SpotGPUJobConfiguration
from prefect_spotgpu.worker.pacing import Pace, done_hours, plan

T0 = datetime(2026, 12, 1, 18, 0, tzinfo=UTC)
H = 3600.0


def pace(work=4.0, deadline_h=6.0, policy="uniform-progress", fallback=True, restart=5.0):
    return Pace(
        gpu_hours=work,
        deadline=T0 + timedelta(hours=deadline_h),
        origin=T0,
        policy=policy,
        restart_minutes=restart,
        cap=1.2,
        gpu_model="A100-80G",
        on_demand_fallback=fallback,
    )


def alloc(start_h, end_h=None, status=None):
    """An allocation that started ``start_h`` after T0 (and ended at ``end_h``)."""
    if status is None:
        status = "running" if end_h is None else "preempted"
    ended = None if end_h is None else T0.timestamp() + end_h * H
    return allocation(status=status, started_at=T0.timestamp() + start_h * H, ended_at=ended)


SPOT = bid(id=1, capacity="spot", max_price=1.2)
ON_DEMAND = bid(id=2, capacity="on_demand", max_price=2.1)


@pytest.mark.parametrize(
    ("case", "p", "at_h", "bid", "allocations", "mode", "price"),
    [
        ("nothing ran yet: on pace, the cap", pace(), 0.0, None, [], "spot", 1.2),
        ("holding spot GPUs: keep them", pace(), 1.0, SPOT, [alloc(0.1)], "spot", 1.2),
        (
            "far ahead and waiting: the base bid",
            pace(work=4, deadline_h=16),
            4.0,
            SPOT,
            [alloc(0.0, 3.2)],
            "spot",
            0.9,
        ),
        (
            "a little ahead: between base and cap",
            pace(work=4, deadline_h=16, restart=0),
            4.0,
            SPOT,
            [alloc(0.0, 1.5)],
            "spot",
            1.05,
        ),
        (
            "waiting, slack just above a restart and a step",
            pace(),
            3.3,
            SPOT,
            [alloc(0, 1.5)],
            "spot",
            1.2,
        ),
        (
            "waiting, slack just below a restart and a step",
            pace(),
            3.35,
            SPOT,
            [alloc(0, 1.5)],
            "on_demand",
            2.1,
        ),
        (
            "waiting with no slack left: on-demand",
            pace(),
            4.45,
            SPOT,
            [alloc(0, 1.5)],
            "on_demand",
            2.1,
        ),
        (
            "running late on spot: on-demand",
            pace(work=4, deadline_h=4.1),
            1.0,
            SPOT,
            [alloc(0.1)],
            "on_demand",
            2.1,
        ),
        ("no fallback: spot at the cap", pace(fallback=False), 4.45, SPOT, [], "spot", 1.2),
        (  # moved at the last resort: slack 0.05 h, under two restarts and a step
            "on-demand with no slack to spare stays",
            pace(deadline_h=4.45),
            1.0,
            ON_DEMAND,
            [alloc(0.6)],
            "on_demand",
            2.1,
        ),
        (  # the bridge's way back: slack 1.6 h pays this start and one more
            "deadline-aware goes back to spot from on-demand",
            pace(policy="deadline-aware"),
            1.0,
            ON_DEMAND,
            [alloc(0.6)],
            "spot",
            1.2,
        ),
        (
            "a waiting on-demand bid goes back to spot too",
            pace(policy="deadline-aware"),
            1.0,
            ON_DEMAND.model_copy(update={"max_price": 0.0001}),
            [alloc(0.1, 0.9)],
            "spot",
            1.185,  # waiting, a little ahead: uniform progress's pace
        ),
        ("the baseline policy", pace(policy="always-on-demand"), 0.0, None, [], "on_demand", 2.1),
        (
            "greedy spot bids the cap",
            pace(policy="greedy-spot", deadline_h=20),
            1,
            SPOT,
            [],
            "spot",
            1.2,
        ),
    ],
)
def test_the_plan(case, p, at_h, bid, allocations, mode, price):
    course = plan(p, T0 + timedelta(hours=at_h), bid, allocations)
    assert (course.mode, course.price) == (mode, price), (case, course.describe())


def test_progress_is_the_time_run_less_a_restart_per_start():
    now = T0.timestamp() + 5 * H
    done, holding = done_hours(
        [alloc(0, 2), alloc(2.5, 3, "finished"), alloc(4), alloc(4.5, status="reserved")],
        now,
        restart_h=0.1,
    )
    assert done == pytest.approx(1.9 + 0.4 + 0.9) and holding


def test_an_unknown_policy_is_refused_naming_the_valid_ones():
    valid = "always-on-demand, deadline-aware, greedy-spot, uniform-progress"
    with pytest.raises(ValueError, match=valid):
        pace(policy="yolo")


def test_the_ui_offers_every_policy():
    assert set(PolicyChoice.__args__) == set(POLICIES)


def test_a_deadline_in_hours_counts_from_the_scheduled_start():
    config = SpotGPUJobConfiguration(gpu_hours=2, deadline_hours=8, max_price=1.1)
    run = SimpleNamespace(expected_start_time=T0, created=T0 - timedelta(days=1))
    p = config.pace(run)
    assert p.deadline == T0 + timedelta(hours=8) and p.cap == 1.1 and p.origin == T0
    assert SpotGPUJobConfiguration().pace(run) is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"gpu_hours": 2}, "gpu_hours needs a deadline"),
        ({"gpu_hours": 2, "deadline_hours": 1}, "cannot fit in deadline_hours"),
        ({"deadline_hours": 3, "deadline": T0}, "deadline or deadline_hours, not both"),
        ({"gpu_hours": 2, "deadline_hours": 3, "bidding_policy": "yolo"}, "unknown bidding"),
    ],
)
def test_bad_pacing_terms_are_refused(fields, words):
    with pytest.raises(ValidationError, match=words):
        SpotGPUJobConfiguration(**fields)


def test_every_regions_quote_reaches_the_policy_which_picks_where_capacity_is():
    quotes = [
        quote("eu-west", clearing_price=1.19, gpus_free=0),  # closed at 1.2
        quote("us-east", clearing_price=0.95, gpus_free=1),
        quote("us-west", clearing_price=1.0, gpus_free=1),
        quote("us-east", capacity="on_demand", clearing_price=2.1, gpus_free=4),
        quote("ap", gpu_model="H100-80G", clearing_price=0.5, gpus_free=8),
    ]
    p = pace(policy="deadline-aware", deadline_h=20)
    course = plan(p, T0 + timedelta(hours=1), SPOT, [], quotes)
    assert [r.region for r in course.view.regions] == ["eu-west", "us-east", "us-west"]
    assert [r.open for r in course.view.regions] == [False, True, True]
    assert (course.mode, course.price, course.region) == ("spot", 1.2, None)  # any region
    assert course.view.spot_open and course.view.spot_floor == 0.95

    closed = [q.model_copy(update={"gpus_free": 0, "clearing_price": 1.19}) for q in quotes[:3]]
    course = plan(p, T0 + timedelta(hours=1), SPOT, [], closed)
    assert not course.view.spot_open and course.mode == "spot"  # 18.8 h of slack: it waits
    course = plan(p, T0 + timedelta(hours=15.2), SPOT, [alloc(0, 1)], closed)
    assert course.mode == "on_demand", course.describe()  # open nowhere, slack 1.7 h: bridge

    pinned = pace(policy="deadline-aware", deadline_h=20)
    pinned = Pace(**{**{f: getattr(pinned, f) for f in pinned.__slots__}, "region": "eu-west"})
    course = plan(pinned, T0 + timedelta(hours=1), SPOT, [], quotes)
    assert [r.region for r in course.view.regions] == ["eu-west"]
    assert plan(p, T0 + timedelta(hours=1), SPOT, [], None).view.regions == ()  # no quotes


class _Market:
    """The market's API as ``Placement.steer`` calls it, recording the cancels."""

    def __init__(self, allocations, quotes):
        self._allocations, self._quotes, self.cancelled = allocations, quotes, []

    async def allocations(self, bid_id):
        return self._allocations

    async def quotes(self):
        return self._quotes

    async def terms(self):
        return MarketTerms()

    async def cancel(self, bid_id):
        self.cancelled.append(bid_id)


class _Run:
    def __init__(self):
        self.logger = SimpleNamespace(info=print, warning=print)
        self.events = []

    def emit(self, what, bid, **payload):
        self.events.append(str(what))


OPEN_SPOT = [quote("eu", gpus_free=2, gpus_total=2)]


@pytest.mark.parametrize(
    ("case", "policy", "bid", "status", "kept", "event"),
    [
        ("a running on-demand job is released by pace, not cancelled", "deadline-aware",
         ON_DEMAND, "running", True, None),
        ("a waiting on-demand bid is replaced by a spot bid", "deadline-aware",
         ON_DEMAND, "preempted", False, "spot"),
        ("a running spot job that must move is released by pace, not cancelled", "greedy-spot",
         SPOT, "running", True, None),
        ("a waiting spot bid that must move is replaced", "greedy-spot",
         SPOT, "preempted", False, "on-demand"),
    ],
)  # fmt: skip
def test_steering_never_cancels_a_running_job(case, policy, bid, status, kept, event):
    """``steer`` runs when an attempt starts too (a run adopted with its job running): a
    cancel there would stop the job without its final save."""
    import asyncio

    from prefect_spotgpu.worker.placement import Placement

    now = datetime.now(UTC)
    slack_h = 1.5 if policy == "deadline-aware" else 0.01  # greedy: no slack left
    ended = None if status == "running" else now.timestamp()
    ran = allocation(started_at=(now - timedelta(hours=0.5)).timestamp(), status=status,
                     ended_at=ended)  # fmt: skip
    p = Pace(gpu_hours=2.0, deadline=now + timedelta(hours=2.0 - 0.5 + slack_h),
             origin=now - timedelta(hours=0.5), policy=policy, restart_minutes=0.1, cap=1.2,
             gpu_model="A100-80G", region="any")  # fmt: skip
    market, run = _Market([ran], OPEN_SPOT), _Run()
    placement = Placement(market=market, run=run, configuration=None, pool_name="p")
    got, _course, replaced = asyncio.run(placement.steer(p, bid))
    assert (got is bid) == kept, case
    assert market.cancelled == ([] if kept else [bid.id]), case
    assert run.events == ([] if event is None else [event]), case
    assert (replaced is None) == kept, case
