"""Deadline-aware bidding: policy decisions on tabled cases, replays of real and synthetic
availability through the real market (single- and multi-region), and the lower bound that no
policy -- registered, random or adversarial -- ever beats."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from prefect_spotgpu.economics.bound import competing, hindsight_schedule, lower_bound
from prefect_spotgpu.economics.deadline import (
    Action,
    JobView,
    RegionQuote,
    must_finish_on_demand,
)
from prefect_spotgpu.economics.policies import POLICIES, get_policy
from prefect_spotgpu.economics.regions import Regions, Trace, multi_zone_markets
from prefect_spotgpu.economics.replay import Job, MarketReplay, load_traces, replay

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"
BENCHMARK_JOB = Job()  # benchmarks/replay.py's defaults: 24 h of work within 48 h, cap 1.40


CLOSED = (RegionQuote("a", False, 1.3), RegionQuote("b", False, 1.35))
OPEN = (RegionQuote("a", False, 1.3), RegionQuote("b", True, 0.95, 1))


def view(**changes) -> JobView:
    base = dict(now_h=0.0, deadline_h=20.0, work_h=10.0, done_h=0.0, restart_h=0.2, step_h=0.5,
                mode="wait", ran=False, cap=1.2, on_demand_price=2.1)  # fmt: skip
    return JobView(**{**base, **changes})


@pytest.mark.parametrize(
    ("name", "situation", "expected"),
    [
        ("always-on-demand", {}, Action("on_demand")),
        ("greedy-spot", {}, Action("spot", 1.2)),
        ("greedy-spot", {"now_h": 9.4}, Action("spot", 1.2)),  # slack 0.6 < 0.7? not yet
        ("greedy-spot", {"now_h": 9.4, "done_h": 0.0}, Action("spot", 1.2)),
        ("greedy-spot", {"now_h": 9.5}, Action("on_demand")),  # slack 0.5 <= 0.7
        ("greedy-spot", {"now_h": 9.2, "mode": "on_demand", "ran": True}, Action("on_demand")),
        ("greedy-spot", {"now_h": 9.2}, Action("spot", 1.2)),  # not on it: no restart to fear
        # ours: far ahead -> only the cheaper hours; on pace or behind -> the cap
        ("uniform-progress", {"now_h": 4.0, "done_h": 4.6}, Action("spot", 0.9)),
        ("uniform-progress", {"now_h": 4.0, "done_h": 2.0}, Action("spot", 1.2)),
        ("uniform-progress", {"now_h": 4.0, "done_h": 3.25}, Action("spot", 1.05)),
        (
            "uniform-progress",
            {"now_h": 4.0, "done_h": 4.6, "mode": "spot", "ran": True},
            Action("spot", 1.2),
        ),  # holding GPUs: keep them
        ("uniform-progress", {"now_h": 15.0, "done_h": 5.0}, Action("on_demand")),
        # deadline-aware: uniform progress in any region, on-demand as a bridge
        ("deadline-aware", {"now_h": 4.0, "done_h": 4.6}, Action("spot", 0.9)),
        ("deadline-aware", {"now_h": 4.0, "mode": "spot", "ran": True}, Action("spot", 1.2)),
        ("deadline-aware", {"now_h": 8.5, "regions": CLOSED}, Action("on_demand")),  # 1.5 h
        ("deadline-aware", {"now_h": 7.0, "regions": CLOSED}, Action("spot", 1.2)),  # 3 h: waits
        (
            "deadline-aware",
            {"now_h": 8.5, "done_h": 1.0, "mode": "on_demand", "ran": True, "regions": OPEN},
            Action("spot", 1.2),
        ),  # back from the bridge: 2.5 h of slack pays this start and the one back
        (
            "deadline-aware",
            {"now_h": 10.0, "done_h": 1.0, "mode": "on_demand", "ran": True, "regions": OPEN},
            Action("on_demand"),
        ),  # 1.0 h: it does not (two starts and two steps are 1.4 h)
        (
            "deadline-aware",
            {"now_h": 9.0, "regions": CLOSED, "checkpoint_region": "a", "migrate_h": 0.5},
            Action("on_demand"),
        ),  # slack 1.0 h: below a start with the migration (0.7 h) and a step (0.5 h)
    ],
)
def test_policy_decisions(name, situation, expected):
    if name == "greedy-spot" and situation.get("now_h") == 9.4:
        situation = {**situation, "done_h": 0.7}  # slack 1.3: still spot
    assert get_policy(name)(view(**situation)) == expected


def test_unknown_policies_are_named():
    with pytest.raises(ValueError, match=r"choose one of always-on-demand, .*greedy-spot"):
        get_policy("yolo")


def synthetic(available, gap=600.0, name="synthetic/day/za_v100_1") -> Trace:
    return Trace(name, gap, np.asarray(available, dtype=np.int64), 1)


def test_always_available_spot_is_bought_at_market_prices():
    trace = synthetic([1] * 200)
    job = Job(work_h=6.0, deadline_h=12.0, cap=1.4, restart_h=0.2)
    greedy = replay(trace, "greedy-spot", job)
    assert greedy.met and greedy.on_demand_h == 0 and greedy.spot_h >= 6.0
    assert 0.3 < greedy.saving < 1 - 0.9 / 2.1 + 1e-9  # never below the owners' reserve
    on_demand = replay(trace, "always-on-demand", job)
    assert on_demand.met and abs(on_demand.saving) < 1e-9 and on_demand.spot_h == 0
    assert lower_bound(trace, job).cost <= greedy.cost


def test_no_spot_at_all_still_meets_the_deadline_on_demand():
    trace = synthetic([0] * 200)
    job = Job(work_h=6.0, deadline_h=12.0)
    for name in ("greedy-spot", "uniform-progress"):
        outcome = replay(trace, name, job)
        assert outcome.met, name
        assert outcome.spot_h == 0 and outcome.on_demand_h >= 6.0
    bound = lower_bound(trace, job)  # nothing but on-demand: the bound is its cost, less a unit
    on_demand = replay(trace, "always-on-demand", job)
    assert bound.met and on_demand.cost - 0.05 <= bound.cost <= on_demand.cost


def test_a_short_replay_of_a_real_trace():
    trace = next(t for t in load_traces(TRACES) if t.name.endswith("us-west-2a_v100_1"))
    job = Job(work_h=8.0, deadline_h=16.0)
    outcomes = {name: replay(trace, name, job, start=100, seed=1) for name in POLICIES}
    assert all(o.met for o in outcomes.values())
    assert all(o.work_lost_h == 0 for o in outcomes.values())  # notices: saved in time
    bound = lower_bound(trace, job, start=100, seed=1)
    assert bound.met and bound.saving >= max(o.saving for o in outcomes.values())


# ---------------------------------------------------------------- several regions


def two_zones(first: int = 20) -> Regions:
    """Zone a has a node for the first ``first`` ticks, zone b from then on."""
    a = synthetic([1] * first + [0] * (200 - first), name="synthetic/day/za_v100_1")
    b = synthetic([0] * first + [1] * (200 - first), name="synthetic/day/zb_v100_1")
    return Regions.of([a, b])


def test_a_notice_moves_an_any_region_bid_to_the_other_zone_at_the_migration_cost():
    market = two_zones()
    job = Job(work_h=6.0, deadline_h=30.0, migrate_h=0.5)
    moved = replay(market, "greedy-spot", job)
    # 20 ticks in a (3.33 h, less the 0.2 h start), noticed at tick 20 with zone b reserved,
    # resumed there at tick 21 after 0.2 + 0.5 h: done at 3.5 + 0.7 + (6 - 3.133) h
    assert moved.preemptions == 1 and moved.migrations == 1 and moved.on_demand_h == 0
    assert moved.finished_h == pytest.approx(3.5 + 0.7 + 6 - (20 / 6 - 0.2), abs=1e-6)
    free = replay(market, "greedy-spot", Job(work_h=6.0, deadline_h=30.0, migrate_h=0.0))
    assert free.finished_h == pytest.approx(moved.finished_h - 0.5, abs=1e-6)
    alone = replay(market.traces[0], "greedy-spot", job)  # zone a only: on-demand at the end
    assert alone.on_demand_h > 2.5 and alone.cost > moved.cost
    assert lower_bound(market, job).cost <= moved.cost


def test_a_bid_pinned_to_a_region_stays_there_and_views_show_every_region():
    market = two_zones()
    job = Job(work_h=6.0, deadline_h=30.0)
    views: list[JobView] = []

    def pinned(v: JobView) -> Action:
        views.append(v)
        return Action("on_demand") if must_finish_on_demand(v) else Action("spot", v.cap, "za")

    outcome = replay(market, pinned, job)
    assert outcome.met and outcome.migrations == 0 and outcome.on_demand_h > 2.5
    assert all(v.region in (None, "za") for v in views)
    assert [q.region for q in views[0].regions] == ["za", "zb"]
    assert views[0].regions[0].forecast is None and views[5].regions[0].forecast is not None
    assert views[5].region == "za" and views[5].migrate_h == job.migrate_h
    assert views[20].noticed is False and views[21].noticed is True  # reclaimed at tick 20
    assert views[21].region is None and views[21].checkpoint_region == "za"
    assert views[0].checkpoint_region is None and views[0].regions[1].free_nodes == 1
    assert not views[1].regions[1].open and views[25].regions[1].open  # zb's node from tick 20
    with pytest.raises(ValueError, match="choose one of za, zb or None"):
        replay(market, lambda v: Action("spot", 1.0, "elsewhere"), job)


def test_the_bound_sees_the_same_competing_demand_as_the_market():
    market = next(m for m in multi_zone_markets(load_traces(TRACES)) if len(m.traces) == 6)
    _, _, prices, _ = competing(market, BENCHMARK_JOB, start=500, seed=7)
    world = MarketReplay(market, start=500, seed=7)
    for step in range(40):
        world.advance(step)
        for r, demand in enumerate(world.demand):
            seen = sorted(demand.live.values(), reverse=True)
            assert list(prices[r, step, : len(seen)]) == seen and not prices[r, step, len(seen)]


# ---------------------------------------------------------------- the lower bound


def random_policy(seed: int):
    rng = random.Random(seed)

    def policy(v: JobView) -> Action:  # random modes, bids (some above the cap) and regions
        if must_finish_on_demand(v):
            return Action("on_demand")
        names = [None, *(q.region for q in v.regions)] if len(v.regions) > 1 else [None]
        x = rng.random()
        if x < 0.7:
            return Action("spot", round(rng.uniform(0.5, 1.6), 2), rng.choice(names))
        return Action("wait") if x < 0.9 else Action("on_demand")

    policy.__name__ = f"random-{seed}"
    return policy


def undercutter(seed: int):
    """Holding GPUs, bids just enough not to be outbid (the last clearing price less the
    hysteresis) and now and then 0.01, which the market applies to the interval just run."""
    rng = random.Random(seed)

    def policy(v: JobView) -> Action:
        if must_finish_on_demand(v):
            return Action("on_demand")
        if v.mode == "spot" and v.ran:
            here = next((q for q in v.regions if q.region == v.region), None)
            floor = here.floor if here is not None else v.spot_floor
            if rng.random() < 0.15:
                return Action("spot", 0.01, v.region)
            return Action("spot", max(0.9, min(v.cap, floor / 1.05 + 0.001)), v.region)
        return Action("spot", v.cap)

    policy.__name__ = f"undercutter-{seed}"
    return policy


def hopper(v: JobView) -> Action:
    """Changes region every seven steps (migrations), at the cap."""
    if must_finish_on_demand(v) or len(v.regions) < 2:
        return Action("on_demand") if must_finish_on_demand(v) else Action("spot", v.cap)
    return Action("spot", v.cap, v.regions[int(v.now_h / v.step_h) // 7 % len(v.regions)].region)


def low_bidder(v: JobView) -> Action:
    """Just above the owners' reserve: cheap when it runs, often outbid."""
    return Action("on_demand") if must_finish_on_demand(v) else Action("spot", 0.95)


