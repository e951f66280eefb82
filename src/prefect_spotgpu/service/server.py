"""Running the service: migrations, the app under uvicorn, a clean stop on SIGTERM/Ctrl-C.

Start-up refuses, in one line naming each path and its ``chmod``, when other users of the host
can reach the market's home, key files or SQLite files (service/at_rest.py)."""

from __future__ import annotations

import logging

import uvicorn

from prefect_spotgpu.service.api import create_app
from prefect_spotgpu.service.at_rest import FilesExposed
from prefect_spotgpu.service.settings import ServiceSettings

KEEP_ALIVE_SECONDS = 20
"""How long the service keeps an idle connection open: longer than our clients keep one (httpx
drops a pooled connection idle for 5 s). Were the two equal (uvicorn's default is also 5 s), a
client could send its request just as the server closes that connection, and the request
would fail ("Server disconnected without sending a response")."""


def serve(settings: ServiceSettings, log_level: str = "info") -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = create_app(settings)
    except FilesExposed as exc:  # the message, not a traceback; exit status 1
        raise SystemExit(str(exc)) from None
    config = uvicorn_config(app, settings.host, settings.port, log_level)
    uvicorn.Server(config).run()


def uvicorn_config(app, host: str, port: int, log_level: str, **options) -> uvicorn.Config:
    """uvicorn's settings for the service's ``app`` (``options``: more of them)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        **options,
    )
