"""What retention keeps, as plain data: for a moment ``now``, the cutoff of each kind of row,
and the hourly bar a pool's minute bars become. No I/O and no clock: the operator's policy
and ``now`` come in, numbers and bars go out (``service/retention.py`` reads and deletes).

A minute bar is never dropped: once older than its retention it is folded with the other bars
of its hour into one hourly bar (:func:`fold_into_hours`), the hour's open, high, low and close
(what ``market.forecast.hourly_bars`` makes of the hour's minutes, so the forecast and the
hourly history read the same before and after). Cutoffs of bars fall on an hour's start: an
hour is folded whole, or not at all.

>>> policy = RetentionPolicy(events_days=30, minute_bars_days=7)
>>> cut = cutoffs(policy, now=40 * 86400.0 + 1800)  # day 40, half past midnight
>>> cut.events - 10 * 86400, cut.minute_bars * 60 - 33 * 86400, cut.node_reports
(1800.0, 0, None)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect_spotgpu.service.settings import ServiceSettings

DAY = 86400.0
MINUTE_BAR = 60
"""A bar's ``seconds``: one minute of a pool's clearing price, as the tick writes it."""
HOUR_BAR = 3600
"""A bar's ``seconds``: one hour, folded from its minute bars by retention."""


class RowKind(StrEnum):
    """The kinds of rows retention removes, in the order a pass prunes them. A member's name,
    lower-cased, names its fields: ``RetentionPolicy.<name>_days``, ``Cutoffs.<name>`` and the
    setting ``retention_<name>_days``."""

    EVENTS = "events"
    WEBHOOK_DELIVERIES = "webhook deliveries"
    NODE_REPORTS = "node reports"
    ENDED_ALLOCATIONS = "ended allocations"
    MINUTE_BARS = "minute price bars"
    """Folded into hourly bars, not dropped."""
    HOURLY_BARS = "hourly price bars"


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Days each kind of row is kept; None: for ever."""

    events_days: float | None = None
    webhook_deliveries_days: float | None = None
    node_reports_days: float | None = None
    ended_allocations_days: float | None = None
    minute_bars_days: float | None = None
    hourly_bars_days: float | None = None

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> RetentionPolicy:
        """The operator's ``retention_*_days`` settings (0: for ever)."""

        def days(kind: RowKind) -> float | None:
            value = getattr(settings, f"retention_{kind.name.lower()}_days")
            return value if value > 0 else None

        return cls(**{f"{kind.name.lower()}_days": days(kind) for kind in RowKind})

    def days(self, kind: RowKind) -> float | None:
        """How long rows of ``kind`` are kept (None: for ever)."""
        return getattr(self, f"{kind.name.lower()}_days")

    @property
    def keeps_everything(self) -> bool:
        return all(self.days(kind) is None for kind in RowKind)


@dataclass(frozen=True, slots=True)
class Cutoffs:
    """Rows older than these go; None: that kind is kept. Times are UNIX seconds; bars are
    minutes (UNIX seconds // 60) at an hour's start."""

    events: float | None = None
    """Events created before."""
    webhook_deliveries: float | None = None
    """Deliveries delivered or failed, last attempted before (a pending one always stays)."""
    node_reports: float | None = None
    """Node reports made before."""
    ended_allocations: float | None = None
    """Allocations ended before (never one of a live bid or gang, never the newest)."""
    minute_bars: int | None = None
    """Minute bars of the hours before this minute are folded into hourly bars."""
    hourly_bars: int | None = None
    """Hourly bars of the hours before this minute go."""

    def of(self, kind: RowKind) -> float | int | None:
        return getattr(self, kind.name.lower())

    def as_seconds(self, kind: RowKind) -> float | None:
        """The cutoff of ``kind`` in UNIX seconds (bars' minutes converted)."""
        value = self.of(kind)
        if value is None:
            return None
        if kind in (RowKind.MINUTE_BARS, RowKind.HOURLY_BARS):
            return float(value * 60)
        return float(value)


