"""Engines, sessions and migrations. No engine exists at import time: ``make_engine`` makes one
(and a new SQLite database's file, mode 0600)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, text
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
                f"{url.database}`, or name another in SPOTGPU_DB_URL / --db-url-file"
            ) from None
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise DatabaseUnavailable(
            f"cannot open the market's database {url.render_as_string(hide_password=True)}: {first}"
        ) from None


MIGRATION_LOCK = 0x5350_4D49  # PostgreSQL advisory lock: one migrating process at a time


class SchemaBehind(DatabaseUnavailable):
    """The database's schema is not the one this code needs (the message says what to run)."""


@dataclass(frozen=True)
class SchemaStatus:
    """Where the database's schema stands against this code's migrations."""

    current: str | None
    """The database's revision; None: an empty database (no market yet)."""
    head: str
    pending: list[tuple[str, str]]
    """The revisions an upgrade applies, oldest first: (revision, its message)."""
    known: bool
    """Whether this code knows the database's revision (False: a newer version migrated it)."""


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def schema_status(engine: Engine) -> SchemaStatus:
    """The database's revision, this code's head and what lies between."""
    scripts = ScriptDirectory.from_config(_config())
    head = scripts.get_current_head()
    with engine.connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
    known = _known(scripts, current)
    pending = []
    if known:
        for script in scripts.iterate_revisions(head, current):
            pending.append((script.revision, script.doc or ""))
        pending.reverse()
    return SchemaStatus(current=current, head=head, pending=pending, known=known)


def _known(scripts: ScriptDirectory, revision: str | None) -> bool:
    if revision is None:
        return True
    try:
        return scripts.get_revision(revision) is not None
    except Exception:  # alembic: "Can't locate revision"
        return False


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision, one process at a time: on PostgreSQL
    an advisory lock held to the end of the migration's transaction, on a SQLite file a lock
    on a file beside it (the second process then finds nothing to do)."""
    config = _config()
    with _sqlite_lock(engine), engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


@contextlib.contextmanager
def _sqlite_lock(engine: Engine):
    """An exclusive lock on ``<database>.migrate-lock`` for a SQLite file; nothing else."""
    path = sqlite_file(engine.url)
    if path is None:
        yield
        return
    lock = os.open(f"{path}.migrate-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)  # (releases the lock)


def prepare_schema(engine: Engine, *, migrate_existing: bool) -> None:
    """At the service's start: create the schema of an empty database (a new market); upgrade
    an existing one only when ``migrate_existing`` (``spotgpu server start --migrate``, one
    host); otherwise refuse a schema behind or ahead of this code, naming the command. Replicas
    of a market must not each upgrade its schema as they start: the operator runs ``spotgpu
    server migrate`` once (docs/operators/backup-and-upgrade.md)."""
    status = schema_status(engine)
    if not status.known:
        raise SchemaBehind(
            f"the market's database is at revision {status.current}, which this version of "
            f"prefect-spotgpu ({status.head}) does not know: a newer version migrated it. "
            "Upgrade this host's prefect-spotgpu"
        )
    if not status.pending:
        return
    if status.current is None or migrate_existing:
        migrate(engine)
        return
    steps = ", ".join(revision for revision, _ in status.pending)
    raise SchemaBehind(
        f"the market's database is at revision {status.current}; this version needs "
        f"{status.head} ({len(status.pending)} migration(s): {steps}). Run `spotgpu server "
        "migrate` once (`--dry-run` lists them), then start the service"
    )
