"""``spotgpu server start``: the market service (its API, migrations, the clearing tick and the
webhooks) in this process, until it is stopped."""

from __future__ import annotations

import typer

from prefect_spotgpu.cli.common import console

server_app = typer.Typer(help="Run the market service.", no_args_is_help=True)


@server_app.command("start")
def server_start(
    db: str = typer.Option(
        None,
        "--db",
        envvar="SPOTGPU_DB_URL",
        help="SQLAlchemy URL (default: SQLite in ~/.spotgpu). PostgreSQL: "
        "postgresql+psycopg://user@host/db",
    ),
    host: str = typer.Option("127.0.0.1", envvar="SPOTGPU_HOST", help="Interface to bind."),
    port: int = typer.Option(4300, envvar="SPOTGPU_PORT", min=1, max=65535, help="Port."),
    tick_seconds: float = typer.Option(None, help="Seconds between clearing ticks (1)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Start the market service: API, migrations, the per-second tick and webhooks.

    Run several against one PostgreSQL database for more API capacity: exactly one of them
    leads the tick loop at a time. The admin key is SPOTGPU_ADMIN_KEY, or generated once into
    ~/.spotgpu/admin_key.
    """
    from pydantic import ValidationError

    from prefect_spotgpu.service.server import serve
    from prefect_spotgpu.service.settings import ServiceSettings

    overrides = {"host": host, "port": port}
    if db is not None:
        overrides["db_url"] = db
    if tick_seconds is not None:
        overrides["tick_seconds"] = tick_seconds
    try:
        settings = ServiceSettings(**overrides)
    except ValidationError as exc:
        console.print(f"[red]bad setting[/red]: {exc}")
        raise typer.Exit(2) from None
    console.print(
        f"market service on http://{settings.host}:{settings.port} "
        f"(database: {settings.database_url().split('@')[-1]}); "
        f"API docs at /docs"
    )
    from prefect_spotgpu.service.db import DatabaseUnavailable

    try:
        serve(settings, log_level=log_level)
    except DatabaseUnavailable as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None
