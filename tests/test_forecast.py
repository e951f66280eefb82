"""Price history and forecast: hourly bars, the hour-of-week profile, its held-back error, and
the cost estimator on a known history."""

from __future__ import annotations

import numpy as np
import pytest

from prefect_spotgpu.market.forecast import (
    HourOfWeekForecast,
    estimate,
    holdout_error,
    hour_of_week,
    hourly_bars,
)

MONDAY = 4 * 86400.0  # 1970-01-05, a Monday, 00:00 UTC


def test_hour_of_week_starts_on_monday():
    assert hour_of_week(np.array([MONDAY, MONDAY + 3600 * 25, MONDAY - 3600]))[0] == 0
    assert list(hour_of_week(np.array([MONDAY + 3600 * 25, MONDAY - 3600]))) == [25, 167]


def test_hourly_bars_aggregate_minutes():
    minutes = np.array([60, 61, 119, 120, 179])  # hour 1: three bars, hour 2: two
    bars = hourly_bars(
        minutes,
        open_=[1.0, 2.0, 3.0, 4.0, 5.0],
        high=[1.5, 2.5, 9.0, 4.5, 5.5],
        low=[0.5, 1.5, 2.5, 0.1, 4.5],
        close=[1.2, 2.2, 3.3, 4.4, 5.5],
    )
    assert list(bars["hour"]) == [1, 2]
    assert list(bars["open"]) == [1.0, 4.0] and list(bars["close"]) == [3.3, 5.5]
    assert list(bars["high"]) == [9.0, 5.5] and list(bars["low"]) == [0.5, 0.1]
    assert len(hourly_bars(np.array([]), [], [], [], [])["hour"]) == 0


def weekly_history(weeks: int, seed: int = 0, shift_last_days: float = 0.0, shift: float = 0.0):
    rng = np.random.default_rng(seed)
    t = MONDAY + np.arange(weeks * 168) * 3600.0
    hour = (t // 3600) % 24
    weekend = ((t - MONDAY) // 86400) % 7 >= 5
    cheap = (hour < 9) | (hour >= 18) | weekend
    price = np.where(cheap, 0.95, 1.45) + rng.normal(0, 0.05, len(t))
    price[t > t.max() - shift_last_days * 86400] += shift
    return t, price


def test_the_forecast_beats_the_naive_one_on_held_back_days():
    t, price = weekly_history(6, shift_last_days=14, shift=0.1)
    error = holdout_error(t, price, holdout_days=7)
    assert error["holdout_hours"] == 168
    assert error["mae"] < 0.08 and error["mae"] < error["naive_mae"] / 2
    assert 0.6 <= error["band_coverage"] <= 1.0


def test_recent_weeks_weigh_more():
    t, price = weekly_history(8, shift_last_days=14, shift=0.2)
    recent = HourOfWeekForecast.fit(t, price, half_life_days=7)
    flat = HourOfWeekForecast.fit(t, price, half_life_days=1e9)
    noon = np.array([MONDAY + 12 * 3600.0])
    assert recent.predict(noon)[0][0] > flat.predict(noon)[0][0] + 0.05
    assert abs(recent.predict(noon)[0][0] - 1.65) < 0.05


def test_the_estimator_on_a_known_history():
    t = MONDAY + np.arange(4 * 168) * 3600.0
    hour = (t // 3600) % 24
    forecast = HourOfWeekForecast.fit(t, np.where((hour < 9) | (hour >= 18), 0.9, 1.5))
    start = MONDAY + 4 * 7 * 86400  # a later Monday 00:00
    # 10 GPU-hours by Monday midnight: the night hours 00-09 and 18-24 suffice
    e = estimate(forecast, 10, cap=1.2, start=start, deadline=start + 86400, on_demand_price=2.1)
    assert e.expected_cost == pytest.approx(9.0) and e.p_meet_deadline == pytest.approx(1.0)
    assert e.expected_finish == start + 19 * 3600  # 9 night hours, then 18:00-19:00
    assert e.saving == pytest.approx(1 - 9 / 21, abs=1e-4) and e.fallback_gpu_hours == 0
    # by noon only 9 cheap hours exist: one hour on-demand, and spot alone cannot make it
    e = estimate(forecast, 10, cap=1.2, start=start, deadline=start + 12 * 3600,
                 on_demand_price=2.1)  # fmt: skip
    assert e.expected_cost == pytest.approx(9 * 0.9 + 2.1)
    assert e.fallback_gpu_hours == pytest.approx(1.0) and e.p_meet_deadline < 0.01
    assert e.expected_finish is None
    # two GPUs: half the hours, twice the GPUs
    e = estimate(forecast, 10, cap=1.2, start=start, deadline=start + 86400,
                 on_demand_price=2.1, gpus=2)  # fmt: skip
    assert e.expected_finish == start + 5 * 3600 and e.expected_cost == pytest.approx(9.0)
    with pytest.raises(ValueError, match="deadline after the start"):
        estimate(forecast, 10, 1.2, start, start, 2.1)


@pytest.mark.slow
def test_the_forecast_benchmark_scores_against_the_naive_forecast():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "forecast.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)["summary"]
    assert summary["traces"] >= 10
    assert summary["mae"] < summary["naive_mae"]  # better than "the price stays the same"
    assert 0.6 <= summary["band_80_coverage"] <= 0.95
