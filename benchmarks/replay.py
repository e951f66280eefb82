"""Deadline-bound jobs on replayed spot availability, per bidding policy; one JSON object.

    python benchmarks/replay.py [--traces ../shared/traces] [--starts 3] [--work 24 --deadline 48]

Each trace of ../shared/traces becomes the idle supply of one A100-80G pool of the real market
(prefect_spotgpu.economics.replay); competing demand follows a daily cycle. From ``--starts`` start
points spread over each trace, one job (``--work`` GPU-hours per GPU of its node, finish within
``--deadline`` hours, spot cap 1.40 per GPU-hour, restart overhead ``--restart`` hours) runs
under each policy: always-on-demand, greedy-spot, uniform-progress (ours), and the omniscient
optimum computed from the known future. Saving is against running the job on on-demand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from prefect_spotgpu.economics.replay import MODEL, RESERVE, Job, load_traces, optimum, replay
from prefect_spotgpu.market import DEFAULT_CATALOG

POLICIES = ("always-on-demand", "greedy-spot", "uniform-progress")
DEFAULT_TRACES = Path(__file__).resolve().parent / "traces"  # a copy of ../shared/traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--work", type=float, default=24.0)
    parser.add_argument("--deadline", type=float, default=48.0)
    parser.add_argument("--restart", type=float, default=0.2)
    parser.add_argument("--cap", type=float, default=1.40)
    args = parser.parse_args()
    job = Job(args.work, args.deadline, args.cap, args.restart)
    traces = load_traces(args.traces)
    if not traces:
        sys.exit(f"no traces under {args.traces}")
    started = time.perf_counter()
    rows = []
    for trace in traces:
        span = int(job.deadline_h * 3600 / trace.gap_seconds) + 2
        if span >= len(trace.available):
            continue
        for start in np.linspace(0, len(trace.available) - span, args.starts).astype(int):
            row = {"trace": trace.name, "start_h": round(start * trace.gap_seconds / 3600, 1)}
            for name in POLICIES:
                row[name] = replay(trace, name, job, int(start), seed=int(start)).summary()
            row["omniscient-optimum"] = optimum(trace, job, int(start), seed=int(start)).summary()
            rows.append(row)
        print(f"{trace.name}: done", file=sys.stderr)
    summary = {}
    for name in (*POLICIES, "omniscient-optimum"):
        results = [r[name] for r in rows]
        summary[name] = {
            "mean_saving": round(statistics.mean(r["saving"] for r in results), 4),
            "median_saving": round(statistics.median(r["saving"] for r in results), 4),
            "deadlines_met": sum(r["deadline_met"] for r in results),
            "jobs": len(results),
            "mean_preemptions": round(statistics.mean(r["preemptions"] for r in results), 2),
            "work_lost_h": round(sum(r["work_lost_h"] for r in results), 3),
        }
    od = DEFAULT_CATALOG.get(MODEL).on_demand_price
    ours = summary["uniform-progress"]
    print(
        json.dumps(
            {
                "benchmark": "replay",
                "assumptions": {
                    "pool": f"{MODEL} (on-demand {od:.2f}, owners' reserve {RESERVE:.2f})",
                    "max_possible_saving": round(1 - RESERVE / od, 4),
                    "job": vars(args) | {"traces": str(args.traces)},
                    "restart_overhead_h": job.restart_h,
                    "notice": "300 s; the final save fits in it, so a reclaim loses no work",
                    "competing_demand": "daily cycle, busy 09-21h; max prices uniform "
                    f"{RESERVE:.2f}..{0.7 * od:.2f}",
                },
                "summary": summary,
                "target": "mean saving >= 0.60 with every deadline met",
                "target_met": ours["mean_saving"] >= 0.6 and ours["deadlines_met"] == ours["jobs"],
                "seconds": round(time.perf_counter() - started, 1),
                "jobs": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
