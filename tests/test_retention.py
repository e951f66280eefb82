"""Retention over simulated weeks of market life, on real SQLite and PostgreSQL: the tick
leader prunes as the market lives (a month: every table stays bounded), and the operator's
``spotgpu server prune`` (a real subprocess) counts with ``--dry-run``, then removes exactly
that; the ledger's identities hold, a live bid keeps all its allocations, pending deliveries
and their events stay, and the price history still answers, folded to hours where it is old.

The market lives on the service's ``ManualClock``, started in the past so that its days end
half a day before the wall clock: the price routes and the CLI read the wall clock. Each day
(:meth:`MarketLife.day`): a busy quarter of an hour at midnight (alice outbids carol's live
bid, carol's job saves and is preempted, alice's job checkpoints and finishes; bob's bid runs
and is cancelled), then a tick every four hours. No tick falls between 8:20 and 12:20, so the
CLI's cutoffs, whole days before the wall clock (12:00 of a day and the test's minute or two
so far; for bars, the start of that hour) split the rows the same way in the dry run, in the
prune and in the test's expectations.
"""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from conftest import one_database, start_service
from prefect_spotgpu.cli.stack import wait_for
from prefect_spotgpu.service.clock import ManualClock
from prefect_spotgpu.service.models import EventRow, WebhookDelivery
from prefect_spotgpu.service.retention_rules import Bar, RowKind, fold_into_hours
from test_cli import spotgpu
from test_service_webhooks import SECRET, Receiver

DAY = 86400.0
MONTH_RETENTION = {  # (days) short, so that a month shows the steady state
    "retention_events_days": 3,
    "retention_webhook_deliveries_days": 3,
    "retention_node_reports_days": 2,
    "retention_ended_allocations_days": 5,
    "retention_minute_bars_days": 2,
}
QUIET = {  # nodes never go silent; a failing webhook is retried for days (backoff doubling)
    "heartbeat_timeout_seconds": 1e7,
    "webhook_max_attempts": 20,
    "public_cache_seconds": 0,
}
PRUNED = ("events", "webhook_deliveries", "node_reports", "allocations")


def refused_url() -> str:
    """A loopback URL nothing listens on: every delivery to it stays pending."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


def sizes(engine) -> dict[str, int]:
    """Rows per table (price bars by width), and the newest id of each pruned table."""
    with engine.connect() as connection:
        one = lambda sql: connection.execute(sa.text(sql)).scalar() or 0  # noqa: E731
        out = {t: one(f"SELECT count(*) FROM {t}") for t in (*PRUNED, "ledger_entries", "bids")}
        out["minute_bars"] = one("SELECT count(*) FROM price_bars WHERE seconds = 60")
        out["ended bids' events"] = one(
            "SELECT count(*) FROM events e JOIN bids b ON b.id = e.bid_id"
            " WHERE b.status NOT IN ('open', 'held')"
        )  # (a live bid's are kept, however old)
        out["hourly_bars"] = one("SELECT count(*) FROM price_bars WHERE seconds = 3600")
        for table in PRUNED:
            out[f"newest {table}"] = one(f"SELECT max(id) FROM {table}")
    return out


def assert_ledger_exact(engine) -> None:
    """The ledger's identities, to the micro: each tenant's credits are the sum of its ledger
    entries, and its spent the sum of its allocations' charges and of those archived when
    retention removed their allocations (tests/test_money.py's check, archive included)."""
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text("""
            SELECT t.id, t.credits_micros, t.spent_micros,
                   (SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_entries e
                     WHERE e.tenant_id = t.id),
                   (SELECT COALESCE(SUM(charged_micros), 0) FROM allocations a
                     WHERE a.tenant_id = t.id)
                   + COALESCE((SELECT charged_micros FROM archived_charges c
                     WHERE c.tenant_id = t.id), 0)
            FROM tenants t ORDER BY t.id""")
        ).all()
    for tenant_id, credits, spent, entries, charged in rows:
        assert credits == entries, f"tenant {tenant_id}: credits {credits} != entries {entries}"
        assert spent == charged, f"tenant {tenant_id}: spent {spent} != charged {charged}"


