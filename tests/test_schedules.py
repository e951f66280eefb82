"""Cheap-window arithmetic: 18:00-09:00 on weekdays and all weekend, across DST changes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefect_spotgpu.economics.schedules import cheap_window, is_cheap

BERLIN = ZoneInfo("Europe/Berlin")


def local(*args) -> datetime:
    return datetime(*args, tzinfo=BERLIN)


@pytest.mark.parametrize(
    ("at", "start", "end"),
    [
        # Wednesday midday: tonight to tomorrow morning
        (local(2026, 12, 2, 12), local(2026, 12, 2, 18), local(2026, 12, 3, 9)),
        # Wednesday night, and just before it closes
        (local(2026, 12, 2, 23), local(2026, 12, 2, 18), local(2026, 12, 3, 9)),
        (local(2026, 12, 3, 8, 59), local(2026, 12, 2, 18), local(2026, 12, 3, 9)),
        # the weekend is one window, Friday 18:00 to Monday 09:00
        (local(2026, 12, 4, 18), local(2026, 12, 4, 18), local(2026, 12, 7, 9)),
        (local(2026, 12, 5, 12), local(2026, 12, 4, 18), local(2026, 12, 7, 9)),
        (local(2026, 12, 7, 8), local(2026, 12, 4, 18), local(2026, 12, 7, 9)),
        # Monday 09:00 sharp: closed; the next one is Monday night
        (local(2026, 12, 7, 9), local(2026, 12, 7, 18), local(2026, 12, 8, 9)),
        # spring forward (29 March 2026, 02:00 -> 03:00): a 14-hour night in UTC terms
        (local(2026, 3, 29, 12), local(2026, 3, 27, 18), local(2026, 3, 30, 9)),
        # fall back (25 October 2026, 03:00 -> 02:00)
        (local(2026, 10, 25, 2, 30), local(2026, 10, 23, 18), local(2026, 10, 26, 9)),
    ],
)
def test_windows_in_local_time(at, start, end):
    got = cheap_window(at, "Europe/Berlin")
    assert got == (start.astimezone(UTC), end.astimezone(UTC))
    assert all(t.tzinfo is UTC for t in got)


def test_dst_changes_move_the_utc_instants_not_the_local_hours():
    before = cheap_window(local(2026, 3, 26, 12), "Europe/Berlin")  # Thursday, CET
    after = cheap_window(local(2026, 3, 30, 12), "Europe/Berlin")  # Monday, CEST
    assert before[0].hour == 17 and after[0].hour == 16  # 18:00 local both times
    weekend = cheap_window(local(2026, 3, 28, 12), "Europe/Berlin")
    assert weekend[1] - weekend[0] == timedelta(hours=62)  # 63 h minus the lost hour
    autumn = cheap_window(local(2026, 10, 24, 12), "Europe/Berlin")
    assert autumn[1] - autumn[0] == timedelta(hours=64)  # plus the repeated hour


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown timezone 'Mars/Olympus'"):
        cheap_window(datetime.now(UTC), "Mars/Olympus")
    with pytest.raises(ValueError, match="timezone-aware"):
        cheap_window(datetime(2026, 1, 1), "UTC")


@given(st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2090, 1, 1)))
def test_every_instant_is_in_its_window_or_before_the_next(naive):
    at = naive.replace(tzinfo=UTC)
    start, end = cheap_window(at, "America/New_York")
    assert at < end and start < end
    local_start = start.astimezone(ZoneInfo("America/New_York"))
    local_end = end.astimezone(ZoneInfo("America/New_York"))
    assert (local_start.hour, local_start.minute) == (18, 0) and local_start.weekday() < 5
    assert (local_end.hour, local_end.minute) == (9, 0) and local_end.weekday() < 5
    hour = at.astimezone(ZoneInfo("America/New_York"))
    expected = hour.weekday() >= 5 or hour.hour >= 18 or hour.hour < 9
    assert is_cheap(at, "America/New_York") == expected


@pytest.mark.parametrize("make", ["cron", "rrule"])
def test_prefect_schedules_start_runs_as_each_window_opens(make):
    import asyncio

    from prefect.server.schemas.schedules import CronSchedule, RRuleSchedule

    from prefect_spotgpu.deploy import night_rrule, night_schedule

    client_side = (
        night_schedule("Europe/Berlin") if make == "cron" else night_rrule("Europe/Berlin")
    )
    server_type = CronSchedule if make == "cron" else RRuleSchedule
    schedule = server_type(**client_side.model_dump(exclude_none=True))
    start = local(2027, 3, 24, 12)  # a Wednesday; the DST change is on Sunday the 28th
    dates = asyncio.run(schedule.get_dates(n=5, start=start))
    assert [d.astimezone(BERLIN).strftime("%a %d %H:%M") for d in dates] == [
        "Wed 24 18:00", "Thu 25 18:00", "Fri 26 18:00", "Mon 29 18:00", "Tue 30 18:00",
    ]  # fmt: skip
    for d in dates:
        assert cheap_window(d, "Europe/Berlin")[0] == d
    with pytest.raises(ValueError, match="unknown timezone"):
        night_schedule("Mars/Olympus")
