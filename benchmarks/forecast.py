"""How well the hour-of-week forecast predicts the clearing price; one JSON object.

    python benchmarks/forecast.py [--holdout-days 7]

Price history comes from the real market replaying the long (45-day) availability traces of
benchmarks/traces with the competing demand of ``prefect_spotgpu.economics.replay``
(a daily cycle). The
forecast learns on all but the last ``--holdout-days`` and is scored on them, side by side with
the naive forecast (the last price, held flat) and the unweighted profile (no recency).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from prefect_spotgpu.economics.replay import MarketReplay, load_traces, prospect
from prefect_spotgpu.market.forecast import holdout_error

TRACES = Path(__file__).resolve().parent / "traces"


def clearing_history(trace, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Hourly mean clearing price of the trace's pool under the replay's competing demand."""
    pool = MarketReplay(trace, seed=seed)
    times, prices = [], []
    for step in range(len(trace.available)):
        now = pool.advance(step)
        times.append(now)
        prices.append(prospect(pool.market.tick(now), cap=0.0)[1])  # the clearing price
    hours = (np.asarray(times) // 3600).astype(np.int64)
    order = np.unique(hours, return_inverse=True)
    means = np.bincount(order[1], weights=np.asarray(prices)) / np.bincount(order[1])
    return order[0] * 3600.0, means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holdout-days", type=float, default=7.0)
    args = parser.parse_args()
    rows = []
    for trace in load_traces(TRACES):
        if trace.hours < 24 * 21:  # three weeks at least: two to learn, one to score
            continue
        times, prices = clearing_history(trace)
        ours = holdout_error(times, prices, args.holdout_days)
        flat = holdout_error(times, prices, args.holdout_days, half_life_days=1e9)
        rows.append(
            {
                "trace": trace.name,
                "history_days": round(trace.hours / 24, 1),
                "mean_price": round(float(prices.mean()), 4),
                "recency_weighted": ours,
                "unweighted": {k: flat[k] for k in ("mae", "mape")},
            }
        )
    summary = {
        "traces": len(rows),
        "mae": round(statistics.mean(r["recency_weighted"]["mae"] for r in rows), 4),
        "mape": round(statistics.mean(r["recency_weighted"]["mape"] for r in rows), 4),
        "naive_mae": round(statistics.mean(r["recency_weighted"]["naive_mae"] for r in rows), 4),
        "unweighted_mae": round(statistics.mean(r["unweighted"]["mae"] for r in rows), 4),
        "band_80_coverage": round(
            statistics.mean(r["recency_weighted"]["band_coverage"] for r in rows), 4
        ),
    }
    summary["mae_vs_naive"] = round(summary["mae"] / summary["naive_mae"], 3)
    print(json.dumps({"benchmark": "forecast", "holdout_days": args.holdout_days,
                      "summary": summary, "traces": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
