"""Where the lower bound's lead over the policies comes from; one JSON object.

    python benchmarks/replay_decomposition.py [--traces DIR] [--starts 3] [--markets N]

The multi-region jobs of ``benchmarks/replay.py`` (the same markets, start points, job and
seeds) under greedy-spot and ours (deadline-aware), next to the lower bound
(``prefect_spotgpu.economics.bound``), in six worlds that take away, one at a time, what the
bound knows ahead and a policy cannot: the competing demand (``Demand.share`` 0: every hour at
the owners' reserve, any live node free) and the cost of a start (restart and migration
overheads 0). Where a world has neither, the bound's conditions are close to sufficient and
what is left of its lead is small: the rest of the lead in the benchmark's world is what
foresight of short spells and of demand is worth, plus the bound's relaxations (its docstring).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from prefect_spotgpu.economics.bound import lower_bound
from prefect_spotgpu.economics.regions import multi_zone_markets
from prefect_spotgpu.economics.replay import Demand, Job, load_traces, replay
from replay import DEFAULT_TRACES, starts_of

POLICIES = ("greedy-spot", "deadline-aware")
WORLDS = (  # (name, competing demand share, restart h, migration h)
    ("no demand, no overheads", 0.0, 0.0, 0.0),
    ("no demand, restarts 0.2 h", 0.0, 0.2, 0.0),
    ("no demand, restarts 0.2 h, migrations 0.5 h", 0.0, 0.2, 0.5),
    ("demand, no overheads", 1.0, 0.0, 0.0),
    ("demand, restarts 0.2 h", 1.0, 0.2, 0.0),
    ("demand, restarts 0.2 h, migrations 0.5 h (the benchmark)", 1.0, 0.2, 0.5),
)


def world(markets, starts: int, share: float, restart: float, migrate: float) -> dict:
    job = Job(restart_h=restart, migrate_h=migrate)
    savings: dict[str, list[float]] = {name: [] for name in (*POLICIES, "lower-bound")}
    missed = 0
    Demand.share = share
    try:
        for market in markets:
            for start in starts_of(market.length, market.gap_seconds, job, starts):
                for name in POLICIES:
                    outcome = replay(market, name, job, start, seed=start)
                    missed += not outcome.met
                    savings[name].append(outcome.saving)
                savings["lower-bound"].append(lower_bound(market, job, start, seed=start).saving)
    finally:
        Demand.share = 1.0
    means = {name: round(statistics.mean(s), 4) for name, s in savings.items()}
    lead = means["lower-bound"] - means["deadline-aware"]
    return means | {"bound_lead_over_ours_points": round(100 * lead, 2), "deadlines_missed": missed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--markets", type=int, default=None, help="the first N markets only")
    args = parser.parse_args()
    markets = multi_zone_markets(load_traces(args.traces))[: args.markets]
    if not markets:
        sys.exit(f"no multi-zone market under {args.traces}")
    started = time.perf_counter()
    worlds = {}
    for name, share, restart, migrate in WORLDS:
        worlds[name] = world(markets, args.starts, share, restart, migrate)
        print(f"{name}: {worlds[name]}", file=sys.stderr)
    report = {
        "benchmark": "replay_decomposition",
        "markets": [m.name for m in markets],
        "starts": args.starts,
        "mean_saving": worlds,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
