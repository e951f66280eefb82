"""``spotgpu server start`` (the market service: its API, the clearing tick and the webhooks, in
this process until it is stopped), ``spotgpu server migrate`` (the database's schema, once
per upgrade: replicas do not migrate as they start; docs/operators/backup-and-upgrade.md) and
``spotgpu server prune`` (rows past their retention, now: service/retention.py).

The database URL comes from ``SPOTGPU_DB_URL`` or a file (``--db-url-file``): a URL with a
password on the command line would be readable by every user of the host (``ps``)."""

from __future__ import annotations

from pathlib import Path

import typer

from prefect_spotgpu.cli.common import console

server_app = typer.Typer(help="Run the market service.", no_args_is_help=True)

DB = typer.Option(
    None,
    "--db",
    envvar="SPOTGPU_DB_URL",
    help="SQLAlchemy URL (default: SQLite in $SPOTGPU_HOME, ~/.spotgpu unless set). PostgreSQL: "
    "postgresql+psycopg://user@host/db. One with a password: from SPOTGPU_DB_URL or "
    "--db-url-file, never the command line.",
    show_envvar=True,
)
DB_URL_FILE = typer.Option(
    None,
    "--db-url-file",
    help="A file holding the database URL (e.g. /etc/spotgpu/db-url, mode 0600).",
    exists=True,
    dir_okay=False,
    readable=True,
)


def database_url(db: str | None, db_url_file: Path | None) -> str | None:
    """The URL from ``--db``/``SPOTGPU_DB_URL`` or ``--db-url-file`` (one of them); a
    password given as ``--db`` on the command line is refused."""
    import os

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if db_url_file is not None:
        if db is not None and os.environ.get("SPOTGPU_DB_URL") != db:
            console.print("[red]give --db or --db-url-file, not both[/red]")
            raise typer.Exit(2)
        if db_url_file.stat().st_mode & 0o004:
            console.print(
                f"[red]{db_url_file} is readable by every user of this host[/red]: "
                f"chmod o-r {db_url_file} (it may hold the database's password)"
            )
            raise typer.Exit(2)
        db = db_url_file.read_text().strip()
        if not db:
            console.print(f"[red]{db_url_file} is empty[/red]: it must hold the database URL")
            raise typer.Exit(2)
        return db
    if db is not None and os.environ.get("SPOTGPU_DB_URL") != db:  # from argv
        try:
            url = make_url(db)
            password = url.password or url.query.get("password")
        except ArgumentError:
            password = None  # the settings name the bad URL
        if password:
            console.print(
                "[red]--db carries a password[/red], which every user of this host can read "
                "in the process list: put the URL in SPOTGPU_DB_URL or in a file "
                "(--db-url-file, mode 0600)"
            )
            raise typer.Exit(2)
    return db


def service_settings(**overrides):
    from pydantic import ValidationError

    from prefect_spotgpu.service.settings import ServiceSettings

    try:
        return ServiceSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:  # each field and why, never the value (a URL's password)
        why = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        console.print(f"[red]bad setting[/red]: {why}", markup=False)
        raise typer.Exit(2) from None


def shown(url: str) -> str:
    """A database URL fit to print: no password, no query (it may carry one)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(query={}).render_as_string(hide_password=True)


def market_at_head(settings, doing: str):
    """The engine of the market ``settings`` name, for an offline command that is ``doing``
    something to it (``prune``, ``re-seal``): refused, exit 1 with what to do, when that market
    is not there (a SQLite file missing: never made here), holds no schema, or is not at this
    version's revision. The caller disposes of the engine."""
    from prefect_spotgpu.service.at_rest import sqlite_file
    from prefect_spotgpu.service.db import (
        DatabaseUnavailable,
        check_database,
        make_engine,
        schema_status,
    )

    where = shown(settings.database_url())

    def refuse(message: str):
        console.print(message, style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1)

    if (path := sqlite_file(settings.database_url())) is not None and not path.exists():
        refuse(f"{where} does not exist: no market there (is SPOTGPU_HOME the service's?)")
    engine = make_engine(settings.database_url())
    try:
        check_database(engine)
        status = schema_status(engine)
    except DatabaseUnavailable as exc:
        engine.dispose()
        refuse(str(exc))
    if status.current is None:
        engine.dispose()
        refuse(f"{where} holds no market (no schema): nothing to {doing}")
    if not status.known or status.pending:
        engine.dispose()
        refuse(
            f"{where} is at revision {status.current}, this version needs {status.head}: run "
            "`spotgpu server migrate` first (or use the prefect-spotgpu that migrated it)"
        )
    return engine


