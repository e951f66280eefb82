"""The app factory: ``create_app`` builds the service as an ASGI app.

It checks the database (and migrates it), that no other user can reach the market's files
(``at_rest``) and the sealing key, and seals what older versions kept in the clear; it judges
every client's version (``versions``: one too old is refused, 426); it adds the middleware
(body limit, request timer, public cache, security headers), keeps the fair shares' state
(``fairness``, ``event_watch``, ``forecasts``), maps domain errors (``errors.ServiceError``;
a 429 with its ``Retry-After``) and request validation errors to JSON, includes every router
of ``routes`` (and ``/metrics``), refuses to start with a route that has no roles
(``roles.check_route_table``), and, with ``background``, runs the tick loop and the webhook
sender in its lifespan.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import threading

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import Engine

import prefect_spotgpu
from prefect_spotgpu.service import credit, crud
from prefect_spotgpu.service.at_rest import check_private_files, sqlite_file
from prefect_spotgpu.service.clock import SYSTEM, Clock, ClockMiddleware
from prefect_spotgpu.service.db import make_reading_sessionmaker, make_sessionmaker
from prefect_spotgpu.service.errors import ServiceError, TooManyRequests
from prefect_spotgpu.service.event_watch import EventWatch
from prefect_spotgpu.service.fairness import FairShares
from prefect_spotgpu.service.forecasts import ForecastCache
from prefect_spotgpu.service.hardening import install_security_headers
from prefect_spotgpu.service.limits import BodyLimit
from prefect_spotgpu.service.public_cache import (
    PublicCache,
    SharedSnapshot,
    declared_query_names,
)
from prefect_spotgpu.service.roles import api_route_contexts, authorize, check_route_table
from prefect_spotgpu.service.routes import (
    access,
    agents,
    allocations,
    bids,
    dashboard,
    forecast,
    health,
    images,
    ledger,
    nodes,
    presence,
    prices,
    tenants,
    webhook,
)
from prefect_spotgpu.service.sealing import Sealer, SealError, seal_plaintext_webhook_secrets
from prefect_spotgpu.service.settings import ServiceSettings
from prefect_spotgpu.service.ticker import Notifier, Ticker
from prefect_spotgpu.service.versions import (
    ClientTooOld,
    SkewLog,
    check_client_version,
    too_old_response,
)
from prefect_spotgpu.service.webhooks import WebhookSender

ROUTES = (
    tenants,
    nodes,
    agents,
    presence,
    bids,
    allocations,
    prices,
    ledger,
    webhook,
    health,
    access,
    images,
    forecast,
)
"""The API's route modules, in the order their routes are matched (then ``/metrics`` and the
dashboard's)."""


def _error_response(request: Request, exc: ServiceError) -> JSONResponse:
    exc.message = _text(exc.message)
    exc.field = None if exc.field is None else _text(exc.field)
    body: dict = {"detail": exc.message}
    if exc.item is not None:
        body["item"] = exc.item  # which item of a batch is refused, as data
    if exc.field is not None:
        body["field"] = exc.field
        if exc.status_code == 422:
            body["detail"] = [
                {"loc": ["body", exc.field], "msg": exc.message, "type": "value_error"}
            ]
    headers = None
    if isinstance(exc, TooManyRequests):  # a caller over its fair share: when to come back
        body["retry_after"] = exc.retry_after
        headers = {"Retry-After": str(exc.retry_after)}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def _text(value: str) -> str:
    """A string that encodes as UTF-8 whatever it holds: a lone surrogate is spelled out
    (``\\ud800``), as the caller sent it."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _safe(value):
    """JSON-safe echo of bad input (NaN, infinities and bytes become strings; lone
    surrogates are escaped)."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {_text(str(k)): _safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if value is None or isinstance(value, int | float | bool):
        return value
    return _text(str(value))


def _echo(loc: tuple, value):
    """What of a bad input goes back in an error: scalars (truncated), never a whole object
    (a bid's body holds its job's environment, secrets included) nor anything under ``env``
    or a webhook's ``secret``."""
    if "env" in loc or "secret" in loc:
        return "<redacted>"
    if isinstance(value, dict | list | tuple):
        return f"<{type(value).__name__}>"
    value = _safe(value)
    return value[:200] if isinstance(value, str) else value


