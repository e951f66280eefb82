"""Fitted forecasts, kept per pool, history window and bar: refitted only when a bar closes.

A pool's forecast is learnt from its stored minute bars (``price_bars``, read by the hour:
:func:`list_hourly_bars`): reading 28 days of them is most of an estimate's cost, and they
change only when the tick writes a new minute's bar. So :class:`ForecastCache` keeps, per
``(gpu_model, region, days)``, the hourly bars, the fitted
:class:`~prefect_spotgpu.market.forecast.HourOfWeekForecast` and its hold-out error, with the
window's *fingerprint*: the count and the newest minute of the bars it was fitted
from (one aggregate read, :func:`count_bars_by_region`). A request whose fingerprint is the
stored one is answered from memory; a new bar (or one that left the window, or history stored
by hand) changes the fingerprint and the next request fits again. An estimate for ``any``
region reads every region's fingerprint at once and refits only the regions that moved.

The one in-place change a fingerprint does not see is the tick merging later prices into the
current minute's bar: a forecast may miss up to one minute's last moves, never more.

Entries change only through :meth:`ForecastCache.fitted`, one computation per key at a time
(the others wait for its answer); at most ``max_entries`` are kept, the least recently used
forgotten first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session, aliased

from prefect_spotgpu.market.forecast import HourOfWeekForecast, holdout_error, hourly_bars
from prefect_spotgpu.service import queries
from prefect_spotgpu.service.models import PriceBar

Fingerprint = tuple
"""What a forecast was fitted from: ``((region, bars, newest minute), ...)``."""


@dataclass(frozen=True)
class Fitted:
    """A pool's history at an hour's resolution and what was learnt from it."""

    bars: dict[str, np.ndarray]  # hourly OHLC (``market.forecast.hourly_bars``)
    forecast: HourOfWeekForecast
    error: dict | None  # measured on the last quarter (at most a week) with 2 days+ of history


def count_bars_by_region(
    *, session: Session, gpu_model: str, region: str | None, since_minute: int
) -> Fingerprint:
    """``((region, bar count, newest minute), ...)`` of ``gpu_model``'s bars since
    ``since_minute``, by region (of one region, when given); ``()`` when there are none."""
    query = select(PriceBar.region, func.count(), func.max(PriceBar.minute)).where(
        PriceBar.gpu_model == gpu_model, PriceBar.minute >= since_minute
    )
    if region is not None:
        query = query.where(PriceBar.region == region)
    rows = session.execute(query.group_by(PriceBar.region).order_by(PriceBar.region)).all()
    return tuple((r, int(n), int(newest)) for r, n, newest in rows if n)


def list_hourly_bars(
    *, session: Session, gpu_model: str, region: str, since_minute: int
) -> list[tuple[int, float, float, float, float]]:
    """``(hour, open, high, low, close)`` of a pool since ``since_minute``, oldest first: its
    minute bars by hour, aggregated by the database (what ``market.forecast.hourly_bars``
    makes of them, sixty times fewer rows to read)."""
    hour = (PriceBar.minute // 60).label("hour")
    hours = (
        select(
            hour,
            func.min(PriceBar.minute).label("first"),
            func.max(PriceBar.minute).label("last"),
            func.max(PriceBar.high).label("high"),
            func.min(PriceBar.low).label("low"),
        )
        .where(
            PriceBar.gpu_model == gpu_model,
            PriceBar.region == region,
            PriceBar.minute >= since_minute,
        )
        .group_by(hour)
        .subquery()
    )
    first, last = aliased(PriceBar), aliased(PriceBar)
    query = (
        select(hours.c.hour, first.open, hours.c.high, hours.c.low, last.close)
        .join(
            first,
            (first.gpu_model == gpu_model)
            & (first.region == region)
            & (first.minute == hours.c.first),
        )
        .join(
            last,
            (last.gpu_model == gpu_model) & (last.region == region) & (last.minute == hours.c.last),
        )
        .order_by(hours.c.hour)
    )
    return [tuple(r) for r in session.execute(query)]


def fit_history(
    *, session: Session, gpu_model: str, region: str | None, since_minute: int
) -> Fitted | None:
    """Read a pool's bars by hour (every region's minute bars merged, for ``region`` None)
    and fit; None when there are none."""
    if region is not None:
        rows = list_hourly_bars(
            session=session, gpu_model=gpu_model, region=region, since_minute=since_minute
        )
        if not rows:
            return None
        cols = np.array(rows, dtype=np.float64).T
        names = ("hour", "open", "high", "low", "close")
        bars = {name: cols[i] for i, name in enumerate(names)}
        bars["hour"] = cols[0].astype(np.int64)
    else:
        minutes = queries.list_minute_bars(
            session=session, gpu_model=gpu_model, region=None, since_minute=since_minute
        )
        if not minutes:
            return None
        cols = np.array([tuple(r) for r in minutes], dtype=np.float64).T  # tuples: 10x faster
        bars = hourly_bars(cols[0].astype(np.int64), *cols[1:])
    times = bars["hour"] * 3600.0
    span_days = (times.max() - times.min()) / 86400
    error = None
    if span_days >= 2:
        error = holdout_error(times, bars["close"], holdout_days=min(7.0, span_days / 4))
    return Fitted(bars, HourOfWeekForecast.fit(times, bars["close"]), error)


class ForecastCache:
    """Fitted forecasts by key, each valid while its fingerprint holds (module docstring)."""

    def __init__(self, *, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[Hashable, tuple[Fingerprint, Fitted]] = OrderedDict()
        self.computed = 0  # fits made (a count for tests and metrics)
        self._lock = threading.Lock()  # guards entries and _keys
        self._keys: dict[Hashable, threading.Lock] = {}  # one computation per key at a time

    def fitted(
        self,
        key: Hashable,
        fingerprint: Fingerprint,
        compute: Callable[[], Fitted | None],
        admit: Callable[[], None] = lambda: None,
    ) -> Fitted | None:
        """The entry of ``key`` if fitted from ``fingerprint``; else ``admit()`` (which may
        raise: a caller over its share) and ``compute()``, kept unless it is None."""
        hit = self._hit(key, fingerprint)
        if hit is not None:
            return hit
        with self._lock:
            key_lock = self._keys.setdefault(key, threading.Lock())
        with key_lock:
            hit = self._hit(key, fingerprint)  # another thread's computation, while we waited
            if hit is not None:
                return hit
            admit()
            fitted = compute()
            with self._lock:
                self.computed += 1
                if fitted is not None:
                    self.entries[key] = (fingerprint, fitted)
                    self.entries.move_to_end(key)
                    while len(self.entries) > self.max_entries:
                        gone, _ = self.entries.popitem(last=False)
                        self._keys.pop(gone, None)
                if len(self._keys) > 4 * self.max_entries:  # failed keys' locks, unheld
                    for stale in [k for k, lock in self._keys.items() if not lock.locked()]:
                        if stale not in self.entries:
                            del self._keys[stale]
            return fitted

    def _hit(self, key: Hashable, fingerprint: Fingerprint) -> Fitted | None:
        with self._lock:
            entry = self.entries.get(key)
            if entry is None or entry[0] != fingerprint:
                return None
            self.entries.move_to_end(key)
            return entry[1]
