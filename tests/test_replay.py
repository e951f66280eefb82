"""Deadline-aware bidding: policy decisions on tabled cases, and short replays of real and
synthetic availability through the real market."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prefect_spotgpu.economics.deadline import Action, JobView, get_policy
from prefect_spotgpu.economics.replay import Job, Trace, load_traces, optimum, replay

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"


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
    ],
)
def test_policy_decisions(name, situation, expected):
    if name == "greedy-spot" and situation.get("now_h") == 9.4:
        situation = {**situation, "done_h": 0.7}  # slack 1.3: still spot
    assert get_policy(name)(view(**situation)) == expected


def test_unknown_policies_are_named():
    with pytest.raises(ValueError, match="choose one of always-on-demand, greedy-spot"):
        get_policy("yolo")


def synthetic(available, gap=600.0) -> Trace:
    return Trace("synthetic", gap, np.asarray(available, dtype=np.int64), 1)


def test_always_available_spot_is_bought_at_market_prices():
    trace = synthetic([1] * 200)
    job = Job(work_h=6.0, deadline_h=12.0, cap=1.4, restart_h=0.2)
    greedy = replay(trace, "greedy-spot", job)
    assert greedy.met and greedy.on_demand_h == 0 and greedy.spot_h >= 6.0
    assert 0.3 < greedy.saving < 1 - 0.9 / 2.1 + 1e-9  # never below the owners' reserve
    on_demand = replay(trace, "always-on-demand", job)
    assert on_demand.met and abs(on_demand.saving) < 1e-9 and on_demand.spot_h == 0


def test_no_spot_at_all_still_meets_the_deadline_on_demand():
    trace = synthetic([0] * 200)
    job = Job(work_h=6.0, deadline_h=12.0)
    for name in ("greedy-spot", "uniform-progress"):
        outcome = replay(trace, name, job)
        assert outcome.met, name
        assert outcome.spot_h == 0 and outcome.on_demand_h >= 6.0
    assert optimum(trace, job).met


def test_a_short_replay_of_a_real_trace():
    trace = next(t for t in load_traces(TRACES) if t.name.endswith("us-west-2a_v100_1"))
    job = Job(work_h=8.0, deadline_h=16.0)
    outcomes = {name: replay(trace, name, job, start=100, seed=1)
                for name in ("always-on-demand", "greedy-spot", "uniform-progress")}  # fmt: skip
    assert all(o.met for o in outcomes.values())
    assert all(o.work_lost_h == 0 for o in outcomes.values())  # notices: saved in time
    best = optimum(trace, job, start=100, seed=1)
    assert best.met
    assert best.saving >= outcomes["always-on-demand"].saving
    assert best.saving >= max(o.saving for o in outcomes.values()) - 0.05


@pytest.mark.slow
def test_the_replay_benchmark_prints_one_json_object():
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "replay.py"),
            "--starts",
            "1",
            "--work",
            "4",
            "--deadline",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    summary = report["summary"]
    assert set(summary) == {
        "always-on-demand", "greedy-spot", "uniform-progress", "omniscient-optimum",
    }  # fmt: skip
    jobs = summary["greedy-spot"]["jobs"]
    assert jobs >= 20  # every shared trace
    for name, figures in summary.items():
        assert figures["deadlines_met"] == jobs, name
    assert abs(summary["always-on-demand"]["mean_saving"]) < 1e-6
    assert report["assumptions"]["restart_overhead_h"] == 0.2