class MarketLife:
    """Three buyers and two nodes, a day at a time (the module's docstring)."""

    def __init__(self, svc, webhook_url: str, refused_days: int = 2) -> None:
        self.svc, self.clock = svc, svc.clock
        self.webhook_url, self.refused_days = webhook_url, refused_days
        owner = svc.tenant()
        self.n1, self.agent1 = svc.node(owner, gpus=8, reserve=0.5, region="eu-west")
        self.n2, self.agent2 = svc.node(owner, gpus=4, reserve=0.4, region="us-east")
        self.alice, self.bob, self.carol = (svc.tenant(credit=1e6) for _ in range(3))
        assert self.alice.put("/webhook", json={"url": webhook_url, "secret": SECRET}).is_success
        # bob's endpoint refuses his first days' deliveries: they stay pending (for days)
        self.refused_url = refused_url()
        body = {"url": self.refused_url, "secret": SECRET}
        assert self.bob.put("/webhook", json=body).is_success
        self.carol_bid = self.place(self.carol, 8, "eu-west", 1.0)  # lives all along
        self.tick_after(60)  # carol's job runs: the first day starts
        self.days = 0

    def place(self, client, gpus: int, region: str, price: float) -> int:
        body = {"gpu_model": "A100-80G", "region": region, "gpu_count": gpus, "max_price": price}
        response = client.post("/bids", json=body)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def allocation(self, client, bid_id: int, status: str) -> dict:
        """The bid's allocation in ``status``, once the tick at the clock's time made it."""

        def found():
            allocations = client.get(f"/bids/{bid_id}/allocations").json()
            return [a for a in allocations if a["status"] == status]

        (one,) = self.svc.wait_for(found, timeout=30)
        return one

    def report(self, agent, alloc: dict, outcome: str) -> None:
        body = {"epoch": alloc["epoch"], "outcome": outcome}
        if outcome in ("checkpoint", "saved"):
            body["checkpoint_at"] = self.clock.time()
        response = agent.post(f"/allocations/{alloc['id']}/report", json=body)
        assert response.status_code == 200, response.text

    def tick_after(self, seconds: float, step: float | None = None) -> None:
        """``seconds`` of the market's time, a tick every ``step`` (default: one, at their
        end), and the tick at the clock's new time done."""
        self.svc.advance(seconds, step=step or seconds)
        ticked_at_now(self.svc)

    def day(self) -> None:
        """One day from its midnight to the next."""
        midnight = self.clock.time()
        if self.days == self.refused_days:  # bob's endpoint is back
            body = {"url": self.webhook_url, "secret": SECRET}
            assert self.bob.put("/webhook", json=body).is_success
        alice_bid = self.place(self.alice, 8, "eu-west", 2.0)
        self.tick_after(60)  # alice outbids carol: carol's job is noticed
        self.report(self.agent1, self.allocation(self.carol, self.carol_bid, "noticed"), "saved")
        bob_bid = self.place(self.bob, 4, "us-east", 1.0)
        self.tick_after(60)  # carol's preempted; alice's job and bob's run
        alice = self.allocation(self.alice, alice_bid, "running")
        bob = self.allocation(self.bob, bob_bid, "running")
        for _ in range(6):
            self.report(self.agent1, alice, "checkpoint")
            self.report(self.agent2, bob, "checkpoint")
            self.tick_after(60)
        self.report(self.agent1, alice, "finished")
        assert self.bob.post(f"/bids/{bob_bid}/cancel").status_code == 200
        self.tick_after(120, step=60)  # both end; carol runs again
        self.allocation(self.carol, self.carol_bid, "running")
        self.quiet_until_midnight(midnight)

    def quiet_day(self) -> None:
        self.quiet_until_midnight(self.clock.time())

    def quiet_until_midnight(self, midnight: float) -> None:
        """A tick at 0:20, then every four hours (4:20, ... 20:20), and one at 24:00."""
        self.tick_after(midnight + 1200 - self.clock.time())
        self.tick_after(DAY - 1200, step=4 * 3600)
        self.days += 1

    def settle_deliveries(self, engine) -> None:
        """Wait for every delivery's first attempt (alice's delivered, bob's refused and
        pending, retried for days), then date each attempt at its event's time: the webhook
        sender reads the wall clock, not the service's, so without this every delivery of
        the simulated past would look a few seconds old."""
        sim_now = datetime.fromtimestamp(self.clock.time(), UTC)

        def unattempted() -> int:
            with engine.connect() as connection:
                return connection.execute(
                    sa.select(sa.func.count()).where(WebhookDelivery.attempts == 0)
                ).scalar()

        self.svc.wait_for(lambda: unattempted() == 0, timeout=60)
        event_time = (
            sa.select(EventRow.created_at)
            .where(EventRow.id == WebhookDelivery.event_id)
            .scalar_subquery()
        )
        with engine.begin() as connection:
            connection.execute(
                sa.update(WebhookDelivery)
                .where(WebhookDelivery.updated_at > sim_now)
                .values(updated_at=event_time)
            )