ADVERSARIES = (random_policy(1), random_policy(2), undercutter(3), hopper, low_bidder)


def assert_never_beaten(bound, outcomes) -> None:
    for o in outcomes:
        if o.met:
            assert o.cost >= bound.cost - 1e-6, f"{o.policy} paid {o.cost:.4f} < {bound.cost:.4f}"


def middle_start(length: int, gap: float, job: Job) -> int:
    """The middle one of the benchmark's three start points."""
    return (length - int(job.deadline_h * 3600 / gap) - 2) // 2


ALL_TRACES = load_traces(TRACES)
MARKETS = multi_zone_markets(ALL_TRACES)
SHORT_TICKS = ("aws-04-22-2023/us-west-2b_v100_1", "aws-04-22-2023/v100_1")
"""Of the 32-34 s traces (5,400 ticks a job, the slow ones), the single- and the multi-region
market of 2023-04-22; every other trace and market is tested (benchmarks/replay.py checks
every job of every trace: ``bound_beaten_in_jobs``)."""
CHECKED = [
    w for w in (*ALL_TRACES, *MARKETS) if w.gap_seconds >= 60 or w.name.endswith(SHORT_TICKS)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "where", CHECKED, ids=[w.name if isinstance(w, Trace) else f"multi:{w.name}" for w in CHECKED]
)
def test_no_policy_ever_beats_the_lower_bound(where):
    """At the middle start of the benchmark's three, with the benchmark's job: the registered
    policies and five random or adversarial ones."""
    job = BENCHMARK_JOB
    length = len(where.available) if isinstance(where, Trace) else where.length
    start = middle_start(length, where.gap_seconds, job)
    bound = lower_bound(where, job, start, seed=start)
    outcomes = [replay(where, p, job, start, seed=start) for p in (*POLICIES, *ADVERSARIES)]
    assert bound.met and sum(o.met for o in outcomes) >= len(POLICIES)
    assert_never_beaten(bound, outcomes)


