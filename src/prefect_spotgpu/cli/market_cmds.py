"""``spotgpu prices``, ``estimate``, ``bids`` and ``nodes``: read the market and print it.

Each command fetches the market's replies, parses them into the shared vocabulary's models
(``prefect_spotgpu.messages``: quotes, bids, allocations, nodes; a reply that does not parse
ends the command naming the field) and hands them to ``views`` (pure: replies in, tables out);
``app`` registers them as top-level commands. Lists are paged by the market (newest first, the
next page in the ``Link: rel="next"`` header): ``pages`` follows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from prefect_spotgpu.cli.common import (
    API_KEY_FILE,
    MARKET,
    busy_gpus,
    call,
    console,
    fail,
    market_client,
    parsed,
    tenant_key,
)
from prefect_spotgpu.protocol import BidStatus

if TYPE_CHECKING:
    import httpx

PAGE_SIZE = 100
"""Rows the CLI asks for in one page of a paged list."""

# ---------------------------------------------------------------- prices and estimates


def prices(
    market: str = MARKET,
    forecast: bool = typer.Option(False, help="Add each pool's forecast for the next hours."),
    hours: int = typer.Option(24, min=1, max=336, help="Hours ahead to forecast."),
) -> None:
    """Every pool's current quote and a sparkline of its clearing price over the last 24 hours
    (hourly closes; on-demand pools sell at a fixed price); with --forecast, its expected price
    ahead and the forecast's error measured on held-back history."""
    from prefect_spotgpu.messages import QuoteResponse
    from prefect_spotgpu.protocol import Capacity

    with market_client(market) as client:
        quotes = call(client, "GET", "/prices", reply=list[QuoteResponse])
        table = Table(title="Spot prices per GPU-hour", title_justify="left")
        columns = ["pool", "free/total", "clearing", "last 24 h", "on-demand", "discount"]
        columns += ["waiting bids"]
        if forecast:
            columns += [f"next {hours} h: low / mean / high", "cheapest hour", "error (MAE)"]
        for name in columns:
            table.add_column(
                name,
                justify="left" if name in ("pool", "last 24 h") else "right",
                no_wrap=name == "last 24 h",
            )
        for q in quotes:
            price = q.clearing_price or q.reserve_price
            spot = q.capacity == Capacity.SPOT
            row = [
                escape(f"{q.gpu_model} {q.region}") + ("" if spot else " (on-demand)"),
                f"{q.gpus_free}/{q.gpus_total}",
                "-" if price is None else f"{price:.2f}",
                _sparkline_cell(client, q.gpu_model, q.region) if spot else "fixed",
                f"{q.on_demand_price:.2f}",
                "-" if price is None else f"{1 - price / q.on_demand_price:.0%}",
                str(q.waiting_bids),
            ]
            if forecast and spot:
                row += _forecast_cells(client, q.gpu_model, q.region, hours)
            elif forecast:
                row += ["fixed price", "-", "-"]
            table.add_row(*row)
        console.print(table)


def _sparkline_cell(client, gpu_model: str, region: str) -> str:
    import time

    from prefect_spotgpu.cli.views import hourly_closes, sparkline, squeeze

    response = client.get(f"/prices/{gpu_model}/{region}/hourly", params={"days": 1})
    if response.status_code == 409:
        return "no history yet"
    if response.status_code != 200:
        fail(response)
    closes = hourly_closes(response.json(), now=time.time())
    return sparkline(squeeze(closes, 24 if console.width >= 120 else 12))


def _forecast_cells(client, gpu_model: str, region: str, hours: int) -> list[str]:
    response = client.get(f"/prices/{gpu_model}/{region}/forecast", params={"hours": hours})
    if response.status_code == 409:
        return ["no history yet", "-", "-"]
    if response.status_code != 200:
        fail(response)
    body = response.json()
    expected = [p["expected"] for p in body["points"]]
    cheapest = min(body["points"], key=lambda p: p["expected"])
    error = body["error"]
    return [
        f"{min(p['low'] for p in body['points']):.2f} / {sum(expected) / len(expected):.2f} / "
        f"{max(p['high'] for p in body['points']):.2f}",
        f"{cheapest['at'][5:16].replace('T', ' ')} UTC ({cheapest['expected']:.2f})",
        "-" if error is None else f"{error['mae']:.3f} (naive {error['naive_mae']:.3f})",
    ]


