"""Prometheus metrics at ``GET /metrics`` (text exposition format, no auth).

What is measured, and who writes it:

- **Market state** — ``spotgpu_pool_*`` (each pool's clearing and reserve price, GPUs total, free
  and running, waiting bids; labels ``gpu_model``, ``region``, ``capacity``) and
  ``spotgpu_bids{status}`` (open and held bids: held for credit, or because no node serves
  them). Nobody increments these: ``MarketState`` reads them from the database at scrape
  time — the ``pool_quotes`` rows the tick leader writes, and one ``GROUP BY`` over the indexed
  ``bids.status`` — so every replica reports the same values.
- **The tick loop** — ``spotgpu_tick_duration_seconds`` (histogram),
  ``spotgpu_notices_total{reason}`` and ``spotgpu_final_saves_total{outcome}`` (``ok``,
  ``failed``): written only by ``Ticker.tick`` on the leader, after its transaction commits, so a
  tick that fails and is cleared again is not counted twice. A final save is counted when the
  leader applies the agent's ``saved`` / ``save_failed`` report to a noticed allocation (and
  writes its ``final_save``); a report it ignores is not counted.
- **Webhooks** — ``spotgpu_webhook_deliveries_total{outcome}``: one per attempt, written only by
  ``WebhookSender`` after the POST.
- **The API** — ``spotgpu_http_request_duration_seconds{method, route, status}``: written only by
  ``RequestTimer``, the ASGI middleware, from the request's start to its response's start (the
  headers). ``route`` is the route's path template (``/api/v1/bids/{bid_id}``), ``unmatched``
  when no route matched, so the label set stays bounded; ``/metrics`` itself is not timed.
  Long-polls have their own routes, so their seconds never mix with quick calls' buckets.

Counters and histograms live in this process's registry (per app, never the global one): sum
them across replicas. Every replica's market-state gauges are equal; take any one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from prefect_spotgpu.protocol import LIVE_BID_STATUSES, NoticeReason
from prefect_spotgpu.service.gate import FINAL_SAVES
from prefect_spotgpu.service.models import BidRow, PoolQuoteRow

logger = logging.getLogger("prefect_spotgpu.service.metrics")

PATH = "/metrics"
POOL_LABELS = ("gpu_model", "region", "capacity")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
DELIVERY_OUTCOMES = ("ok", "failed")
TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServiceMetrics:
    """One app's metrics: its own registry, the counters and histograms, the scrape."""

    def __init__(self, sessions: sessionmaker[Session] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.tick_seconds = Histogram(
            "spotgpu_tick_duration_seconds",
            "Seconds one successful tick of the clearing loop took (leader only).",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.notices = Counter(
            "spotgpu_notices",
            "Notices issued to running allocations, by reason (leader only).",
            ["reason"],
            registry=self.registry,
        )
        self.final_saves = Counter(
            "spotgpu_final_saves",
            "Final saves reported by node agents after a notice, by outcome (ok, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.webhook_deliveries = Counter(
            "spotgpu_webhook_deliveries",
            "Webhook delivery attempts, by outcome (ok: a 2xx answer; failed: anything else).",
            ["outcome"],
            registry=self.registry,
        )
        self.http_seconds = Histogram(
            "spotgpu_http_request_duration_seconds",
            "Seconds from a request to its response's headers, by method, route template "
            "and status code.",
            ["method", "route", "status"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        for reason in NoticeReason:  # every series exists from the start, at zero
            self.notices.labels(reason=reason.value)
        for outcome in FINAL_SAVES.values():
            self.final_saves.labels(outcome=outcome)
        for outcome in DELIVERY_OUTCOMES:
            self.webhook_deliveries.labels(outcome=outcome)
        if sessions is not None:
            self.registry.register(MarketState(sessions))

    def observe_tick(self, seconds: float, *, notices: Iterable, reports: Iterable[str]) -> None:
        """A committed tick: its duration, its notices, and the agents' reports it applied."""
        self.tick_seconds.observe(seconds)
        for notice in notices:
            self.notices.labels(reason=notice.reason.value).inc()
        for outcome in reports:
            if outcome in FINAL_SAVES:  # the final_save it wrote
                self.final_saves.labels(outcome=FINAL_SAVES[outcome]).inc()

    def observe_delivery(self, ok: bool) -> None:
        self.webhook_deliveries.labels(outcome="ok" if ok else "failed").inc()

    def observe_request(self, scope: dict, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        method = scope["method"] if scope["method"] in METHODS else "other"
        self.http_seconds.labels(method=method, route=route, status=str(status)).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MarketState:
    """A collector that reads the market's state from the database at each scrape."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        try:
            with self.sessions.begin() as session:
                quotes = list(
                    session.scalars(
                        select(PoolQuoteRow).order_by(
                            *(getattr(PoolQuoteRow, c) for c in POOL_LABELS)
                        )
                    )
                )
                bids = dict(
                    session.execute(
                        select(BidRow.status, func.count())
                        .where(BidRow.status.in_([s.value for s in LIVE_BID_STATUSES]))
                        .group_by(BidRow.status)
                    ).all()
                )
        except Exception:
            logger.exception("metrics: the market's state could not be read")
            return
        yield from self._families(quotes, bids)

    @staticmethod
    def _families(quotes=(), bids=None) -> Iterator[Metric]:
        pool = {
            "clearing_price": "The pool's clearing price per GPU-hour (absent: no live node).",
            "reserve_price": "The lowest reserve price among the pool's live nodes, per GPU-hour.",
            "gpus_total": "GPUs the pool's live nodes offer.",
            "gpus_free": "GPUs in the pool that are offered and unallocated.",
            "gpus_running": "GPUs in the pool that run a job.",
            "waiting_bids": "Bids for the pool that wait for GPUs.",
        }
        for column, help_text in pool.items():
            family = GaugeMetricFamily(f"spotgpu_pool_{column}", help_text, labels=POOL_LABELS)
            for quote in quotes:
                value = getattr(quote, column)
                if value is not None:
                    family.add_metric([getattr(quote, c) for c in POOL_LABELS], value)
            yield family
        family = GaugeMetricFamily(
            "spotgpu_bids",
            "Bids that are open or held (out of credit, or no node of their pools can run them), "
            "by status.",
            labels=["status"],
        )
        if bids is not None:
            for status in LIVE_BID_STATUSES:
                family.add_metric([status.value], bids.get(status.value, 0))
        yield family


class RequestTimer:
    """ASGI middleware: times every HTTP request but ``/metrics`` into ``http_seconds``."""

    def __init__(self, app, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == PATH:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        timed = False

        async def send_timed(message) -> None:
            nonlocal timed
            if message["type"] == "http.response.start" and not timed:
                timed = True
                self.metrics.observe_request(
                    scope, message["status"], time.perf_counter() - started
                )
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            if not timed:  # the app raised before answering: the server answers 500
                self.metrics.observe_request(scope, 500, time.perf_counter() - started)


router = APIRouter()


@router.get(PATH, include_in_schema=False)
def scrape(request: Request) -> Response:
    """The metrics in Prometheus' text format (sync: the scrape reads the database)."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
