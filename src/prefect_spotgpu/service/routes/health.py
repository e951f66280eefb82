"""The health route, public: the service is up, its version, and whether this replica leads
the tick loop (with its tick count and the last tick's duration). ``/metrics`` is
``service.metrics``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request

import prefect_spotgpu
from prefect_spotgpu.protocol import MarketTerms
from prefect_spotgpu.service.routes.params import API
from prefect_spotgpu.service.ticker import Ticker

router = APIRouter(prefix=API, tags=["service"])


@router.get(
    "/market",
    response_model=MarketTerms,
    summary="The market's terms for its clients: notice, hysteresis, tick, warm replacement",
)
def market_terms(request: Request) -> MarketTerms:
    settings = request.app.state.settings
    return MarketTerms(
        notice_seconds=settings.notice_seconds,
        hysteresis=settings.hysteresis,
        tick_seconds=settings.tick_seconds,
        warm_replacement=settings.warm_replacement,
    )


@router.get("/health", summary="Liveness, and whether this replica ticks")
def health(request: Request):
    ticker: Ticker | None = request.app.state.ticker
    return {
        "status": "ok",
        "version": prefect_spotgpu.__version__,
        "leader": bool(ticker and ticker.epoch is not None),
        "ticks": ticker.ticks if ticker else 0,
        "last_tick_seconds": ticker.tick_seconds_last if ticker else None,
    }