def test_the_check_fails_for_the_old_omniscient_optimum():
    """The previous "omniscient optimum" (a schedule against the job-less market) is beaten by
    greedy-spot on aws-04-22-2023/us-west-2b from 64.7 h: the same check rejects it, while
    the lower bound passes."""
    trace = next(t for t in ALL_TRACES if t.name.endswith("aws-04-22-2023/us-west-2b_v100_1"))
    start = 7279  # 64.7 h: the second of the benchmark's three start points
    greedy = replay(trace, "greedy-spot", BENCHMARK_JOB, start, seed=start)
    old = hindsight_schedule(trace, BENCHMARK_JOB, start, seed=start)
    assert greedy.met and greedy.cost < old.cost - 1.0
    with pytest.raises(AssertionError, match="greedy-spot paid"):
        assert_never_beaten(old, [greedy])
    assert_never_beaten(lower_bound(trace, BENCHMARK_JOB, start, seed=start), [greedy])


@pytest.mark.slow
def test_the_replay_benchmark_prints_one_json_object():
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "replay.py"), "--starts", "1",
         "--work", "4", "--deadline", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    policies = [p for p in POLICIES if p != "always-on-demand"]
    for config, table in report["tables"].items():
        assert set(table) == {*policies, "lower-bound", "physical-limit"}, config
        jobs = table["greedy-spot"]["jobs"]
        assert jobs >= (20 if config == "single_region" else 8)  # every trace, every market
        for name in (*policies, "lower-bound"):
            assert table[name]["deadlines_met"] == jobs, (config, name)
            assert table[name]["mean_saving"] <= table["lower-bound"]["mean_saving"] + 1e-9
    assert report["bound_beaten_in_jobs"] == {"single_region": 0, "multi_region": 0}
    assert set(report["targets"]) >= {"multi_region_ours_vs_bound", "deadlines_met_by_ours"}
    assert report["assumptions"]["restart_overhead_h"] == 0.2
    measured = report["measured_restart"]  # ours and the bound with the measured restart
    assert 0 < measured["restart_overhead_s"] < 60
    for config in ("single_region", "multi_region"):
        bound = measured[config]["lower-bound"]  # less lost at each start: never a worse optimum
        assert bound["mean_saving"] >= report["tables"][config]["lower-bound"]["mean_saving"]
        ours = measured[config][report["ours"]]
        assert 0 < ours["mean_saving"] <= bound["mean_saving"] + 1e-9
        met, jobs = ours["deadlines_met"].split("/")
        assert met == jobs, config


