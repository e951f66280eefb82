"""Alembic environment. ``db.migrate`` (``spotgpu server migrate``, a new market's start) passes
its connection in. Run by the ``alembic`` command itself, to roll an upgrade back
(docs/operators/backup-and-upgrade.md#rolling-back-an-upgrade), it connects to the market's
database named by the configuration's ``sqlalchemy.url``, else as the service does
(``SPOTGPU_DB_URL``, else the SQLite file in ``SPOTGPU_HOME``, which must exist: never a new,
empty market), and holds the tick leader's lock while it runs: it refuses to begin while a
replica leads."""

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
    url = context.config.get_main_option("sqlalchemy.url") or settings.db_url
    if not url:  # the service's default: the SQLite file in its home, which must be there
        market_db = settings.home / "market.db"
        if not market_db.is_file():
            raise SystemExit(
                f"refused: no market database at {market_db}: set SPOTGPU_DB_URL (or "
                "SPOTGPU_HOME) as the service's environment file does, or sqlalchemy.url in "
                "the alembic configuration"
            )
        url = f"sqlite:///{market_db}"
    engine = make_engine(url)
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
