"""The cheap window: 18:00-09:00 on weekdays and all weekend, in a timezone the user names.

The window is wall-clock time, so it is worked out in local time and only then turned into UTC
instants: across a DST change the UTC instants move and the local hours stay (a window that
spans the change is an hour shorter or longer). 18:00 and 09:00 never fall in a DST gap or
fold, so every boundary is one well-defined instant.

    >>> start, end = cheap_window(datetime(2026, 12, 2, 12, 0, tzinfo=UTC), "Europe/Berlin")
    >>> start.isoformat(), end.isoformat()    # Wednesday noon: tonight 18:00 to 09:00 tomorrow
    ('2026-12-02T17:00:00+00:00', '2026-12-03T08:00:00+00:00')
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

OPENS = time(18, 0)
"""Local time the cheap window opens on a weekday (Friday's runs through the weekend)."""
CLOSES = time(9, 0)
"""Local time the cheap window closes on a weekday."""


def zone(name: str) -> ZoneInfo:
    """The IANA timezone ``name``, or a ValueError that says what is wrong."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown timezone {name!r}; use an IANA name such as Europe/Berlin"
        ) from None


def is_cheap(at: datetime, tz: str = "UTC") -> bool:
    """Whether ``at`` (timezone-aware) lies inside a cheap window."""
    start, _ = cheap_window(at, tz)
    return start <= at


def cheap_window(at: datetime, tz: str = "UTC") -> tuple[datetime, datetime]:
    """The cheap window containing ``at``, or else the next one, as UTC datetimes."""
    if at.tzinfo is None:
        raise ValueError("at must be timezone-aware")
    local_zone = zone(tz)
    local = at.astimezone(local_zone)
    for back in range(8):  # the latest opening at or before `at`
        day = local.date() - timedelta(days=back)
        if day.weekday() < 5 and _at(day, OPENS, local_zone) <= local:
            end = _closing_after(day, local_zone)
            if local < end:
                return _utc(_at(day, OPENS, local_zone)), _utc(end)
            break
    for ahead in range(8):  # the next opening after `at`
        day = local.date() + timedelta(days=ahead)
        if day.weekday() < 5 and _at(day, OPENS, local_zone) > local:
            return _utc(_at(day, OPENS, local_zone)), _utc(_closing_after(day, local_zone))
    raise AssertionError("unreachable: a weekday opens within a week")  # pragma: no cover


def _closing_after(opening_day: date, local_zone: ZoneInfo) -> datetime:
    day = opening_day + timedelta(days=1)
    while day.weekday() >= 5:
        day += timedelta(days=1)
    return _at(day, CLOSES, local_zone)


def _at(day: date, clock: time, local_zone: ZoneInfo) -> datetime:
    return datetime.combine(day, clock, tzinfo=local_zone)


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


def aware(value: datetime) -> datetime:
    """``value`` with a timezone: a naive time is taken as UTC (as Prefect stores them)."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


NIGHT_CRON = "0 18 * * 1-5"
"""A run at each opening of the cheap window: 18:00 on weekdays (Friday's spans the weekend)."""
NIGHT_RRULE = "FREQ=WEEKLY;BYDAY=MO,TU,WE,TH,FR;BYHOUR=18;BYMINUTE=0;BYSECOND=0"