def estimate(
    gpu_model: str = typer.Option(..., "--model", help="GPU model, e.g. A100-80G."),
    gpu_hours: float = typer.Option(..., min=0.001, help="GPU-hours of work."),
    max_price: float = typer.Option(..., "--cap", min=0.001, help="Spot cap per GPU-hour."),
    deadline: str = typer.Option(..., help="Finish by, ISO 8601 with a timezone."),
    gpus: int = typer.Option(1, min=1, max=16, help="GPUs on one node."),
    region: str = typer.Option("any", help="Region, or any."),
    start: str = typer.Option(None, help="Not before (ISO 8601; default now)."),
    market: str = MARKET,
) -> None:
    """Expected cost and finish of some GPU-hours by a deadline, against on-demand; for
    region any, from every region's forecast at once, with each region's own beside it."""
    from prefect_spotgpu.messages import EstimateResponse

    body = {"gpu_model": gpu_model, "gpu_hours": gpu_hours, "max_price": max_price,
            "deadline": deadline, "gpus": gpus, "region": region}  # fmt: skip
    if start:
        body["start"] = start
    with market_client(market) as client:
        e = call(client, "POST", "/estimate", reply=EstimateResponse, json=body)
    finish = e.expected_finish or "not on spot alone before the deadline"
    console.print(
        f"{gpu_hours:g} GPU-hours of {e.gpu_model} at most {max_price:.2f}/GPU-h "
        f"by {deadline}:\n"
        f"  expected cost   {e.expected_cost:.2f} (on-demand {e.on_demand_cost:.2f}, "
        f"saving {e.saving:.0%})\n"
        f"  expected finish {finish}\n"
        f"  P(deadline met on spot alone) {e.p_meet_deadline_on_spot:.0%}; expected "
        f"on-demand fallback {e.expected_on_demand_gpu_hours:g} GPU-hours",
        markup=False,
    )
    if e.region == "any" and len(e.regions) > 1:
        console.print("  one region alone:")
        for r in e.regions:
            console.print(
                f"    {r.region or '':<14} expected cost {r.expected_cost:.2f} (saving "
                f"{r.saving:.0%}), P(deadline met on spot alone) "
                f"{r.p_meet_deadline_on_spot:.0%}",
                highlight=False,
                markup=False,
            )


# ---------------------------------------------------------------- bids and nodes


STATUS = typer.Option(None, help="Only bids in this status.")


def bids(
    status: BidStatus | None = STATUS,
    limit: int = typer.Option(50, min=1, max=10_000, help="Show the latest N bids."),
    api_key_file: Path | None = API_KEY_FILE,
    market: str = MARKET,
) -> None:
    """Your bids: each one's current allocation, price and cost so far, and your balance."""
    from prefect_spotgpu.cli.views import bids_table
    from prefect_spotgpu.economics.schedules import aware
    from prefect_spotgpu.messages import AllocationResponse, BidResponse, TenantResponse

    with market_client(market, tenant_key(api_key_file)) as client:
        me = call(client, "GET", "/me", reply=TenantResponse)
        params = {"limit": min(limit, PAGE_SIZE), **({"status": status} if status else {})}
        shown = parsed(list[BidResponse], newest(client, "/bids", params, limit), "GET /bids")
        allocations: dict[int, list[AllocationResponse]] = {b.id: [] for b in shown}
        # every allocation of a shown bid started after that bid was made: page back to there
        since = min((aware(b.created_at).timestamp() for b in shown), default=float("inf"))
        for page in pages(client, "/allocations", {"limit": 1000}):
            attempts = parsed(list[AllocationResponse], page, "GET /allocations")
            for a in attempts:
                if a.bid_id in allocations:
                    allocations[a.bid_id].append(a)
            if not attempts or attempts[-1].started_at < since - 1:
                break
        for attempts in allocations.values():
            attempts.sort(key=lambda a: a.id)
    console.print(bids_table(shown[::-1], allocations, tenant=me))


def nodes(api_key_file: Path | None = API_KEY_FILE, market: str = MARKET) -> None:
    """Your nodes (every node, with the admin key): state, GPUs in use, the agent's last
    telemetry, reserve price and the age of the last heartbeat."""
    import time

    from prefect_spotgpu.cli.views import nodes_table
    from prefect_spotgpu.messages import NodeResponse

    with market_client(market, tenant_key(api_key_file)) as client:
        listed = call(client, "GET", "/nodes", reply=list[NodeResponse])
        busy = busy_gpus(client)
    console.print(nodes_table(listed, busy, now=time.time()))


def pages(client: httpx.Client, path: str, params: dict) -> Iterator[list[dict]]:
    """Each page of a paged list (newest first), following the ``Link: rel="next"`` header."""
    response = client.get(path, params=params)
    while True:
        if response.status_code != 200:
            fail(response)
        yield response.json()
        following = response.links.get("next", {}).get("url")
        if not following:
            return
        response = client.get(following)


def newest(client: httpx.Client, path: str, params: dict, up_to: int) -> list[dict]:
    """The newest ``up_to`` rows of a paged list."""
    rows: list[dict] = []
    for page in pages(client, path, params):
        rows += page
        if len(rows) >= up_to:
            break
    return rows[:up_to]
