"""Forecast routes, public like the quotes (no tenant data is involved): a pool's price history
at an hour's resolution, the expected price by hour with its band and measured error, and the
cost estimator (the expected cost and finish of some GPU-hours by a deadline). The forecast is
learnt from the pool's stored minute bars (``price_bars``) at each request
(``market.forecast``, pure)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query

from prefect_spotgpu.economics.anywhere import AnyRegionForecast
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.market.forecast import (
    HourOfWeekForecast,
    estimate,
    holdout_error,
    hourly_bars,
)
from prefect_spotgpu.service import queries, schemas
from prefect_spotgpu.service.deps import Db
from prefect_spotgpu.service.errors import Conflict, Invalid
from prefect_spotgpu.service.routes.params import API, ModelPath, RegionPath

router = APIRouter(prefix=API, tags=["prices"])

Days = Annotated[float, Query(gt=0, le=365, description="Days of history to learn from.")]


def _model_and_since(gpu_model: str, days: float) -> tuple[str, int]:
    """The catalogue's name of ``gpu_model`` (a 422 naming the field) and the first minute of
    ``days`` of history."""
    try:
        model = DEFAULT_CATALOG.normalize(gpu_model)
    except ValueError as exc:
        raise Invalid(str(exc), field="gpu_model") from None
    return model, int((time.time() - days * 86400) // 60)


def _history(db, gpu_model: str, region: str, days: float):
    """Hourly closes of a pool (or of every pool of the model, for region "any")."""
    model, since = _model_and_since(gpu_model, days)
    with db.begin() as session:
        rows = queries.list_minute_bars(
            session=session,
            gpu_model=model,
            region=None if region == "any" else region,
            since_minute=since,
        )
    if not rows:
        raise Conflict(f"no price history for {model} in {region} yet")
    cols = np.array(rows, dtype=np.float64).T
    return model, hourly_bars(cols[0].astype(np.int64), *cols[1:])


@router.get(
    "/prices/{gpu_model}/{region}/hourly",
    summary="A pool's clearing price per hour (OHLC)",
)
def hourly_history(gpu_model: ModelPath, region: RegionPath, db: Db, days: Days = 7.0):
    _, bars = _history(db, gpu_model, region, days)
    return [
        {
            "hour": datetime.fromtimestamp(int(h) * 3600, UTC),
            "open": float(o),
            "high": float(hi),
            "low": float(lo),
            "close": float(c),
        }
        for h, o, hi, lo, c in zip(
            bars["hour"], bars["open"], bars["high"], bars["low"], bars["close"], strict=True
        )
    ]


@router.get(
    "/prices/{gpu_model}/{region}/forecast",
    summary="The expected clearing price by hour, with an 80 % band and its measured error",
)
def forecast(
    gpu_model: ModelPath,
    region: RegionPath,
    db: Db,
    days: Days = 28.0,
    hours: Annotated[int, Query(ge=1, le=24 * 14)] = 48,
):
    model, bars = _history(db, gpu_model, region, days)
    times = bars["hour"] * 3600.0
    fitted = HourOfWeekForecast.fit(times, bars["close"])
    ahead = (np.floor(time.time() / 3600) + np.arange(1, hours + 1)) * 3600.0
    expected, low, high = fitted.predict(ahead)
    span_days = (times.max() - times.min()) / 86400
    error = None  # measured on the last quarter of the history (at most a week), if 2 days+
    if span_days >= 2:
        error = holdout_error(times, bars["close"], holdout_days=min(7.0, span_days / 4))
    return {
        "gpu_model": model,
        "region": region,
        "history_hours": len(times),
        "error": error,
        "points": [
            {
                "at": datetime.fromtimestamp(t, UTC),
                "expected": round(float(e), 4),
                "low": round(float(lo), 4),
                "high": round(float(hi), 4),
            }
            for t, e, lo, hi in zip(ahead, expected, low, high, strict=True)
        ],
    }


@router.post("/estimate", summary="Expected cost and finish of some GPU-hours by a deadline")
def estimate_cost(data: schemas.EstimateRequest, db: Db, days: Days = 28.0):
    """For one region, from its pool's forecast; for ``any``, from every region's at once
    (``economics.anywhere``: spot usable when some region's price is at most the cap, at the
    cheapest region's price), with each region's own estimate beside it."""
    model, by_region = _regions_history(db, data.gpu_model, data.region, days)
    fitted = {
        region: HourOfWeekForecast.fit(bars["hour"] * 3600.0, bars["close"])
        for region, bars in by_region.items()
    }
    start = (data.start or datetime.now(UTC)).timestamp()
    on_demand = DEFAULT_CATALOG.get(model).on_demand_price

    def estimated(forecast) -> dict:
        result = estimate(
            forecast, data.gpu_hours, data.max_price, start, data.deadline.timestamp(),
            on_demand, data.gpus,
        )  # fmt: skip
        finish = result.expected_finish
        return {
            "expected_cost": result.expected_cost,
            "expected_finish": None if finish is None else datetime.fromtimestamp(finish, UTC),
            "p_meet_deadline_on_spot": result.p_meet_deadline,
            "on_demand_cost": result.on_demand_cost,
            "saving": result.saving,
            "expected_spot_gpu_hours": result.spot_gpu_hours,
            "expected_on_demand_gpu_hours": result.fallback_gpu_hours,
        }

    each = {region: estimated(forecast) for region, forecast in fitted.items()}
    whole = estimated(AnyRegionForecast(fitted)) if data.region == "any" else each[data.region]
    return {
        "gpu_model": model,
        "region": data.region,
        **whole,
        "regions": sorted(
            ({"region": region, **e} for region, e in each.items()),
            key=lambda e: (e["expected_cost"], e["region"]),
        ),
        "assumptions": "hours independent; spot usable when the forecast price is at or below "
        "max_price (for any region: in some region, the regions independent, at the cheapest "
        "region's price); what spot cannot cover by the deadline is bought on-demand",
    }


def _regions_history(db, gpu_model: str, region: str, days: float) -> tuple[str, dict]:
    """``(model, {region: hourly bars})``: the one region's, or each region's for ``any``."""
    if region != "any":
        model, bars = _history(db, gpu_model, region, days)
        return model, {region: bars}
    model, since = _model_and_since(gpu_model, days)
    with db.begin() as session:
        regions = queries.list_bar_regions(session=session, gpu_model=model, since_minute=since)
    if not regions:
        raise Conflict(f"no price history for {model} in any region yet")
    return model, {r: _history(db, model, r, days)[1] for r in regions}