def test_with_no_competing_demand_every_spot_hour_costs_the_reserve():
    """``Demand.share`` 0 (the decomposition benchmark's seam): no competing bid ever arrives,
    so the job pays the owners' reserve for each spot hour, in the replay and in the bound."""
    from prefect_spotgpu.economics.replay import ON_DEMAND, RESERVE, Demand

    market = next(m for m in MARKETS if m.name.endswith("aws-10-26-2022/v100_1"))
    job = Job(work_h=6.0, deadline_h=12.0)
    with_demand = replay(market, "greedy-spot", job, start=100, seed=100)
    Demand.share = 0.0
    try:
        alone = replay(market, "greedy-spot", job, start=100, seed=100)
        bound = lower_bound(market, job, start=100, seed=100)
    finally:
        Demand.share = 1.0
    assert alone.spot_h > 0 and alone.met
    paid_for_spot = alone.cost - alone.on_demand_h * ON_DEMAND * market.gpus_per_node
    assert paid_for_spot == pytest.approx(alone.spot_h * RESERVE * market.gpus_per_node, rel=1e-3)
    assert bound.cost <= alone.cost + 1e-6
    assert with_demand.cost > alone.cost  # the demand the benchmark has does cost something


@pytest.mark.slow
def test_the_decomposition_benchmark_prints_one_json_object():
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "replay_decomposition.py"),
         "--markets", "1", "--starts", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    worlds = report["mean_saving"]
    assert len(worlds) == 6
    for name, row in worlds.items():
        assert row["deadlines_missed"] == 0, name
        for policy in ("greedy-spot", "deadline-aware"):
            assert row[policy] <= row["lower-bound"] + 1e-9, (name, policy)
    easiest = worlds["no demand, no overheads"]["bound_lead_over_ours_points"]
    benchmark = next(v for k, v in worlds.items() if k.endswith("(the benchmark)"))
    assert easiest < benchmark["bound_lead_over_ours_points"]
