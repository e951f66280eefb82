"""The Alembic migrations build exactly the schema the models describe, on SQLite and
PostgreSQL, and the newest one goes down and up again with its data."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext

from prefect_spotgpu.service.db import MIGRATIONS, make_engine, migrate
from prefect_spotgpu.service.models import Base


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
