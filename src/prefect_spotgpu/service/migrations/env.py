"""Alembic environment. ``db.migrate`` (``spotgpu server migrate``, a new market's start) passes
its connection in. Run by the ``alembic`` command itself, to roll an upgrade back
(docs/operators/backup-and-upgrade.md#rolling-back-an-upgrade), it connects to the market's
database as the service does (``SPOTGPU_DB_URL``, else the SQLite file in ``SPOTGPU_HOME``) and
holds the tick leader's lock while it runs: it refuses to begin while a replica leads."""

from alembic import context

from prefect_spotgpu.service.models import Base


def run_migrations(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_from_the_alembic_command() -> None:
    from prefect_spotgpu.service.db import check_database, make_engine
    from prefect_spotgpu.service.maintenance import ReplicaRunning, maintenance_lock
    from prefect_spotgpu.service.settings import ServiceSettings

    settings = ServiceSettings()
    engine = make_engine(settings.database_url())
    try:
        check_database(engine)
        with maintenance_lock(engine, settings), engine.begin() as connection:
            run_migrations(connection)
    except ReplicaRunning as exc:
        raise SystemExit(f"refused: {exc}") from None
    finally:
        engine.dispose()


if "connection" in context.config.attributes:
    run_migrations(context.config.attributes["connection"])
else:
    run_from_the_alembic_command()
