"""Deadline-bound jobs on replayed spot availability, single- and multi-region; one JSON object.

    python benchmarks/replay.py [--traces DIR] [--starts 3] [--work 24 --deadline 48]
                                [--restart 0.2] [--migrate 0.5] [--cap 1.40]

Single-region: each trace of benchmarks/traces (a copy of ../shared/traces) is the idle supply of
one A100-80G pool of the real market (prefect_spotgpu.economics.replay). Multi-region: the zones
of one date and instance type are the regions of one market (one pool per zone, truncated to the
shortest), and the job bids region "any" unless its policy names one. Competing demand follows a
daily cycle, per region, seeded and independent. From ``--starts`` start points spread over each
market, one job (``--work`` hours on one node, finish within ``--deadline`` hours, spot cap
``--cap`` per GPU-hour, ``--restart`` hours lost at every start, ``--migrate`` more at a spot start
away from its checkpoint's region) runs under every registered policy but always-on-demand (the
baseline every saving is measured against), next to the lower bound
(prefect_spotgpu.economics.bound: what no policy can beat in this simulator) and the physical limit
(every hour at the owners' reserve). "ours" is the policy named deadline-aware when one is
registered (uniform-progress otherwise). The multi-zone comparison runs ours single-region in each
zone of every multi-region job, same start, same demand, and compares the mean savings.

Then ours and the bound again, with the restart overhead measured rather than assumed: the
seconds from a reclaimed job's stop to Running on its warm replacement
(``--measured-restart-seconds``, by default read from benchmarks/results/recovery.json), the
migration overhead unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from prefect_spotgpu.economics.bound import lower_bound
from prefect_spotgpu.economics.policies import POLICIES as REGISTERED
from prefect_spotgpu.economics.regions import multi_zone_markets, region_seed
from prefect_spotgpu.economics.replay import (
    MODEL,
    ON_DEMAND,
    RESERVE,
    Job,
    load_traces,
    replay,
)

DEFAULT_TRACES = Path(__file__).resolve().parent / "traces"  # a copy of ../shared/traces
RECOVERY = Path(__file__).resolve().parent / "results" / "recovery.json"


def measured_restart_seconds() -> tuple[float, str]:
    """A warm resume's stop -> Running (the shortest set-up's median), and where it is from."""
    try:
        warm = json.loads(RECOVERY.read_text())["startup_cold_vs_warm"]["warm"]
    except (OSError, KeyError, ValueError):
        return 2.0, "assumed 2 s (no benchmarks/results/recovery.json with a warm figure)"
    first = min(warm, key=lambda setup: float(setup.rstrip("s")))
    return warm[first]["reclaim_to_running_minus_durable_s"], f"{RECOVERY.name}, warm, {first}"


BOUND = "lower-bound"


def starts_of(length: int, gap: float, job: Job, count: int) -> list[int]:
    span = int(job.deadline_h * 3600 / gap) + 2
    if span >= length:
        return []
    return [int(s) for s in np.linspace(0, length - span, count).astype(int)]


def run_job(where, policies: list[str], job: Job, start: int) -> dict:
    row = {name: replay(where, name, job, start, seed=start).summary() for name in policies}
    row[BOUND] = lower_bound(where, job, start, seed=start).summary()
    return row


def summarise(rows: list[dict], names: list[str]) -> dict:
    summary = {}
    for name in names:
        results = [r[name] for r in rows]
        summary[name] = {
            "mean_saving": round(statistics.mean(r["saving"] for r in results), 4),
            "median_saving": round(statistics.median(r["saving"] for r in results), 4),
            "deadlines_met": sum(r["deadline_met"] for r in results),
            "jobs": len(results),
        }
        if name != BOUND:  # a bound has no runs to count
            summary[name] |= {
                "mean_preemptions": round(statistics.mean(r["preemptions"] for r in results), 2),
                "mean_migrations": round(statistics.mean(r["migrations"] for r in results), 2),
            }
    return summary


def beaten(rows: list[dict], policies: list[str]) -> int:
    """Jobs where a policy that met the deadline paid less than the bound (must be 0)."""
    return sum(
        any(r[p]["deadline_met"] and r[p]["cost"] < r[BOUND]["cost"] - 1e-4 for p in policies)
        for r in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--work", type=float, default=24.0)
    parser.add_argument("--deadline", type=float, default=48.0)
    parser.add_argument("--restart", type=float, default=0.2)
    parser.add_argument("--migrate", type=float, default=0.5)
    parser.add_argument("--cap", type=float, default=1.40)
    parser.add_argument("--measured-restart-seconds", type=float, default=None)
    args = parser.parse_args()
    job = Job(args.work, args.deadline, args.cap, args.restart, args.migrate)
    traces = load_traces(args.traces)
    if not traces:
        sys.exit(f"no traces under {args.traces}")
    policies = [name for name in REGISTERED if name != "always-on-demand"]
    ours = "deadline-aware" if "deadline-aware" in policies else "uniform-progress"
    started = time.perf_counter()
    single = []
    for trace in traces:
        for start in starts_of(len(trace.available), trace.gap_seconds, job, args.starts):
            row = {"trace": trace.name, "start_h": round(start * trace.gap_seconds / 3600, 1)}
            single.append(row | run_job(trace, policies, job, start))
        print(f"{trace.name}: done", file=sys.stderr)
    multi = []
    for market in multi_zone_markets(traces):
        for start in starts_of(market.length, market.gap_seconds, job, args.starts):
            row = {"market": market.name, "zones": list(market.names),
                   "start_h": round(start * market.gap_seconds / 3600, 1)}  # fmt: skip
            row |= run_job(market, policies, job, start)
            alone = [  # ours in each zone alone: the same start and the same demand
                replay(zone, ours, job, start, seed=region_seed(start, i)).saving
                for i, zone in enumerate(market.traces)
            ]
            row["single_region_ours_saving"] = round(statistics.mean(alone), 4)
            multi.append(row)
        print(f"{market.name} ({len(market.traces)} zones): done", file=sys.stderr)
    measured, source = (
        (args.measured_restart_seconds, "--measured-restart-seconds")
        if args.measured_restart_seconds is not None
        else measured_restart_seconds()
    )
    warm_job = Job(args.work, args.deadline, args.cap, measured / 3600, args.migrate)
    rows = {
        "single_region": [
            run_job(t, [ours], warm_job, start)
            for t in traces
            for start in starts_of(len(t.available), t.gap_seconds, warm_job, args.starts)
        ],
        "multi_region": [
            run_job(mk, [ours], warm_job, start)
            for mk in multi_zone_markets(traces)
            for start in starts_of(mk.length, mk.gap_seconds, warm_job, args.starts)
        ],
    }
    names = [*policies, BOUND]
    tables = {"single_region": summarise(single, names), "multi_region": summarise(multi, names)}
    limit = round(1 - RESERVE / ON_DEMAND, 4)
    for table in tables.values():
        table["physical-limit"] = {"mean_saving": limit}
    m = tables["multi_region"]
    multi_ours = statistics.mean(r[ours]["saving"] for r in multi)
    single_ours = statistics.mean(r["single_region_ours_saving"] for r in multi)
    ratio = m[ours]["mean_saving"] / m[BOUND]["mean_saving"]
    over_greedy = m[ours]["mean_saving"] - m["greedy-spot"]["mean_saving"]
    deadlines = {
        config: {p: f"{t[p]['deadlines_met']}/{t[p]['jobs']}" for p in policies}
        for config, t in tables.items()
    }
    targets = {
        "multi_region_ours_vs_bound": {"ratio": round(ratio, 4), "target": ">= 0.90",
                                       "met": ratio >= 0.90},
        "multi_region_ours_over_greedy_points": {"points": round(100 * over_greedy, 2),
                                                 "target": ">= 5", "met": over_greedy >= 0.05},
        "multi_zone_dates_multi_over_single_points": {
            "multi_region_ours": round(multi_ours, 4), "single_region_ours": round(single_ours, 4),
            "points": round(100 * (multi_ours - single_ours), 2), "target": ">= 10",
            "met": multi_ours - single_ours >= 0.10,
        },
        "deadlines_met_by_ours": {
            "met": all(t[ours]["deadlines_met"] == t[ours]["jobs"] for t in tables.values()),
            "target": "every job, every configuration",
        },
    }  # fmt: skip
    measured_row = {
        "restart_overhead_s": measured,
        "source": source,
        **{
            config: {
                name: {
                    "mean_saving": summary[name]["mean_saving"],
                    "points_over_assumed_restart": round(
                        100 * (summary[name]["mean_saving"] - tables[config][name]["mean_saving"]),
                        2,
                    ),
                    "deadlines_met": f"{summary[name]['deadlines_met']}/{summary[name]['jobs']}",
                }
                for name in (ours, BOUND)
            }
            for config, summary in (
                (config, summarise(r, [ours, BOUND])) for config, r in rows.items()
            )
        },
    }
    report = {
        "benchmark": "replay",
        "ours": ours,
        "assumptions": {
            "pool": f"{MODEL} (on-demand {ON_DEMAND:.2f}, owners' reserve {RESERVE:.2f})",
            "max_possible_saving": limit,
            "job": vars(args) | {"traces": str(args.traces)},
            "restart_overhead_h": job.restart_h,
            "migration_overhead_h": job.migrate_h,
            "notice": "300 s; the final save fits in it, so a reclaim loses no work",
            "competing_demand": "per region, daily cycle, busy 09-21h; max prices uniform "
            f"{RESERVE:.2f}..{0.7 * ON_DEMAND:.2f}",
            "multi_region_markets": [
                {
                    "market": mk.name,
                    "zones": list(mk.names),
                    "hours": round(mk.length * mk.gap_seconds / 3600, 1),
                }
                for mk in multi_zone_markets(traces)
            ],
        },
        "tables": tables,
        "measured_restart": measured_row,
        "deadlines": deadlines,
        "bound_beaten_in_jobs": {
            "single_region": beaten(single, policies),
            "multi_region": beaten(multi, policies),
        },
        "targets": targets,
        "targets_met": all(t["met"] for t in targets.values()),
        "seconds": round(time.perf_counter() - started, 1),
        "single_region_jobs": single,
        "multi_region_jobs": multi,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