@server_app.command("start")
def server_start(
    db: str = DB,
    db_url_file: Path = DB_URL_FILE,
    host: str = typer.Option("127.0.0.1", envvar="SPOTGPU_HOST", help="Interface to bind."),
    port: int = typer.Option(4300, envvar="SPOTGPU_PORT", min=1, max=65535, help="Port."),
    tick_seconds: float = typer.Option(None, help="Seconds between clearing ticks (1)."),
    migrate: bool = typer.Option(
        None,
        "--migrate/--no-migrate",
        help="Upgrade an existing database's schema at start (a single host; "
        "SPOTGPU_MIGRATE_AT_START). Off: run `spotgpu server migrate` once per upgrade.",
    ),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Start the market service: API, the per-second tick and webhooks.

    Run several against one PostgreSQL database for more API capacity: exactly one of them
    leads the tick loop at a time. An empty database gets its schema; one behind this version
    is refused until `spotgpu server migrate` has run. The admin key is SPOTGPU_ADMIN_KEY, or
    generated once into $SPOTGPU_HOME/admin_key.
    """
    settings = service_settings(
        db_url=database_url(db, db_url_file),
        host=host,
        port=port,
        tick_seconds=tick_seconds,
        migrate_at_start=migrate,
    )
    console.print(
        f"market service on http://{settings.host}:{settings.port} "
        f"(database: {shown(settings.database_url())}); "
        f"API docs at /docs"
    )
    from prefect_spotgpu.service.db import DatabaseUnavailable
    from prefect_spotgpu.service.server import serve

    try:
        serve(settings, log_level=log_level)
    except DatabaseUnavailable as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None


@server_app.command("migrate")
def server_migrate(
    db: str = DB,
    db_url_file: Path = DB_URL_FILE,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Only list the migrations an upgrade would apply."
    ),
) -> None:
    """Upgrade the market database's schema to this version's (once per upgrade, before the
    replicas start; safe to run again: nothing to do is not an error)."""
    from prefect_spotgpu.service.db import (
        DatabaseUnavailable,
        check_database,
        make_engine,
        migrate,
        schema_status,
    )

    settings = service_settings(db_url=database_url(db, db_url_file))
    engine = make_engine(settings.database_url())
    try:
        check_database(engine)
        status = schema_status(engine)
        where = shown(settings.database_url())
        if not status.known:
            console.print(
                f"[red]{where} is at revision {status.current}[/red], which this version "
                f"({status.head}) does not know: a newer prefect-spotgpu migrated it"
            )
            raise typer.Exit(1)
        console.print(
            f"{where}: revision {status.current or '(empty)'}, this version {status.head}"
        )
        for revision, message in status.pending:
            console.print(f"  {revision}  {message.strip()}", markup=False, soft_wrap=True)
        if not status.pending:
            console.print("up to date: nothing to migrate")
            return
        if dry_run:
            console.print(f"dry run: {len(status.pending)} migration(s) would be applied")
            return
        migrate(engine)
        console.print(f"migrated to {schema_status(engine).current}")
    except DatabaseUnavailable as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()


@server_app.command("prune")
def server_prune(
    db: str = DB,
    db_url_file: Path = DB_URL_FILE,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Only count, per table, what would be removed or downsampled."
    ),
) -> None:
    """Remove the market's rows past their retention (SPOTGPU_RETENTION_*_DAYS), and fold
    minute price bars past theirs into hourly bars. The tick leader does the same every
    SPOTGPU_RETENTION_INTERVAL_SECONDS; this runs it now, to the end, in short batches (safe
    beside running replicas). Ledger entries, bids, live bids' allocations and pending
    webhook deliveries are never removed (docs/operators/retention.md)."""
    from prefect_spotgpu.service.clock import SYSTEM
    from prefect_spotgpu.service.db import (
        DatabaseUnavailable,
        make_reading_sessionmaker,
        make_sessionmaker,
    )
    from prefect_spotgpu.service.retention import count_prunable, prune_all
    from prefect_spotgpu.service.retention_rules import RetentionPolicy, cutoffs

    settings = service_settings(db_url=database_url(db, db_url_file))
    policy = RetentionPolicy.from_settings(settings)
    engine = market_at_head(settings, "prune")
    where = shown(settings.database_url())
    try:
        if policy.keeps_everything:
            console.print(
                "every retention is 0 (kept for ever): nothing to prune. Set "
                "SPOTGPU_RETENTION_EVENTS_DAYS and the other SPOTGPU_RETENTION_*_DAYS"
            )
            return
        cut = cutoffs(policy, SYSTEM.time())  # (an operator's command: the wall clock)
        with make_reading_sessionmaker(engine).begin() as session:  # (no write lock)
            counts = count_prunable(session=session, policy=policy, cut=cut)
        if dry_run:
            console.print(_prune_table(counts, None, where))
            console.print("dry run: nothing was removed")
            return
        sessions = make_sessionmaker(engine)
        done = prune_all(sessions=sessions, cut=cut, batch_rows=settings.retention_batch_rows)
        console.print(_prune_table(counts, done, where))
    except DatabaseUnavailable as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()


def _prune_table(counts, done, where: str):
    """Per kind of row: its retention, its cutoff, its rows, and what would go (``done``
    None) or went."""
    from rich.table import Table

    from prefect_spotgpu.service.retention_rules import RowKind

    verb = "would go" if done is None else "removed"
    table = Table(title=f"retention of {where}", title_justify="left")
    for name in ("what", "kept", "older than", "rows", verb, "note"):
        table.add_column(name, justify="right" if name in ("rows", verb) else "left")
    for count in counts:
        if done is None:
            going, made = count.going, count.made
        else:
            going, made = done[count.kind].removed, done[count.kind].made
        note = ""
        if count.kind is RowKind.MINUTE_BARS and (going or made):
            note = f"into {made:,} hourly bars"
        elif count.kind is RowKind.ENDED_ALLOCATIONS:
            note = "charges kept in archived_charges"
        elif count.kind is RowKind.WEBHOOK_DELIVERIES:
            note = "pending ones stay"
        kept = "for ever"
        if count.days is not None:
            kept = f"{count.days:g} day" + ("" if count.days == 1 else "s")
        table.add_row(
            str(count.kind),
            kept,
            "-" if count.cutoff is None else count.cutoff.strftime("%Y-%m-%d %H:%M UTC"),
            f"{count.rows:,}",
            f"{going:,}",
            note,
        )
    return table
