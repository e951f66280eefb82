"""Running the service: migrations, the app under uvicorn, a clean stop on SIGTERM/Ctrl-C."""

from __future__ import annotations

import logging

import uvicorn

from prefect_spotgpu.service.api import create_app
from prefect_spotgpu.service.settings import ServiceSettings


def serve(settings: ServiceSettings, log_level: str = "info") -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