def ticked_at_now(svc) -> None:
    """Until the tick loop has ticked at the clock's time and flushed its charges then (a
    flush that is not due yet comes one tick interval later)."""
    ticker, at = svc.app.state.ticker, svc.clock.time()
    try:
        svc.wait_for(lambda: ticker.last_flush >= at, timeout=0.5)
    except TimeoutError:
        svc.clock.advance(ticker.settings.tick_seconds)
        svc.wait_for(lambda: ticker.last_flush >= at, timeout=30)


def start(db_url, tmp_path, days: float, **settings):
    """The service on a clock ``days`` and a half before the wall clock's now (and the
    minute before the first day, which ``MarketLife`` spends placing carol's bid)."""
    clock = ManualClock(start=time.time() - (days + 0.5) * DAY - 60)
    return start_service(db_url, tmp_path / "home", clock=clock, **QUIET, **settings)


def history(client, path: str, **params) -> list[dict]:
    response = client.get(f"/prices/A100-80G/eu-west/{path}", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def minute_of(bar: dict) -> int:
    return int(datetime.fromisoformat(bar["minute"]).timestamp()) // 60


# ---------------------------------------------------------------- the tick leader, a month


def test_a_month_of_market_life_stays_bounded_and_keeps_what_is_needed(db_url, tmp_path):
    days = 30
    receiver = Receiver(failures=0)
    svc = start(db_url, tmp_path, days, retention_interval_seconds=3600, **MONTH_RETENTION)
    engine = sa.create_engine(db_url)
    try:
        life = MarketLife(svc, receiver.url)
        by_day, carol_early, bob_pending = {}, None, set()
        for day in range(days):
            life.day()
            life.settle_deliveries(engine)
            by_day[day + 1] = sizes(engine)
            if day == 9:
                carol_early = life.carol.get(f"/bids/{life.carol_bid}/allocations").json()
            bob_pending |= {
                d["id"]
                for d in life.bob.get("/webhook/deliveries").json()
                if d["url"] == life.refused_url
            }
        month_end = svc.clock.time() + 7200
        life.tick_after(7200)  # one more pass after the last deliveries were dated
        ticker = svc.app.state.ticker
        passed = lambda: ticker.retention.last_pass_at >= month_end  # noqa: E731
        wait_for(passed, 30, "the leader's retention pass at the month's end")
        end = sizes(engine)
        print(f"\n{db_url.split(':')[0]}: day 15 {by_day[15]}\nday 30 {end}")
        print("removed by the leader:", {str(k): v for k, v in ticker.retention.removed.items()})

        # bounded: written at a steady rate, kept no more at day 30 than at day 15
        for table in ("ended bids' events", "webhook_deliveries", "node_reports", "minute_bars"):
            assert end[table] <= by_day[15][table] * 1.1 + 5, table
        for table, newest in (
            ("ended bids' events", "newest events"),
            ("webhook_deliveries", "newest webhook_deliveries"),
            ("node_reports", "newest node_reports"),
        ):
            assert end[newest] >= 1.9 * by_day[15][newest], table
            assert end[table] < end[newest] / 4, table
        # carol's bid, live all month: every event of it stays, its first included
        carol_events = life.carol.get(
            f"/bids/{life.carol_bid}/events", params={"after": 0, "timeout": 0}
        ).json()["events"]
        assert carol_events[0]["kind"] == "allocated" and len(carol_events) >= days
        # allocations: alice's and bob's go, carol's (a live bid) all stay
        carol_now = life.carol.get(f"/bids/{life.carol_bid}/allocations").json()
        ended_early = [a for a in carol_early if a["status"] != "running"]  # (as they were)
        assert len(carol_now) == days + 1 and carol_now[: len(ended_early)] == ended_early
        assert [a["status"] for a in carol_now].count("running") == 1
        assert end["allocations"] - len(carol_now) <= 2 * (5 + 1) + 1
        assert end["hourly_bars"] >= 6 * (days - 3)  # every old hour that had a bar

        # the ledger: exact, with the charges of the removed allocations archived
        assert_ledger_exact(engine)
        with engine.connect() as connection:
            archived = dict(
                connection.execute(
                    sa.text("SELECT tenant_id, allocations FROM archived_charges")
                ).all()
            )
        assert archived[life.alice.tenant_id] >= days - 6
        assert life.carol.tenant_id not in archived

        # bob's deliveries all stay pending, with the events they will send
        deliveries = life.bob.get("/webhook/deliveries").json()
        pending = {d["id"] for d in deliveries if d["status"] == "pending"}
        assert bob_pending and pending == bob_pending
        with engine.connect() as connection:
            missing = connection.execute(
                sa.text(
                    "SELECT count(*) FROM webhook_deliveries d WHERE NOT EXISTS "
                    "(SELECT 1 FROM events e WHERE e.id = d.event_id) AND d.status = 'pending'"
                )
            ).scalar()
        assert missing == 0

        # an events cursor older than the oldest kept event answers from the oldest kept
        page = life.alice.get("/events", params={"after": 0, "timeout": 0}).json()
        assert page["events"] and page["events"][0]["id"] > 1
        since = svc.clock.time() - 3 * DAY - 7200
        assert all(e["payload"]["at"] >= since for e in page["events"])

        # the price history: minutes for the last two days, one bar an hour before
        bars = history(svc.client(), "history", hours=24 * 31)
        cutoff = (svc.clock.time() - 2 * DAY - 3600) // 60
        old = [minute_of(b) for b in bars if minute_of(b) < cutoff]
        assert old and all(m % 60 == 0 for m in old) and len(set(m // 60 for m in old)) == len(old)
        recent = [minute_of(b) for b in bars if minute_of(b) >= cutoff + 60]
        assert any(m % 60 for m in recent)  # minute resolution kept
        hourly = history(svc.client(), "hourly", days=31)
        assert len(hourly) >= len(old)
    finally:
        svc.stop()
        receiver.close()
        engine.dispose()


# ---------------------------------------------------------------- the operator's command


CLI_RETENTION = {
    "SPOTGPU_RETENTION_EVENTS_DAYS": "2",
    "SPOTGPU_RETENTION_WEBHOOK_DELIVERIES_DAYS": "2",
    "SPOTGPU_RETENTION_NODE_REPORTS_DAYS": "1",
    "SPOTGPU_RETENTION_ENDED_ALLOCATIONS_DAYS": "2",
    "SPOTGPU_RETENTION_MINUTE_BARS_DAYS": "2",
}


def prune(db_url, tmp_path, *args) -> dict[str, tuple[int, int, str]]:
    """``spotgpu server prune`` as an operator runs it: per kind, (rows now, what goes or
    went, note), read off its table."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    env.update(CLI_RETENTION, COLUMNS="200", SPOTGPU_HOME=str(tmp_path / "cli-home"))
    env["SPOTGPU_DB_URL"] = db_url
    out = spotgpu("server", "prune", *args, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 6 and cells[3].replace(",", "").isdigit():
            rows[cells[0]] = (int(cells[3].replace(",", "")), int(cells[4].replace(",", "")))
            rows[cells[0]] += (cells[5],)
    assert len(rows) == 6, out.stdout
    return rows


def test_server_prune_counts_with_dry_run_then_removes_exactly_that(db_url, tmp_path):
    receiver = Receiver(failures=0)
    svc = start(db_url, tmp_path, 6, retention_interval_seconds=0)  # the leader never prunes
    engine = sa.create_engine(db_url)
    try:
        life = MarketLife(svc, receiver.url)
        for _ in range(3):
            life.day()
        assert life.carol.post(f"/bids/{life.carol_bid}/cancel").status_code == 200
        for _ in range(3):
            life.quiet_day()  # nothing happens: every allocation ended days ago
        life.settle_deliveries(engine)
        before = sizes(engine)
        minutes_before = history(svc.client(), "history", hours=24 * 31)
        hourly_before = history(svc.client(), "hourly", days=31)
        assert_ledger_exact(engine)

        dry = prune(db_url, tmp_path, "--dry-run")
        assert sizes(engine) == before  # a dry run removes nothing
        assert dry["events"][0] == before["events"]
        assert dry["minute price bars"][0] == before["minute_bars"]

        done = prune(db_url, tmp_path)
        after = sizes(engine)
        print(f"\n{db_url.split(':')[0]} before {before}\nafter {after}")
        assert {k: v[1] for k, v in done.items()} == {k: v[1] for k, v in dry.items()}
        assert after["minute_bars"] == before["minute_bars"] - done["minute price bars"][1]
        assert done["minute price bars"][2] == dry["minute price bars"][2] != ""
        kinds = ("events", "webhook deliveries", "node reports", "ended allocations")
        for table, kind in zip(PRUNED, kinds, strict=True):
            assert after[table] == before[table] - done[kind][1], table
        # what stays: the newest row of each table; the events bob's pending deliveries send
        for table in PRUNED:
            assert after[f"newest {table}"] == before[f"newest {table}"], table
        assert after["allocations"] == 1 and after["node_reports"] == 1
        pending = {
            d["event_id"]
            for d in life.bob.get("/webhook/deliveries").json()
            if d["status"] == "pending"
        }
        with engine.connect() as connection:
            kept = set(connection.execute(sa.text("SELECT id FROM events")).scalars())
        assert pending and pending <= kept and len(kept) <= len(pending) + 1
        assert after["ledger_entries"] == before["ledger_entries"]
        assert after["bids"] == before["bids"]
        assert_ledger_exact(engine)

        # the history: kept minutes unchanged, older ones folded to hours; hourly unchanged
        minutes_after = history(svc.client(), "history", hours=24 * 31)
        cutoff = (time.time() - 2 * DAY) // 3600 * 60
        kept_minutes = [b for b in minutes_before if minute_of(b) >= cutoff]
        assert kept_minutes and [b for b in minutes_after if minute_of(b) >= cutoff] == kept_minutes
        old = [b for b in minutes_before if minute_of(b) < cutoff]
        folded = fold_by_hand(old)
        assert (
            len(folded) < len(old) and [b for b in minutes_after if minute_of(b) < cutoff] == folded
        )
        assert history(svc.client(), "hourly", days=31) == hourly_before

        # again: nothing left to do
        again = prune(db_url, tmp_path)
        assert all(went == 0 for _, went, _ in again.values()), again
        # rebuilt from the database, the market numbers on from the newest id it ever gave,
        # and new events follow the newest ever written (SQLite would reuse deleted ids)
        svc.stop()
        clock = ManualClock(start=svc.clock.time())
        svc = start_service(db_url, tmp_path / "home", clock=clock, **QUIET)
        alice = svc.client(life.alice.headers["Authorization"].removeprefix("Bearer "))
        bid = life.place(alice, 2, "eu-west", 1.0)
        svc.advance(60, step=60)
        ticked_at_now(svc)
        assert life.allocation(alice, bid, "running")["id"] == before["newest allocations"] + 1
        page = alice.get("/events", params={"after": 0, "timeout": 0}).json()
        assert page["events"][-1]["id"] == before["newest events"] + 1
    finally:
        svc.stop()
        receiver.close()
        engine.dispose()


def fold_by_hand(bars: list[dict]) -> list[dict]:
    """The hourly bars of minute bars, as the history route shows them: per hour, at its
    first minute, the first open, the highest high, the lowest low, the last close."""
    hours: dict[int, list[dict]] = {}
    for bar in bars:
        hours.setdefault(minute_of(bar) // 60, []).append(bar)
    return [
        {
            "minute": datetime.fromtimestamp(hour * 3600, UTC).isoformat().replace("+00:00", "Z"),
            "open": group[0]["open"],
            "high": max(b["high"] for b in group),
            "low": min(b["low"] for b in group),
            "close": group[-1]["close"],
            "seconds": 3600,  # (the route says which bars are an hour wide)
        }
        for hour, group in sorted(hours.items())
    ]


# ---------------------------------------------------------------- one leader, rollback, errors


def old_events(engine, count: int, days_ago: float) -> None:
    """``count`` events written ``days_ago`` (as a tick writes them; events have no keys to
    other tables)."""
    at = datetime.fromtimestamp(time.time() - days_ago * DAY, UTC)
    row = {"tenant_id": 1, "bid_id": 1, "node_id": 1, "allocation_id": 1, "kind": "allocated"}
    with engine.begin() as connection:
        connection.execute(sa.insert(EventRow), [{**row, "payload": {}, "created_at": at}] * count)


def test_only_the_leader_of_the_current_epoch_prunes(db_url, tmp_path):
    """A replica that lost the tick loop (its epoch is stale) removes nothing: each batch
    fences on the epoch, as a tick does."""
    from prefect_spotgpu.service import leader
    from prefect_spotgpu.service.db import make_engine, make_sessionmaker, migrate
    from prefect_spotgpu.service.leader import LostLeadership
    from prefect_spotgpu.service.retention import Pruner
    from prefect_spotgpu.service.settings import ServiceSettings

    engine = make_engine(db_url)
    try:
        migrate(engine)
        old_events(engine, 50, days_ago=40)
        old_events(engine, 1, days_ago=0)
        sessions = make_sessionmaker(engine)
        with sessions.begin() as session:
            stale = leader.take_over(session=session, holder="a", now=time.time())
        with sessions.begin() as session:
            current = leader.take_over(session=session, holder="b", now=time.time())
        settings = ServiceSettings(db_url=db_url, home=tmp_path / "home", retention_batch_rows=100)
        with pytest.raises(LostLeadership):
            Pruner(settings, sessions).run_due(now=time.time(), epoch=stale)
        assert sizes(engine)["events"] == 51
        pruner = Pruner(settings, sessions)
        pruner.run_due(now=time.time(), epoch=current)
        assert sizes(engine)["events"] == 1 and pruner.removed[RowKind.EVENTS] == 50
    finally:
        engine.dispose()


def test_the_retention_migration_goes_down_and_up_and_a_prune_refolds_the_hours(db_url):
    """Rolled back to 0014, an hourly bar stays, at its hour's first minute; upgraded again it
    reads as a minute bar, and the next prune makes it an hourly bar again, unchanged."""
    from alembic import command

    from prefect_spotgpu.service.db import _config, make_engine, make_sessionmaker, migrate
    from prefect_spotgpu.service.retention import prune_all
    from prefect_spotgpu.service.retention_rules import RetentionPolicy, cutoffs

    engine = make_engine(db_url)
    hour = int(time.time() - 10 * DAY) // 3600 * 60
    bar = {"gpu_model": "A100-80G", "region": "eu-west", "open": 1.0, "high": 2.0, "low": 0.5}
    try:
        migrate(engine)
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    "INSERT INTO price_bars (gpu_model, region, minute, open, high, low, close,"
                    " seconds) VALUES (:gpu_model, :region, :minute, :open, :high, :low, 1.5, "
                    "3600)"
                ),
                {**bar, "minute": hour},
            )
        config = _config()
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0014")
        upgrade(db_url, "head")
        assert sizes(engine)["minute_bars"] == 1  # (the width was lost with the column)
        cut = cutoffs(RetentionPolicy(minute_bars_days=7), time.time())
        done = prune_all(sessions=make_sessionmaker(engine), cut=cut, batch_rows=1000)
        assert done[RowKind.MINUTE_BARS].made == 1
        with engine.connect() as connection:
            rows = connection.execute(
                sa.text("SELECT minute, open, high, low, close, seconds FROM price_bars")
            ).all()
        assert [tuple(r) for r in rows] == [(hour, 1.0, 2.0, 0.5, 1.5, 3600)]
    finally:
        engine.dispose()


# bid id: (status, gang id); 1 ended alone, 2-3 a gang (2 ended, 3 open), 4 open, 5 ended
BIDS = {1: ("finished", None), 2: ("cancelled", 2), 3: ("open", 2), 4: ("open", None)}
BIDS[5] = ("finished", None)


def _bids_ended_long_ago(engine, ended: float) -> None:
    """A tenant, a node, ``BIDS``, an allocation of each ended at ``ended`` (10 charged each),
    and an event of each then (bid 5's the newest)."""
    from sqlalchemy.orm import Session

    from prefect_spotgpu.service.db import migrate
    from prefect_spotgpu.service.models import AllocationRow, BidRow, EventRow, NodeRow, Tenant

    now = datetime.now(UTC)
    migrate(engine)
    with Session(engine) as session, session.begin():
        session.add(Tenant(id=1, name="t", credits_micros=0, spent_micros=50, created_at=now))
        session.flush()
        session.add(
            NodeRow(
                id=1, owner_id=1, name="n", gpu_model="A100-80G", region="eu-west",
                gpu_count=8, reserve_price=0.5, state="live", token_hash="h",
                last_heartbeat_at=now, created_at=now,
            )
        )  # fmt: skip
        session.flush()
        for bid_id, (status, gang) in BIDS.items():
            session.add(
                BidRow(
                    id=bid_id, tenant_id=1, gpu_model="A100-80G", region="eu-west",
                    gpu_count=1, max_price=1.0, status=status, gang_id=gang,
                    created_at=now, updated_at=now,
                )
            )  # fmt: skip
        session.flush()
        for bid_id in BIDS:
            session.add(
                AllocationRow(
                    id=10 + bid_id, bid_id=bid_id, node_id=1, tenant_id=1, gpu_count=1,
                    status="finished", kind="new", started_at=ended - 60,
                    charged_until=ended, ended_at=ended, charged_micros=10,
                )
            )  # fmt: skip
            session.add(
                EventRow(
                    id=100 + bid_id, tenant_id=1, bid_id=bid_id, node_id=1,
                    allocation_id=10 + bid_id, kind="allocated", payload={},
                    created_at=datetime.fromtimestamp(ended - 60, UTC),
                )
            )  # fmt: skip


def test_a_gang_with_a_live_member_keeps_every_members_allocations(db_url):
    """Allocations ended long ago go, their charges archived, except a live bid's, a gang's
    whose member is live (rank 0 ended, another member still open), and the newest."""
    from prefect_spotgpu.service.db import make_engine, make_sessionmaker
    from prefect_spotgpu.service.retention import prune_all
    from prefect_spotgpu.service.retention_rules import RetentionPolicy, cutoffs

    engine = make_engine(db_url)
    try:
        _bids_ended_long_ago(engine, time.time() - 30 * DAY)
        cut = cutoffs(RetentionPolicy(ended_allocations_days=1), time.time())
        done = prune_all(sessions=make_sessionmaker(engine), cut=cut, batch_rows=100)
        assert done[RowKind.ENDED_ALLOCATIONS].removed == 1
        with engine.connect() as connection:
            kept = connection.execute(sa.text("SELECT bid_id FROM allocations")).scalars()
            assert sorted(kept) == [2, 3, 4, 5]
        assert_ledger_exact(engine)  # 50 spent: 40 on the allocations kept, 10 archived
    finally:
        engine.dispose()


def test_a_live_bid_keeps_every_event_a_worker_reads_to_adopt_it(db_url):
    """A worker that adopts a run reads its bid's events from the first (``allocated`` of an
    allocation that has run for longer than events are kept): a live bid's events, and a gang's
    with a live member, stay whatever their age; an ended bid's go."""
    from prefect_spotgpu.service.db import make_engine, make_sessionmaker
    from prefect_spotgpu.service.retention import prune_all
    from prefect_spotgpu.service.retention_rules import RetentionPolicy, cutoffs

    engine = make_engine(db_url)
    try:
        _bids_ended_long_ago(engine, time.time() - 30 * DAY)
        cut = cutoffs(RetentionPolicy(events_days=1), time.time())
        done = prune_all(sessions=make_sessionmaker(engine), cut=cut, batch_rows=100)
        assert done[RowKind.EVENTS].removed == 1
        with engine.connect() as connection:
            kept = connection.execute(sa.text("SELECT bid_id FROM events")).scalars()
            assert sorted(kept) == [2, 3, 4, 5]  # (5: the newest event)
    finally:
        engine.dispose()


@one_database("the refusals are decided before any row is read (settings, schema revision)")
def test_server_prune_says_what_to_change(db_url, tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    env.update(COLUMNS="200", SPOTGPU_HOME=str(tmp_path / "home"), SPOTGPU_DB_URL=db_url)
    missing = tmp_path / "elsewhere" / "market.db"  # a wrong path: no market made there
    out = spotgpu("server", "prune", env={**env, "SPOTGPU_DB_URL": f"sqlite:///{missing}"})
    assert out.returncode == 1 and "does not exist: no market there" in out.stdout, out.stdout
    assert not missing.exists()
    upgrade(db_url, "0014")  # a market of the version before retention
    out = spotgpu("server", "prune", "--dry-run", env=env)
    assert out.returncode == 1 and "run `spotgpu server migrate` first" in out.stdout
    upgrade(db_url, "head")
    bad = {**env, "SPOTGPU_RETENTION_HOURLY_BARS_DAYS": "3"}  # shorter than the minutes' 7
    out = spotgpu("server", "prune", env=bad)
    assert out.returncode == 2 and "retention_hourly_bars_days must be" in out.stdout
    kinds = ("EVENTS", "WEBHOOK_DELIVERIES", "NODE_REPORTS", "ENDED_ALLOCATIONS", "MINUTE_BARS")
    keep_all = {**env, **{f"SPOTGPU_RETENTION_{kind}_DAYS": "0" for kind in kinds}}
    out = spotgpu("server", "prune", env=keep_all)
    assert out.returncode == 0 and "kept for ever): nothing to prune" in out.stdout, out.stdout


def upgrade(db_url: str, revision: str) -> None:
    from alembic import command

    from prefect_spotgpu.service.db import _config, make_engine

    engine = make_engine(db_url)
    config = _config()
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        engine.dispose()


# ---------------------------------------------------------------- the pure parts


@given(
    st.lists(
        st.tuples(st.integers(0, 600), st.floats(0.1, 5), st.floats(0.1, 5)),
        unique_by=lambda t: t[0],
    )
)
def test_folding_is_the_forecasts_hourly_bars_and_folding_again_changes_nothing(rows):
    import numpy as np

    from prefect_spotgpu.market.forecast import hourly_bars

    bars = [Bar(m, a, max(a, b), min(a, b), b) for m, a, b in sorted(rows)]
    folded = fold_into_hours(bars)
    assert fold_into_hours(folded) == folded
    expected = hourly_bars(
        np.array([b.minute for b in bars], np.int64),
        *(np.array([getattr(b, f) for b in bars]) for f in ("open", "high", "low", "close")),
    )
    assert [b.minute // 60 for b in folded] == expected["hour"].tolist()
    for field in ("open", "high", "low", "close"):
        assert [getattr(b, field) for b in folded] == expected[field].tolist()