def _hour_start_minute(seconds: float) -> int:
    """The minute (UNIX seconds // 60) at the start of the hour holding ``seconds``."""
    return int(seconds // HOUR_BAR) * (HOUR_BAR // 60)


def cutoffs(policy: RetentionPolicy, now: float) -> Cutoffs:
    """What goes at ``now`` under ``policy``."""

    def before(days: float | None) -> float | None:
        return None if days is None else now - days * DAY

    def bars_before(days: float | None) -> int | None:
        return None if days is None else _hour_start_minute(now - days * DAY)

    return Cutoffs(
        events=before(policy.events_days),
        webhook_deliveries=before(policy.webhook_deliveries_days),
        node_reports=before(policy.node_reports_days),
        ended_allocations=before(policy.ended_allocations_days),
        minute_bars=bars_before(policy.minute_bars_days),
        hourly_bars=bars_before(policy.hourly_bars_days),
    )


@dataclass(frozen=True, slots=True)
class Bar:
    """A pool's price bar: OHLC over ``seconds`` from ``minute`` (UNIX seconds // 60)."""

    minute: int
    open: float
    high: float
    low: float
    close: float
    seconds: int = MINUTE_BAR


def fold_into_hours(bars: Iterable[Bar]) -> list[Bar]:
    """One pool's bars as one bar per hour they touch, oldest first: the first bar's open, the
    highest high, the lowest low, the last bar's close, at the hour's first minute. A bar that
    is already hourly counts as the hour's first (it is at its start), so folding again
    changes nothing.

    >>> fold_into_hours([Bar(61, 1.0, 1.2, 0.9, 1.1), Bar(60, 0.8, 0.8, 0.7, 0.75)])
    [Bar(minute=60, open=0.8, high=1.2, low=0.7, close=1.1, seconds=3600)]
    """
    per_hour = HOUR_BAR // 60
    hours: dict[int, list[Bar]] = {}
    for bar in sorted(bars, key=lambda b: b.minute):
        hours.setdefault(bar.minute // per_hour, []).append(bar)
    return [
        Bar(
            minute=hour * per_hour,
            open=group[0].open,
            high=max(b.high for b in group),
            low=min(b.low for b in group),
            close=group[-1].close,
            seconds=HOUR_BAR,
        )
        for hour, group in sorted(hours.items())
    ]


def fold_range(oldest_minute: int, cutoff_minute: int, batch_rows: int) -> tuple[int, int]:
    """The minutes ``[start, end)`` of one pool that one batch folds: whole hours from the hour
    of its oldest minute bar still to fold, as many as ``batch_rows`` minute bars would fill
    (at least one), never past the cutoff.

    >>> fold_range(125, 600, 150)  # hours 2 and 3 (150 rows fill two and a half)
    (120, 240)
    """
    per_hour = HOUR_BAR // 60
    start = oldest_minute // per_hour * per_hour
    hours = max(1, batch_rows // per_hour)
    return start, min(cutoff_minute, start + hours * per_hour)


BACKLOG_PAUSE_SECONDS = 5.0
"""Between two catch-up passes over a backlog, the market's writers (the API, the tick) have the
database to themselves for this long: a year's backlog is pruned in hours, never by holding
SQLite's write lock pass after pass."""


def next_pass(*, now: float, interval: float, backlog: bool) -> float:
    """When the tick leader prunes next: ``BACKLOG_PAUSE_SECONDS`` on while a backlog is left
    (each pass one batch of each kind, so a tick is never held up by more), else ``interval``
    seconds on (never sooner than the pause).

    >>> next_pass(now=100.0, interval=600.0, backlog=True)
    105.0
    >>> next_pass(now=100.0, interval=600.0, backlog=False)
    700.0
    """
    return now + (BACKLOG_PAUSE_SECONDS if backlog else max(interval, BACKLOG_PAUSE_SECONDS))
