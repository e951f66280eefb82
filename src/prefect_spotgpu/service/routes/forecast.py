"""Forecast routes, public like the quotes (no tenant data is involved): a pool's price history
at an hour's resolution, the expected price by hour with its band and measured error, and the
cost estimator (the expected cost and finish of some GPU-hours by a deadline). The forecast is
learnt from the pool's stored minute bars (``price_bars``, ``market.forecast``, pure) and kept
per pool, history window and bar (``service.forecasts``): a request refits only when a new bar
has closed; an estimate for ``any`` region reuses each region's.

Expensive work is rationed per caller (``service.fairness``): every estimate, and every
forecast read that must fit afresh, spends a token of the caller's bucket (a tenant's or the
operator's key: ``tenant_estimates_*``; anyone else: its client address,
``anonymous_estimates_*``); an empty bucket is a 429 with ``Retry-After``."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request

from prefect_spotgpu.economics.anywhere import AnyRegionForecast
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.market.forecast import estimate
from prefect_spotgpu.service import crud, queries, schemas
from prefect_spotgpu.service.clock import request_clock
from prefect_spotgpu.service.deps import Db
from prefect_spotgpu.service.errors import Conflict, Invalid, TooManyRequests
from prefect_spotgpu.service.fairness import FairShares, client_address
from prefect_spotgpu.service.forecasts import (
    Fitted,
    ForecastCache,
    count_bars_by_region,
    fit_history,
)
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
    return model, int((request_clock.get().time() - days * 86400) // 60)


def _fitted(
    request: Request, db, gpu_model: str, region: str, days: float, admit: Callable[[], None]
) -> tuple[str, Fitted]:
    """``(model, fitted history)`` of a pool (of every pool of the model merged, for region
    "any"), from the cache while no bar has closed since (``admit``: before fitting afresh)."""
    model, since = _model_and_since(gpu_model, days)
    one = None if region == "any" else region
    with db.begin() as session:
        fingerprint = count_bars_by_region(
            session=session, gpu_model=model, region=one, since_minute=since
        )
    fitted = None
    if fingerprint:
        fitted = _cache(request).fitted(
            (model, region, days), fingerprint, lambda: _fit(db, model, one, since), admit
        )
    if fitted is None:
        raise Conflict(f"no price history for {model} in {region} yet")
    return model, fitted


def _fit(db, model: str, region: str | None, since: int) -> Fitted | None:
    with db.begin() as session:
        return fit_history(session=session, gpu_model=model, region=region, since_minute=since)


def _cache(request: Request) -> ForecastCache:
    return request.app.state.forecasts


def _spend(request: Request) -> None:
    """Spend a token of the caller's bucket for expensive work, or raise a 429."""
    shares: FairShares = request.app.state.fair_shares
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    buckets, whose, who = shares.anonymous_work, client_address(request), "client address"
    if scheme.lower() == "bearer" and key:
        if hmac.compare_digest(key.encode(), request.app.state.admin_key.encode()):
            buckets, whose, who = shares.tenant_work, "admin", "key"
        elif (tenant := _tenant_of_key(request, key)) is not None:
            buckets, whose, who = shares.tenant_work, ("tenant", tenant), "tenant"
    wait = buckets.take(whose, now=time.monotonic())
    if wait:
        raise TooManyRequests(
            f"too many estimates and forecasts from this {who}: retry in {wait:.0f} s "
            "(a tenant's key gets a larger share)",
            retry_after=wait,
        )


def _tenant_of_key(request: Request, key: str) -> int | None:
    """The tenant of a live API key (one indexed read outside any transaction), else None:
    these routes are public, so a bad key is only no key."""
    options = {"isolation_level": "AUTOCOMMIT"}
    with request.app.state.engine.connect().execution_options(**options) as connection:
        tenant = queries.find_tenant_by_key(connection=connection, key_hash=crud.hash_secret(key))
    return None if tenant is None else tenant.id


@router.get(
    "/prices/{gpu_model}/{region}/hourly",
    summary="A pool's clearing price per hour (OHLC)",
)
def hourly_history(
    gpu_model: ModelPath, region: RegionPath, db: Db, request: Request, days: Days = 7.0
):
    _, fitted = _fitted(request, db, gpu_model, region, days, lambda: _spend(request))
    bars = fitted.bars
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
    request: Request,
    days: Days = 28.0,
    hours: Annotated[int, Query(ge=1, le=24 * 14)] = 48,
):
    model, fitted = _fitted(request, db, gpu_model, region, days, lambda: _spend(request))
    ahead = (np.floor(request_clock.get().time() / 3600) + np.arange(1, hours + 1)) * 3600.0
    expected, low, high = fitted.forecast.predict(ahead)
    times, error = fitted.bars["hour"], fitted.error
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


@router.post(
    "/estimate",
    response_model=schemas.EstimateResponse,
    summary="Expected cost and finish of some GPU-hours by a deadline",
    responses={429: {"description": "Too many estimates from this caller: see Retry-After"}},
)
def estimate_cost(data: schemas.EstimateRequest, db: Db, request: Request, days: Days = 28.0):
    """For one region, from its pool's forecast; for ``any``, from every region's at once
    (``economics.anywhere``: spot usable when some region's price is at most the cap, at the
    cheapest region's price), with each region's own estimate beside it."""
    _spend(request)
    model, by_region = _regions_history(request, db, data.gpu_model, data.region, days)
    fitted = {region: f.forecast for region, f in by_region.items()}
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


def _regions_history(request: Request, db, gpu_model: str, region: str, days: float):
    """``(model, {region: fitted history})``: the one region's, or each region's for ``any``
    (from one read of every region's fingerprint; only the regions with a new bar refit)."""
    if region != "any":
        model, fitted = _fitted(request, db, gpu_model, region, days, lambda: None)
        return model, {region: fitted}
    model, since = _model_and_since(gpu_model, days)
    with db.begin() as session:
        regions = count_bars_by_region(
            session=session, gpu_model=model, region=None, since_minute=since
        )
    cache = _cache(request)
    by_region = {}
    for one in regions:
        name = one[0]
        fitted = cache.fitted((model, name, days), (one,), lambda r=name: _fit(db, model, r, since))
        if fitted is not None:
            by_region[name] = fitted
    if not by_region:
        raise Conflict(f"no price history for {model} in any region yet")
    return model, by_region
