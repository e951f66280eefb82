"""Running the service: migrations, the app under uvicorn, a clean stop on SIGTERM/Ctrl-C.

Start-up refuses, in one line naming each path and its ``chmod``, when other users of the host
can reach the market's home, key files or SQLite files (service/at_rest.py)."""

from __future__ import annotations

import logging

import uvicorn

from prefect_spotgpu.service.api import create_app
from prefect_spotgpu.service.at_rest import FilesExposed
from prefect_spotgpu.service.settings import ServiceSettings


def serve(settings: ServiceSettings, log_level: str = "info") -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = create_app(settings)
    except FilesExposed as exc:  # the message, not a traceback; exit status 1
        raise SystemExit(str(exc)) from None
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