def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [
        {
            "loc": [_safe(part) for part in e.get("loc", ())],
            "msg": _text(e.get("msg", "")),
            "type": e.get("type", ""),
            "input": _echo(tuple(e.get("loc", ())), e.get("input")),
        }
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


def create_app(
    settings: ServiceSettings | None = None,
    engine: Engine | None = None,
    background: bool = True,
    clock: Clock = SYSTEM,
) -> FastAPI:
    """The service as an ASGI app. With ``background``, the app's lifespan runs the tick loop
    (one leader among replicas) and the webhook sender. ``clock``: the time its ticks and
    routes read (``service/clock.py``; a test's ``ManualClock``)."""
    from prefect_spotgpu.service import metrics as service_metrics
    from prefect_spotgpu.service.db import check_database, make_engine, prepare_schema

    settings = settings or ServiceSettings()
    sealer = Sealer(settings.resolved_secret_key())
    own_engine = engine is None
    engine = engine or make_engine(settings.database_url())
    sessions = make_sessionmaker(engine)
    notifier = Notifier()
    metrics = service_metrics.ServiceMetrics(make_reading_sessionmaker(engine))  # scrapes read
    threads: list[threading.Thread] = []
    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if background and settings.run_ticker:
            ticker = Ticker(settings, engine, sessions, notifier, metrics, clock=clock)
            app.state.ticker = ticker
            sender = WebhookSender(
                settings, sessions, metrics, reads=make_reading_sessionmaker(engine), sealer=sealer
            )
            # what start-up allocated lives for good: out of the collector's full passes,
            # which otherwise stall the tick thread (holding the GIL) under many readers
            gc.collect()
            gc.freeze()
            for target, name in ((ticker.run, "spotgpu-ticker"), (sender.run, "spotgpu-webhooks")):
                thread = threading.Thread(target=target, args=(stop,), name=name, daemon=True)
                thread.start()
                threads.append(thread)
        yield
        stop.set()
        app.state.event_watch.stop()
        for thread in threads:
            thread.join(timeout=10)
        if own_engine:
            engine.dispose()

    # FilesExposed: the home, a key file or the SQLite files are open to other users (judged
    # before SQLite opens the database and gives a new -wal or -shm the database's mode)
    check_private_files(home=settings.home, database=sqlite_file(engine.url))
    check_database(engine)  # one line naming the database and the fix, not a traceback
    prepare_schema(engine, migrate_existing=settings.migrate_at_start)
    with sessions.begin() as session:
        try:
            crud.check_sealing_key(session=session, sealer=sealer)
        except SealError:
            raise RuntimeError(
                "this replica's secret key does not open the job environments and webhook "
                "secrets this market has sealed: give every replica the same SPOTGPU_SECRET_KEY"
            ) from None
        crud.seal_plaintext_jobs(session=session, sealer=sealer)
        seal_plaintext_webhook_secrets(session=session, sealer=sealer)
    app = FastAPI(
        # every route's roles (service/roles.py), then the client's version (versions.py)
        dependencies=[Depends(authorize), Depends(check_client_version)],
        title="prefect-spotgpu market",
        version=prefect_spotgpu.__version__,
        description="A spot market for idle GPUs: tenants bid, node agents serve, the market "
        "clears every second and bills per second.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.reads = make_reading_sessionmaker(engine)
    app.state.notifier = notifier
    app.state.metrics = metrics
    app.state.ticker = None
    app.state.admin_key = settings.resolved_admin_key()
    app.state.sealer = sealer
    app.state.market_version = prefect_spotgpu.__version__  # what clients are judged by
    app.state.skew_log = SkewLog()  # a skew logged once per node or tenant and kind
    # fair shares: caps and buckets, one event watcher, forecasts per bar, one stream read
    app.state.fair_shares = FairShares.from_settings(settings)
    app.state.event_watch = EventWatch(
        engine=engine,
        notifier=notifier,
        leading=lambda: app.state.ticker is not None and app.state.ticker.epoch is not None,
    )
    app.state.forecasts = ForecastCache()
    app.state.stream_snapshot = SharedSnapshot(seconds=1.0)
    app.state.bid_limits = credit.BidLimits.from_settings(settings)
    app.add_exception_handler(ServiceError, _error_response)
    app.add_exception_handler(ClientTooOld, too_old_response)  # 426: its versions as data
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_middleware(  # inside the timer: hits are counted and timed too
        PublicCache,
        seconds=settings.public_cache_seconds,
        versions=lambda: (notifier.version, notifier.market_version),
        query_names=functools.cache(lambda: declared_query_names(api_route_contexts(app))),
    )
    app.add_middleware(service_metrics.RequestTimer, metrics=metrics)
    for routes in ROUTES:
        app.include_router(routes.router)
    app.include_router(service_metrics.router)
    app.include_router(dashboard.router)
    if clock is not SYSTEM:  # (a request's time is the system's unless told otherwise)
        app.add_middleware(ClockMiddleware, clock=clock)
    app.add_middleware(BodyLimit)  # a huge body is refused before anything reads it
    install_security_headers(app)  # outermost: on every answer, the body limit's 413 too
    check_route_table(app)
    return app
