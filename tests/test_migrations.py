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
                    "INSERT INTO tenants (name, credits, spent, created_at) "
                    "VALUES ('t', 10, 0, CURRENT_TIMESTAMP)"
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
