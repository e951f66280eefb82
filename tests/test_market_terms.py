"""The market publishes the terms its clients need (``GET /api/v1/market``), and the worker reads
them instead of copying the operator's settings: the real service over HTTP."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import httpx

from conftest import start_service
from helpers import bid
from prefect_spotgpu.protocol import MarketTerms
from prefect_spotgpu.worker.market_api import MarketApi
from prefect_spotgpu.worker.reactions import Settings, window_over


def test_the_worker_reads_the_markets_notice_and_hysteresis(tmp_path):
    db = f"sqlite:///{tmp_path / 'market.db'}"
    service = start_service(
        db, tmp_path / "home", notice_seconds=120, hysteresis=0.1, warm_replacement=False
    )
    try:
        anonymous = httpx.get(f"{service.base_url}/api/v1/market")  # public: no key
        assert anonymous.status_code == 200
        assert anonymous.json() == {
            "notice_seconds": 120.0,
            "hysteresis": 0.1,
            "tick_seconds": 0.1,
            "warm_replacement": False,
        }

        async def read() -> MarketTerms:
            async with httpx.AsyncClient(base_url=f"{service.base_url}/api/v1") as http:
                return await MarketApi(http).terms()

        terms = asyncio.run(read())
    finally:
        service.stop()
    assert terms == MarketTerms(120.0, 0.1, 0.1, False)

    class Configuration:  # the three job variables the rules read
        max_preemptions, cheap_window_only, timezone = 3, True, "UTC"

    settings = Settings.of(Configuration(), terms)
    assert settings.notice_seconds == 120
    now = datetime(2026, 12, 7, 8, 57, tzinfo=UTC)  # a window that closes in 150 s
    closing = bid(window_start=now - timedelta(hours=1), window_end=now + timedelta(seconds=150))
    assert not window_over(closing, now, terms.notice_seconds)  # a 120 s notice still fits
    assert window_over(closing, now)  # the 300 s default would not


def test_an_older_or_newer_market_reply_still_reads():
    assert MarketTerms.read({}) == MarketTerms()  # a market before a field existed
    assert MarketTerms.read({"notice_seconds": "60", "later": True}).notice_seconds == 60.0
