"""Price history and forecast: hourly bars, an hour-of-week profile, and a cost estimator.

Pure: arrays and timestamps in (UNIX seconds, UTC), results out.

- :func:`hourly_bars` turns minute bars (the service's ``price_bars``) into hourly OHLC.
- :class:`HourOfWeekForecast` learns a pool's clearing price for each of the 168 hours of the
  week, weighting recent weeks more (an exponential half-life); its band is the weighted
  spread. :func:`holdout_error` measures it on held-back history against the naive forecast
  "the price stays what it was".
- :func:`estimate` answers "N GPU-hours of this model, cap P, start after S, finish by D":
  expected cost, expected finish, the probability of meeting D, and the saving against
  on-demand. Each hour spot is usable with the forecast's probability that the price is at or
  below the cap; hours are taken as independent, and whatever spot cannot cover by D is bought
  on-demand (the fallback).

    >>> import numpy as np
    >>> t = np.arange(0, 28 * 24) * 3600.0            # four weeks, hourly
    >>> night = ((t // 3600) % 24 < 9) | ((t // 3600) % 24 >= 18)
    >>> prices = np.where(night, 0.9, 1.5)
    >>> f = HourOfWeekForecast.fit(t, prices)
    >>> expected, low, high = f.predict(np.array([2 * 3600.0, 12 * 3600.0]))  # 02:00, 12:00
    >>> [round(float(x), 2) for x in expected]
    [0.9, 1.5]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HOURS_PER_WEEK = 168
EPOCH_MONDAY = 3 * 24 * 3600  # 1970-01-01 was a Thursday: +3 days puts Monday 00:00 UTC at 0


def hour_of_week(times: np.ndarray) -> np.ndarray:
    """Slot 0..167 of each UNIX time (Monday 00:00 UTC is slot 0)."""
    return (((np.asarray(times, dtype=np.float64) + EPOCH_MONDAY) // 3600) % HOURS_PER_WEEK).astype(
        np.int64
    )


def hourly_bars(minutes: np.ndarray, open_, high, low, close) -> dict[str, np.ndarray]:
    """Minute bars (``minute`` = UNIX seconds // 60, sorted) as hourly OHLC bars."""
    minutes = np.asarray(minutes, dtype=np.int64)
    if len(minutes) == 0:
        empty = np.zeros(0)
        return {"hour": np.zeros(0, np.int64), "open": empty, "high": empty, "low": empty,
                "close": empty}  # fmt: skip
    hours = minutes // 60
    starts = np.flatnonzero(np.r_[True, hours[1:] != hours[:-1]])
    ends = np.r_[starts[1:], len(hours)] - 1
    return {
        "hour": hours[starts],  # UNIX seconds // 3600
        "open": np.asarray(open_, dtype=np.float64)[starts],
        "high": np.maximum.reduceat(np.asarray(high, dtype=np.float64), starts),
        "low": np.minimum.reduceat(np.asarray(low, dtype=np.float64), starts),
        "close": np.asarray(close, dtype=np.float64)[ends],
    }


@dataclass(frozen=True)
class HourOfWeekForecast:
    """A clearing-price profile by hour of week; ``mean`` and ``spread`` per slot."""

    mean: np.ndarray  # (168,)
    spread: np.ndarray  # (168,) weighted standard deviation
    weight: np.ndarray  # (168,) total weight seen (0: the slot fell back to the overall mean)

    @classmethod
    def fit(
        cls, times: np.ndarray, prices: np.ndarray, half_life_days: float = 14.0
    ) -> HourOfWeekForecast:
        times = np.asarray(times, dtype=np.float64)
        prices = np.asarray(prices, dtype=np.float64)
        if len(times) == 0:
            raise ValueError("no price history to learn from")
        age_days = (times.max() - times) / 86400
        w = 0.5 ** (age_days / half_life_days)
        slot = hour_of_week(times)
        weight = np.bincount(slot, weights=w, minlength=HOURS_PER_WEEK)
        total = np.bincount(slot, weights=w * prices, minlength=HOURS_PER_WEEK)
        overall = float((w * prices).sum() / w.sum())
        mean = np.where(weight > 0, total / np.maximum(weight, 1e-12), overall)
        sq = np.bincount(slot, weights=w * (prices - mean[slot]) ** 2, minlength=HOURS_PER_WEEK)
        overall_spread = float(np.sqrt((w * (prices - overall) ** 2).sum() / w.sum()))
        spread = np.where(weight > 0, np.sqrt(sq / np.maximum(weight, 1e-12)), overall_spread)
        return cls(mean, spread, weight)

    def predict(self, times: np.ndarray, z: float = 1.2816) -> tuple[np.ndarray, ...]:
        """Expected price at ``times`` and an (80 % by default) band around it."""
        slot = hour_of_week(times)
        mean, spread = self.mean[slot], self.spread[slot]
        return mean, mean - z * spread, mean + z * spread

    def p_at_most(self, times: np.ndarray, price: float) -> np.ndarray:
        """Probability that the clearing price is at most ``price`` (normal per slot)."""
        slot = hour_of_week(times)
        mean, spread = self.mean[slot], np.maximum(self.spread[slot], 1e-6)
        z = (price - mean) / (spread * math.sqrt(2))
        return 0.5 * (1 + _erf(z))


def holdout_error(
    times: np.ndarray, prices: np.ndarray, holdout_days: float = 7.0, half_life_days: float = 14.0
) -> dict:
    """Fit on all but the last ``holdout_days``; the error on those days, and the naive
    forecast's (the last price before the hold-out, held flat) for comparison."""
    times, prices = np.asarray(times, dtype=np.float64), np.asarray(prices, dtype=np.float64)
    cut = times.max() - holdout_days * 86400
    train, test = times <= cut, times > cut
    if train.sum() == 0 or test.sum() == 0:
        raise ValueError("need history both before and inside the hold-out period")
    model = HourOfWeekForecast.fit(times[train], prices[train], half_life_days)
    predicted, low, high = model.predict(times[test])
    naive = np.full(test.sum(), prices[train][np.argmax(times[train])])
    actual = prices[test]
    return {
        "holdout_hours": int(test.sum()),
        "mae": round(float(np.abs(predicted - actual).mean()), 4),
        "mape": round(float((np.abs(predicted - actual) / np.abs(actual)).mean()), 4),
        "naive_mae": round(float(np.abs(naive - actual).mean()), 4),
        "band_coverage": round(float(((actual >= low) & (actual <= high)).mean()), 4),
    }


@dataclass(frozen=True)
class Estimate:
    expected_cost: float
    expected_finish: float | None  # UNIX seconds; None: not even on average before the deadline
    p_meet_deadline: float  # on spot alone (with the on-demand fallback it is met: 1.0)
    on_demand_cost: float
    saving: float
    spot_gpu_hours: float  # expected
    fallback_gpu_hours: float  # expected on-demand hours the fallback buys


def estimate(
    forecast: HourOfWeekForecast,
    gpu_hours: float,
    cap: float,
    start: float,
    deadline: float,
    on_demand_price: float,
    gpus: int = 1,
) -> Estimate:
    """Expected cost and finish of ``gpu_hours`` on ``gpus`` GPUs of one node, on spot at most
    ``cap`` per GPU-hour between ``start`` and ``deadline`` (UNIX seconds), with the rest
    bought on-demand before the deadline."""
    if gpu_hours <= 0 or not deadline > start or gpus < 1:
        raise ValueError("need gpu_hours > 0, gpus >= 1 and a deadline after the start")
    hours = np.arange(math.floor(start / 3600), math.ceil(deadline / 3600)) * 3600.0
    p = forecast.p_at_most(hours, cap)
    mean, _, _ = forecast.predict(hours)
    price_if_used = np.minimum(mean, cap)
    need = gpu_hours / gpus  # hours of the node
    expected_spot = np.cumsum(p)
    reached = np.flatnonzero(expected_spot >= need)
    finish = float(hours[reached[0]] + 3600) if len(reached) else None
    used = np.clip(need - np.r_[0.0, expected_spot[:-1]], 0.0, p)  # spot hours expected per hour
    spot_hours = float(used.sum())
    spot_cost = gpus * float((used * price_if_used).sum())
    fallback = max(0.0, need - spot_hours)
    cost = spot_cost + gpus * fallback * on_demand_price
    # P(at least `need` spot hours by the deadline): Poisson-binomial, by dynamic programming;
    # a count above the window's hours is never reached: the table stops one past them
    need_whole = min(math.ceil(need - 1e-9), len(p) + 1)
    dist = np.zeros(need_whole + 1)
    dist[0] = 1.0
    for q in p:
        shifted = np.r_[0.0, dist[:-1]]
        shifted[-1] += dist[-1]  # counts at the target stay there
        dist = dist * (1 - q) + shifted * q
    full = gpu_hours * on_demand_price
    return Estimate(
        expected_cost=round(cost, 4),
        expected_finish=finish,
        p_meet_deadline=round(float(dist[-1]), 4),
        on_demand_cost=round(full, 4),
        saving=round(1 - cost / full, 4),
        spot_gpu_hours=round(spot_hours * gpus, 3),
        fallback_gpu_hours=round(fallback * gpus, 3),
    )


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)
