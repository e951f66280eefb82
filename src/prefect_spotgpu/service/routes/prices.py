"""Price routes, public: every pool's current quote (with its model's on-demand price) and a
pool's clearing price per minute (OHLC bars). Hourly history, the forecast and the cost
estimator are ``forecast``'s."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query

from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.service import crud, queries, schemas
from prefect_spotgpu.service.clock import request_clock
from prefect_spotgpu.service.deps import Db
from prefect_spotgpu.service.errors import Invalid
from prefect_spotgpu.service.routes.params import API

router = APIRouter(prefix=API, tags=["prices"])

QUOTE_FIELDS = (
    "gpu_model",
    "region",
    "capacity",
    "clearing_price",
    "reserve_price",
    "gpus_total",
    "gpus_free",
    "gpus_running",
    "waiting_bids",
)
"""The columns of a pool's quote row that ``QuoteResponse`` shows."""


@router.get(
    "/prices",
    response_model=list[schemas.QuoteResponse],
    summary="The current quote of every pool",
)
def prices(db: Db):
    with db.begin() as session:
        return [
            {
                **{c: getattr(r, c) for c in QUOTE_FIELDS},
                "on_demand_price": DEFAULT_CATALOG.get(r.gpu_model).on_demand_price,
            }
            for r in queries.list_quotes(session=session)
        ]


@router.get(
    "/prices/{gpu_model}/{region}/history",
    response_model=list[schemas.PriceBarResponse],
    summary="A pool's clearing price per minute (OHLC), hourly bars beyond their retention",
)
def price_history(
    gpu_model: Annotated[str, Path(max_length=100)],
    region: Annotated[str, Path(max_length=63)],
    db: Db,
    hours: Annotated[float, Query(gt=0, le=24 * 31)] = 24.0,
):
    try:
        model = DEFAULT_CATALOG.normalize(gpu_model)
    except ValueError as exc:
        raise Invalid(str(exc), field="gpu_model") from None
    now = request_clock.get().time()
    with db.begin() as session:
        bars = crud.price_bars(
            session=session,
            gpu_model=model,
            region=region,
            since_minute=int((now - hours * 3600) // 60),
            until_minute=int(now // 60),
        )
        return [
            {
                "minute": datetime.fromtimestamp(b.minute * 60, UTC),
                "open": b.open,
                "high": b.high,
                "low": b.low,
                "close": b.close,
                "seconds": b.seconds,
            }
            for b in bars
        ]
