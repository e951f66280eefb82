"""The Alembic migrations build exactly the schema the models describe, on SQLite and
PostgreSQL, and the newest one goes down and up again with its data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.orm import Session

from conftest import one_database
from prefect_spotgpu.service.db import MIGRATIONS, make_engine, migrate
from prefect_spotgpu.service.models import (
    AllocationRow,
    ApiKey,
    ArchivedCharges,
    Base,
    BidRow,
    EventRow,
    ImageRow,
    LedgerEntry,
    MarketChange,
    NodeReport,
    NodeRow,
    PoolQuoteRow,
    PriceBar,
    Tenant,
    TickLeader,
    WebhookDelivery,
)
from prefect_spotgpu.service.sealing import Sealer, new_key, seal_job, seal_secret


def _config(connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def test_the_migrations_build_the_models_schema(db_url):
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "compare_server_default": False}
            )
            diff = compare_metadata(context, Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_the_capacity_migration_goes_down_and_up_keeping_spot_rows(db_url):
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    "INSERT INTO tenants (name, credits_micros, spent_micros, created_at) "
                    "VALUES ('t', 10000000, 0, CURRENT_TIMESTAMP)"
                )
            )
            tenant = connection.execute(sa.text("SELECT id FROM tenants")).scalar_one()
            connection.execute(
                sa.text(
                    "INSERT INTO bids (tenant_id, gpu_model, region, gpu_count, max_price, "
                    "capacity, status, created_at, updated_at) VALUES (:t, 'A100-80G', 'any', "
                    "1, 1.2, 'spot', 'open', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                {"t": tenant},
            )
        with engine.begin() as connection:
            command.downgrade(_config(connection), "0002")
        with engine.begin() as connection:
            command.upgrade(_config(connection), "head")
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT capacity, max_price FROM bids")).all()
        assert [tuple(r) for r in rows] == [("spot", 1.2)]  # old rows read as spot
    finally:
        engine.dispose()


def test_the_money_migration_turns_floats_into_micros_whose_totals_agree(db_url):
    """0004 -> 0005 on float data: each amount to the nearest micro, and each tenant's totals
    set to the exact sums of its entries and its allocations' charges."""
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            command.upgrade(_config(connection), "0004")
        with engine.begin() as connection:
            run = connection.execute
            run(
                sa.text(
                    "INSERT INTO tenants (id, name, credits, spent, provider, created_at) VALUES "
                    "(1, 'buyer', 10.1, 0.30000000000000004, false, CURRENT_TIMESTAMP), "
                    "(2, 'owner', 0, 0, true, CURRENT_TIMESTAMP)"
                )
            )
            run(
                sa.text(
                    "INSERT INTO ledger_entries (tenant_id, kind, amount, reason, created_at) "
                    "VALUES (1, 'starting_credit', 10, 's', CURRENT_TIMESTAMP), "
                    "(1, 'credit', 0.1, 'c', CURRENT_TIMESTAMP)"
                )
            )
            run(
                sa.text(
                    "INSERT INTO nodes (id, owner_id, name, gpu_model, region, gpu_count, "
                    "reserve_price, capacity, state, token_hash, declared, "
                    "last_heartbeat_at, created_at) VALUES (1, 2, 'n', 'A100-80G', 'eu-west', "
                    "8, 0.9, 'spot', 'live', 'h', false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            run(
                sa.text(
                    "INSERT INTO bids (id, tenant_id, gpu_model, region, gpu_count, max_price, "
                    "capacity, status, created_at, updated_at) VALUES (1, 1, 'A100-80G', "
                    "'eu-west', 1, 1.2, 'spot', 'open', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            for alloc_id, amount in ((1, 0.1), (2, 0.2)):
                run(
                    sa.text(
                        "INSERT INTO allocations (id, bid_id, node_id, tenant_id, gpu_count, "
                        "status, epoch, kind, started_at, charged_until, price, charged_amount, "
                        "charged_seconds, paid_at_checkpoint) VALUES (:id, 1, 1, 1, 1, "
                        "'finished', 1, 'new', 0, 1, 0.9, :amount, 1, :amount)"
                    ),
                    {"id": alloc_id, "amount": amount},
                )
        with engine.begin() as connection:
            command.upgrade(_config(connection), "head")
        with engine.connect() as connection:
            tenant = connection.execute(
                sa.text("SELECT credits_micros, spent_micros FROM tenants WHERE id = 1")
            ).one()
            charged = connection.execute(
                sa.text("SELECT charged_micros, paid_at_checkpoint_micros FROM allocations")
            ).all()
            entries = connection.execute(sa.text("SELECT amount_micros FROM ledger_entries")).all()
        assert sorted(tuple(r) for r in charged) == [(100_000, 100_000), (200_000, 200_000)]
        assert sorted(r[0] for r in entries) == [100_000, 10_000_000]
        assert tuple(tenant) == (10_100_000, 300_000)  # exact sums, not the float totals
        with engine.begin() as connection:
            command.downgrade(_config(connection), "0004")
        with engine.connect() as connection:
            back = connection.execute(sa.text("SELECT credits, spent FROM tenants WHERE id = 1"))
            assert tuple(back.one()) == (10.1, 0.3)
    finally:
        engine.dispose()


def test_the_sealed_secrets_migration_keeps_plaintext_for_the_start_to_seal(db_url):
    """0007 -> 0008 widens ``tenants.webhook_secret`` for a sealed value and keeps the
    plaintext ones (a migration has no key); the service's start seals them, once; down again,
    sealed secrets (no key opens them) are cleared and plaintext ones kept."""
    from sqlalchemy.orm import Session

    from prefect_spotgpu.service.sealing import (
        SEALED,
        Sealer,
        new_key,
        open_secret,
        seal_plaintext_webhook_secrets,
    )

    plain, longest = "a-webhook-secret-of-some-length", "é" * 200  # 200 characters, 400 bytes
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            command.upgrade(_config(connection), "0007")
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    "INSERT INTO tenants (id, name, credits_micros, spent_micros, webhook_secret, "
                    "created_at) VALUES (1, 'a', 0, 0, :a, CURRENT_TIMESTAMP), "
                    "(2, 'b', 0, 0, :b, CURRENT_TIMESTAMP), (3, 'c', 0, 0, NULL, CURRENT_TIMESTAMP)"
                ),
                {"a": plain, "b": longest},
            )
        with engine.begin() as connection:
            command.upgrade(_config(connection), "head")

        def secrets() -> dict[int, str | None]:
            with engine.connect() as connection:
                rows = connection.execute(sa.text("SELECT id, webhook_secret FROM tenants"))
                return dict(rows.all())

        assert secrets() == {1: plain, 2: longest, 3: None}
        sealer = Sealer(new_key())
        with Session(engine) as session, session.begin():
            assert seal_plaintext_webhook_secrets(session=session, sealer=sealer) == 2
        sealed = secrets()
        assert sealed[3] is None and all(sealed[i].startswith(SEALED) for i in (1, 2))
        assert len(sealed[2]) > 200  # what the old VARCHAR(200) could not hold
        assert [open_secret(sealed[i], sealer) for i in (1, 2)] == [plain, longest]
        with Session(engine) as session, session.begin():  # idempotent: a sealed value stays
            assert seal_plaintext_webhook_secrets(session=session, sealer=sealer) == 0
        assert secrets() == sealed
        with engine.begin() as connection:
            connection.execute(
                sa.text("UPDATE tenants SET webhook_secret = :a WHERE id = 3"), {"a": plain}
            )
        with engine.begin() as connection:
            command.downgrade(_config(connection), "0007")
        assert secrets() == {1: None, 2: None, 3: plain}
        with engine.begin() as connection:
            command.upgrade(_config(connection), "head")
        assert secrets() == {1: None, 2: None, 3: plain}
    finally:
        engine.dispose()


def test_the_runs_flows_migration_marks_the_seeded_bases_command_only_and_the_rest_flows(db_url):
    """0011 -> 0012: the six seeded bases hold no prefect-spotgpu (command only); an entry an
    operator added was, as the documentation asked, a job image (it runs flows)."""
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with engine.begin() as connection:
            command.downgrade(_config(connection), "0011")
            connection.execute(
                sa.text(
                    "INSERT INTO images (name, reference, framework, description, created_at, "
                    "updated_at) VALUES ('train', 'registry.example.com/me/train:1', 'PyTorch', "
                    "'', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            connection.execute(  # a seeded name replaced by the operator's job image
                sa.text(
                    "UPDATE images SET reference = 'registry.example.com/me/pt:1' "
                    "WHERE name = 'pytorch-devel'"
                )
            )
        with engine.begin() as connection:
            command.upgrade(_config(connection), "head")
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT name, runs_flows FROM images")).all()
        flows = sorted(name for name, runs_flows in rows if runs_flows)
        assert flows == ["pytorch-devel", "train"]
        assert len(rows) == 7
    finally:
        engine.dispose()


# ---------------------------------------------------------------- rollback: every downgrade

ROLLBACK_PAGE = Path(__file__).resolve().parents[1] / "docs" / "operators" / "backup-and-upgrade.md"


def documented_losses() -> dict[str, set[str]]:
    """What the rollback page says each downgrade drops, by revision: ``table.column`` (its
    values) or ``table`` (rows of it), as its table's rows name them in backticks."""
    section = ROLLBACK_PAGE.read_text().split("## Rolling back an upgrade", 1)[1]
    section = section.split("\n## ", 1)[0]
    losses = {}
    for line in section.splitlines():
        if match := re.match(r"\|\s*(\d{4})\b[^|]*\|(.*)\|\s*$", line):
            losses[match[1]] = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)?)`", match[2]))
    return losses


def revisions() -> list[tuple[str, str | None]]:
    """(revision, the one before it), newest first."""
    scripts = ScriptDirectory.from_config(_config(None))
    return [(s.revision, s.down_revision) for s in scripts.walk_revisions()]


def a_market(session: Session) -> None:
    """A market at this version's schema with a row in every table and, in every column a
    downgrade drops, a value other than what the upgrade puts back."""
    now = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    sealer = Sealer(new_key())
    buyer = Tenant(
        name="buyer",
        credits_micros=10_000_000,
        spent_micros=3_200_000,  # its allocation's 2.5 and the 0.7 retention archived
        webhook_url="https://hooks.example.com/spot",
        webhook_secret=seal_secret("a-webhook-secret-of-some-length", sealer),
        provider=False,
        created_at=now,
    )
    owner = Tenant(name="owner", credits_micros=0, spent_micros=0, provider=True, created_at=now)
    vetted = Tenant(name="vetted", credits_micros=0, spent_micros=0, provider=True, created_at=now)
    session.add_all([buyer, owner, vetted])
    session.flush()
    session.add_all(
        [
            ApiKey(tenant_id=buyer.id, key_hash="a" * 64, prefix="sgk_a", created_at=now),
            ApiKey(
                tenant_id=buyer.id,
                key_hash="b" * 64,
                prefix="sgk_b",
                created_at=now,
                revoked_at=now,
            ),
            LedgerEntry(
                tenant_id=buyer.id,
                kind="starting_credit",
                amount_micros=10_000_000,
                reason="starting credit",
                created_at=now,
            ),
            ArchivedCharges(
                tenant_id=buyer.id, allocations=3, charged_micros=700_000, charged_seconds=30.0
            ),
        ]
    )
    common = {"gpu_model": "A100-80G", "region": "eu-west", "last_heartbeat_at": now}
    node = NodeRow(
        **common,
        owner_id=owner.id,
        name="docker-1",
        gpu_count=8,
        reserve_price=0.9,
        capacity="spot",
        state="lost",
        state_before_loss="reclaimed",
        token_hash="c" * 64,
        declared=True,
        inventory={"gpus": 8},
        telemetry={"load": 0.5},
        images=["registry.example.com/me/job:1"],
        runner="docker",
        default_image="registry.example.com/me/job:1",
        address="10.0.0.11",
        job_subnet="10.88.1.0/24",
        created_at=now,
    )
    on_demand = NodeRow(
        **common,
        owner_id=owner.id,
        name="od-1",
        gpu_count=8,
        reserve_price=0.0,
        capacity="on_demand",
        state="live",
        token_hash="d" * 64,
        declared=False,
        created_at=now,
    )
    session.add_all([node, on_demand])
    terms = {"tenant_id": buyer.id, "gpu_model": "A100-80G", "region": "eu-west"}
    terms |= {"max_price": 1.2, "created_at": now, "updated_at": now}
    spec, sealed = seal_job({"command": ["python", "train.py"], "env": {"TOKEN": "t"}}, sealer)
    running = BidRow(**terms, gpu_count=4, status="open", job=spec, job_env_sealed=sealed)
    gang = [BidRow(**terms, gpu_count=8, status="open", node_count=2, min_node_count=1)]
    gang.append(BidRow(**terms, gpu_count=8, status="open", node_count=2, min_node_count=1))
    waiting_on_demand = BidRow(**terms, gpu_count=1, capacity="on_demand", status="open")
    done_on_demand = BidRow(**terms, gpu_count=1, capacity="on_demand", status="finished")
    session.add_all([running, *gang, waiting_on_demand, done_on_demand])
    session.flush()
    for member in gang:
        member.gang_id = gang[0].id
    allocation = AllocationRow(
        id=1,
        bid_id=running.id,
        node_id=node.id,
        tenant_id=buyer.id,
        gpu_count=4,
        status="running",
        epoch=1,
        kind="new",
        started_at=1000.0,
        charged_until=1100.0,
        price=0.9,
        charged_micros=2_500_000,
        charge_carry=123,
        charged_seconds=100.0,
        notice_fee_micros=50_000,
        paid_at_checkpoint_micros=1_000_000,  # (no checkpoint time: 0004 puts 0 back)
        job_address="10.88.1.2",
    )
    session.add(allocation)
    session.flush()
    event = EventRow(
        tenant_id=buyer.id,
        bid_id=running.id,
        node_id=node.id,
        allocation_id=1,
        kind="allocated",
        payload={"event": "allocated", "bid_id": running.id},
        created_at=now,
    )
    session.add(event)
    session.flush()
    minute = int(now.timestamp()) // 60
    session.add_all(
        [
            NodeReport(
                node_id=node.id,
                allocation_id=1,
                epoch=1,
                outcome="saved",
                checkpoint_at=1050.0,
                step=1200,
                status_code=200,
                created_at=now,
            ),
            ImageRow(
                name="render",
                reference="registry.example.com/me/render:1",
                framework="Blender",
                description="a command-only image an operator added",
                runs_flows=False,
                created_at=now,
                updated_at=now,
            ),
            WebhookDelivery(
                tenant_id=buyer.id,
                event_id=event.id,
                url=buyer.webhook_url,
                status="delivered",
                attempts=1,
                last_status_code=204,
                next_attempt_at=0.0,
                updated_at=now,
            ),
            PriceBar(
                gpu_model="A100-80G",
                region="eu-west",
                minute=minute - minute % 60,
                open=0.9,
                high=1.1,
                low=0.8,
                close=1.0,
                seconds=3600,  # an hour retention folded
            ),
            MarketChange(entity="bid", entity_id=running.id, op="create", data=None),
            PoolQuoteRow(
                gpu_model="A100-80G",
                region="eu-west",
                capacity="spot",
                clearing_price=1.0,
                reserve_price=0.9,
                gpus_total=8,
                gpus_free=4,
                gpus_running=4,
                waiting_bids=2,
                updated_at=1100.0,
            ),
            TickLeader(id=1, epoch=3, holder="replica-1", heartbeat_at=1100.0),
        ]
    )


def dump(engine) -> dict[str, dict[tuple, dict]]:
    """Every row of every table (Alembic's own aside), by table and primary key."""
    tables = {}
    with engine.connect() as connection:
        metadata = sa.MetaData()
        metadata.reflect(connection)
        for name, table in metadata.tables.items():
            if name == "alembic_version":
                continue
            key = [c.name for c in table.primary_key.columns]
            rows = connection.execute(sa.select(table)).mappings().all()
            tables[name] = {tuple(row[k] for k in key): dict(row) for row in rows}
    return tables


def changed(before: dict, after: dict) -> set[str]:
    """What differs: ``table`` where rows went, ``table.column`` where values did."""
    found = set()
    for table, rows in before.items():
        if table not in after:
            found.add(table)
            continue
        if rows.keys() - after[table].keys():
            found.add(table)
        for key in rows.keys() & after[table].keys():
            for column, value in rows[key].items():
                if after[table][key].get(column) != value:
                    found.add(f"{table}.{column}")
    return found


def within(found: set[str], documented: set[str]) -> set[str]:
    """``found`` less what ``documented`` covers (a table named whole covers its columns)."""
    return {f for f in found if f not in documented and f.split(".")[0] not in documented}


def test_each_recent_downgrade_drops_only_what_the_rollback_page_says(db_url):
    """From this version with a market in it, each of the newest downgrades down to 0011's, one
    more each time, then back up: the rows still read (the models' schema, every row kept),
    and what changed is what the rollback page lists for those downgrades, neither less nor
    more."""
    losses = documented_losses()
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with Session(engine) as session, session.begin():
            a_market(session)
        original = dump(engine)
        documented: set[str] = set()
        for revision, before in revisions():
            if revision < "0011":
                break
            assert revision in losses, f"the rollback page does not list {revision}"
            documented |= losses[revision]
            with engine.begin() as connection:
                command.downgrade(_config(connection), before)
            with engine.begin() as connection:
                command.upgrade(_config(connection), "head")
            found = changed(original, dump(engine))
            assert within(found, documented) == set(), f"down to {before}: not on the page"
            assert within(documented, found) == set(), f"down to {before}: not dropped"
        assert_reads_as_the_models(engine)
    finally:
        engine.dispose()


def test_every_downgrade_goes_down_one_step_at_a_time_and_back_up_with_a_market(db_url):
    """Down to the first revision one step at a time: every table that stays keeps its rows
    (but where the page says a downgrade drops some); then up again: the rows read as the
    models say, having lost exactly what the page lists for all the downgrades."""
    losses = documented_losses()
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with Session(engine) as session, session.begin():
            a_market(session)
        original = dump(engine)
        counts = {table: len(rows) for table, rows in original.items()}
        documented: set[str] = set()
        for revision, before in revisions():
            if before is None:
                break
            with engine.begin() as connection:
                command.downgrade(_config(connection), before)
            with engine.connect() as connection:
                assert MigrationContext.configure(connection).get_current_revision() == before
            now = {table: len(rows) for table, rows in dump(engine).items()}
            for table in now.keys() & counts.keys():
                if table not in losses[revision]:
                    assert now[table] == counts[table], f"down to {before}: {table} lost rows"
            counts, documented = now, documented | losses[revision]
        assert set(losses) == {revision for revision, before in revisions() if before}
        with engine.begin() as connection:
            command.upgrade(_config(connection), "head")
        found = changed(original, dump(engine))
        assert within(found, documented) == set() and within(documented, found) == set()
        assert_reads_as_the_models(engine)
    finally:
        engine.dispose()


def assert_reads_as_the_models(engine) -> None:
    """The schema is the models' and every row of every model loads."""
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "compare_server_default": False}
        )
        assert compare_metadata(context, Base.metadata) == []
    with Session(engine) as session:
        for mapper in Base.registry.mappers:
            assert session.scalars(sa.select(mapper.class_)).all() is not None
        assert session.scalar(sa.select(Tenant).where(Tenant.name == "buyer")).balance > 0


def documented_rollback(config: Path) -> list[str]:
    """The rollback page's commands, run here: its two-line configuration written to
    ``config``; its ``alembic ... downgrade`` command line, less the revision."""
    section = ROLLBACK_PAGE.read_text().split("## Rolling back an upgrade", 1)[1]
    written = re.search(r"printf '([^']*)'", section)[1]
    config.write_text(written.replace("\\n", "\n"))
    line = re.search(r"/opt/spotgpu/venv/bin/alembic (-c \S+ downgrade) \d{4}\n", section)[1]
    bin_dir = Path(sys.executable).parent
    return [
        str(bin_dir / "alembic"),
        *line.replace("/etc/spotgpu/alembic.ini", str(config)).split(),
    ]


def operator_env(db_url: str, home: Path) -> dict[str, str]:
    """The service's environment file, as ``systemd-run -p EnvironmentFile=`` gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    return {**env, "SPOTGPU_DB_URL": db_url, "SPOTGPU_HOME": str(home)}


def test_the_documented_alembic_downgrade_rolls_back_and_migrate_upgrades_again(db_url, tmp_path):
    engine = make_engine(db_url)
    try:
        migrate(engine)
        with Session(engine) as session, session.begin():
            a_market(session)
        kept = {t: len(rows) for t, rows in dump(engine).items()}
        (head, previous), *_ = revisions()
        env = operator_env(db_url, tmp_path / "home")
        down = [*documented_rollback(tmp_path / "alembic.ini"), previous]
        out = subprocess.run(down, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        with engine.connect() as connection:
            assert MigrationContext.configure(connection).get_current_revision() == previous
        dropped = documented_losses()[head]
        for table, rows in dump(engine).items():
            assert table in dropped or len(rows) == kept[table], table
        up = [sys.executable, "-m", "prefect_spotgpu.cli", "server", "migrate"]
        out = subprocess.run(up, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and f"migrated to {head}" in out.stdout, out.stdout + out.stderr
        assert_reads_as_the_models(engine)
    finally:
        engine.dispose()


@one_database("refused before any database is opened")
def test_the_alembic_command_with_no_market_named_refuses_and_makes_none(db_url, tmp_path):
    """Without the service's environment (no SPOTGPU_DB_URL, a home with no market in it) the
    alembic command must not take a new, empty SQLite market for the operator's."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    env["SPOTGPU_HOME"] = str(home)
    down = [*documented_rollback(tmp_path / "alembic.ini"), "0014"]
    out = subprocess.run(down, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "no market database at" in out.stderr and "SPOTGPU_DB_URL" in out.stderr, out.stderr
    assert not (home / "market.db").exists() and not (home / "market.db.leader").exists()


def test_the_alembic_command_refuses_to_run_while_a_replica_leads(service, tmp_path):
    url = service.app.state.engine.url.render_as_string(hide_password=False)
    (head, previous), *_ = revisions()
    env = operator_env(url, service.app.state.settings.home)
    down = [*documented_rollback(tmp_path / "alembic.ini"), previous]
    out = subprocess.run(down, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "a replica of this market is running" in out.stderr
    with service.app.state.engine.connect() as connection:
        assert MigrationContext.configure(connection).get_current_revision() == head
    assert service.client().get("/health").json()["leader"]
