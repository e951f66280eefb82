"""The forecast routes on the real service, with stored price history (SQLite and PostgreSQL)."""

from __future__ import annotations

import time

import numpy as np
import sqlalchemy as sa

from conftest import one_database, start_service
from prefect_spotgpu.service.models import PriceBar


def store_history(db_url: str, days: int = 21, region: str = "eu-west", night=0.9, day=1.5):
    """A minute bar per hour for ``days``: ``night`` at night, ``day`` by day (09-18 UTC)."""
    now_hour = int(time.time() // 3600)
    hours = np.arange(now_hour - days * 24, now_hour)
    engine = sa.create_engine(db_url)
    with engine.begin() as connection:
        rows = []
        for h in hours:
            price = night if (h % 24) < 9 or (h % 24) >= 18 else day
            rows.append({"gpu_model": "A100-80G", "region": region, "minute": int(h) * 60,
                         "open": price, "high": price, "low": price, "close": price})  # fmt: skip
        connection.execute(sa.insert(PriceBar), rows)
    engine.dispose()


def test_hourly_history_forecast_and_estimate(db_url, tmp_path):
    service = start_service(db_url, tmp_path / "home")
    try:
        store_history(db_url)
        api = service.client()
        bars = api.get("/prices/A100-80G/eu-west/hourly", params={"days": 2}).json()
        assert 47 <= len(bars) <= 49 and {b["close"] for b in bars} == {0.9, 1.5}
        forecast = api.get("/prices/a100 80g/eu-west/forecast", params={"hours": 24}).json()
        assert forecast["gpu_model"] == "A100-80G" and len(forecast["points"]) == 24
        by_hour = {p["at"][11:13]: p["expected"] for p in forecast["points"]}
        assert by_hour["03"] == 0.9 and by_hour["12"] == 1.5
        assert forecast["error"]["mae"] < 0.01 and forecast["error"]["holdout_hours"] > 100
        estimate = api.post(
            "/estimate",
            json={
                "gpu_model": "A100-80G",
                "region": "eu-west",
                "gpu_hours": 6,
                "max_price": 1.2,
                "deadline": _iso(time.time() + 2 * 86400),
            },
        ).json()
        assert estimate["p_meet_deadline_on_spot"] > 0.99
        assert abs(estimate["expected_cost"] - 6 * 0.9) < 1e-6
        assert abs(estimate["saving"] - (1 - 0.9 / 2.1)) < 1e-3
    finally:
        service.stop()


def test_an_estimate_for_any_region_takes_the_cheapest_region_hour_by_hour(db_url, tmp_path):
    """Two regions dear at opposite hours: alone, each is usable at the cap (1.2) only half the
    day; any region is usable all day, always at 0.9, so 18 GPU-hours fit in 18 hours."""
    service = start_service(db_url, tmp_path / "home")
    try:
        store_history(db_url, region="eu-west", night=0.9, day=1.5)
        store_history(db_url, region="us-east", night=1.5, day=0.9)
        api = service.client()
        body = {"gpu_model": "A100-80G", "gpu_hours": 18, "max_price": 1.2,
                "deadline": _iso(time.time() + 20 * 3600)}  # fmt: skip
        anywhere = api.post("/estimate", json={**body, "region": "any"}).json()
        assert anywhere["region"] == "any"
        assert [r["region"] for r in anywhere["regions"]] in (
            ["eu-west", "us-east"],
            ["us-east", "eu-west"],
        )
        assert anywhere["p_meet_deadline_on_spot"] > 0.99
        assert abs(anywhere["expected_cost"] - 18 * 0.9) < 1e-6
        for alone in anywhere["regions"]:
            assert alone["p_meet_deadline_on_spot"] < 0.01  # 18 h of spot need both regions
            # a region alone is cheap 15 h of any 24 at most, so at least 3 of the 18 hours go
            # on demand there (2.1, not 0.9): the 20 h window's start hour decides how many more
            assert alone["expected_cost"] >= anywhere["expected_cost"] + 3 * (2.1 - 0.9) - 1e-6
        one = api.post("/estimate", json={**body, "region": "eu-west"}).json()
        assert one["region"] == "eu-west" and [r["region"] for r in one["regions"]] == ["eu-west"]
        assert one["expected_cost"] == next(
            r["expected_cost"] for r in anywhere["regions"] if r["region"] == "eu-west"
        )
        none = api.post("/estimate", json={**body, "gpu_model": "H200", "region": "any"})
        assert none.status_code == 409 and "no price history for H200 in any region" in none.text
    finally:
        service.stop()


@one_database("validation and headers are decided before any query")
def test_bad_input_is_named(service):
    api = service.client()
    response = api.post(
        "/estimate",
        json={"gpu_model": "A100-80G", "gpu_hours": 6, "max_price": 1.2,
              "start": "2026-12-02T00:00:00Z", "deadline": "2026-12-01T00:00:00Z"},
    )  # fmt: skip
    assert response.status_code == 422 and "deadline must be after the start" in response.text
    body = {"gpu_model": "A100-80G", "gpu_hours": -1, "max_price": 1.2,
            "deadline": "2026-12-01T00:00:00Z"}  # fmt: skip
    response = api.post("/estimate", json=body)
    assert response.status_code == 422 and "gpu_hours" in response.text
    response = api.get("/prices/Voodoo-5/eu-west/forecast")
    assert response.status_code == 422 and "gpu_model" in response.text
    response = api.get("/prices/H200/eu-west/forecast")  # no history yet: a clear 409
    assert response.status_code == 409 and "no price history for H200 in eu-west" in response.text


def _iso(ts: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, UTC).isoformat()


def test_the_prices_and_estimate_commands(tmp_path):
    import subprocess
    import sys

    db_url = f"sqlite:///{tmp_path / 'm.db'}"
    # the node never heartbeats: it stays live (in the table) however slow the commands run
    service = start_service(db_url, tmp_path / "home", heartbeat_timeout_seconds=3600)
    try:
        owner = service.tenant()
        service.node(owner, region="eu-west", gpus=8, reserve=0.9)
        store_history(db_url)

        def spotgpu(*args):
            out = subprocess.run(
                [sys.executable, "-m", "prefect_spotgpu.cli", *args, "--market", service.base_url],
                capture_output=True, text=True, timeout=120, env={**_env(), "COLUMNS": "200"},
            )  # fmt: skip
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout

        # each command is a new Python process: seconds apiece on a loaded 2-core machine
        table = service.wait_for(
            lambda: "A100-80G eu-west" in (t := spotgpu("prices")) and t, timeout=90
        )
        assert "2.10" in table and "8/8" in table
        ahead = spotgpu("prices", "--forecast", "--hours", "24")
        assert "0.90 / " in ahead and "(0.90)" in ahead and "naive" in ahead
        # from the next 18:00 UTC at least an hour away: the live tick's bar of the current
        # hour (0.90, the reserve) must not move the forecast of an hour the estimate uses
        start = (time.time() // 86400) * 86400 + 18 * 3600
        while start < time.time() + 3600:
            start += 86400
        text = spotgpu("estimate", "--model", "A100-80G", "--gpu-hours", "6", "--cap", "1.2",
                       "--start", _iso(start), "--deadline", _iso(start + 2 * 86400))  # fmt: skip
        assert "expected cost   5.40 (on-demand 12.60, saving 57%)" in text
        store_history(db_url, region="us-east", night=1.5, day=0.9)
        text = spotgpu("estimate", "--model", "A100-80G", "--gpu-hours", "6", "--cap", "1.2",
                       "--start", _iso(start), "--deadline", _iso(start + 2 * 86400))  # fmt: skip
        assert "one region alone:" in text and "us-east" in text and "eu-west" in text, text
    finally:
        service.stop()


def _env():
    import os

    return dict(os.environ)
