"""Engines, sessions and migrations. No engine exists at import time: ``make_engine`` makes one
(and a new SQLite database's file, mode 0600)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.service.at_rest import create_private_file, sqlite_file

MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL mode, foreign keys and a busy timeout, and a new
    database file is created with mode 0600 before SQLite opens it (its ``-wal`` and ``-shm``
    then get that mode too: service/at_rest.py)."""
    if url.startswith("sqlite"):
        if (path := sqlite_file(url)) is not None:
            create_private_file(path)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # pragma: no cover - trivial
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        # let SQLAlchemy open transactions itself (BEGIN IMMEDIATE: writers queue, never fail)
        @event.listens_for(engine, "connect")
        def _no_autobegin(dbapi_connection, _record):  # pragma: no cover - trivial
            dbapi_connection.isolation_level = None

        @event.listens_for(engine, "begin")
        def _begin_immediate(connection):  # pragma: no cover - trivial
            options = connection.get_execution_options()
            if options.get("isolation_level") == "AUTOCOMMIT":
                return  # a single read (an auth look-up): no transaction, no write lock
            # a reading session (every GET) takes a snapshot and no lock: WAL readers never
            # wait for the tick's writes
            connection.exec_driver_sql("BEGIN" if options.get(READ_ONLY) else "BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


READ_ONLY = "spotgpu_read_only"
"""Execution option of reading sessions: a deferred transaction on SQLite, a READ ONLY one on
PostgreSQL (a write there fails instead of happening)."""


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def make_reading_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions for reads only (the API's GET routes): they never take SQLite's write lock."""
    options = {READ_ONLY: True}
    if engine.dialect.name == "postgresql":
        options["postgresql_readonly"] = True
    return sessionmaker(engine.execution_options(**options), expire_on_commit=False)


class DatabaseUnavailable(RuntimeError):
    """The service's database cannot be reached or does not exist: one line saying what to do."""


def check_database(engine: Engine) -> None:
    """Connect once, or raise :class:`DatabaseUnavailable` naming the database and the fix."""
    url = engine.url
    try:
        with engine.connect():
            pass
    except OperationalError as exc:
        where = f"{url.host or 'localhost'}:{url.port or 5432}"
        text = str(exc.orig or exc)
        if url.get_backend_name() == "postgresql" and "does not exist" in text:
            user = f" -U {url.username}" if url.username else ""
            raise DatabaseUnavailable(
                f'PostgreSQL at {where} has no database "{url.database}": create it with '
                f"`createdb -h {url.host or 'localhost'} -p {url.port or 5432}{user} "
                f"{url.database}`, or name another in --db / SPOTGPU_DB_URL"
            ) from None
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise DatabaseUnavailable(
            f"cannot open the market's database {url.render_as_string(hide_password=True)}: {first}"
        ) from None


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
