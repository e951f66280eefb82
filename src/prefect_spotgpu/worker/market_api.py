"""The spot-gpu worker's view of a market bid: its events folded into a track, its cost
report, and the HTTP calls to the market (one place for the market's error messages)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from prefect_spotgpu.blocks import SpotMarket
from prefect_spotgpu.economics.schedules import aware, cheap_window
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

NOTICE_SECONDS = 300
"""The market's notice: a window closing sooner than this cannot start a run."""
PID_PREFIX = "spotgpu-bid-"
"""A flow run's infrastructure id: the bid serving it."""
JOB_FAILED = "job failed on the node"
"""The market's reason when a job exited non-zero: the run's own end, not a preemption."""
SAVED_AND_STOPPED = "final save acknowledged"
"""The market's reason after a final save: the agent stopped the job before reporting it."""


class MarketError(RuntimeError):
    """The market refused a request; the message carries its reason, ``status`` the HTTP code."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def is_transient(exc: Exception) -> bool:
    """A failure worth retrying: no answer at all, or a 5xx, 408 or 429 from the market or
    Prefect (``MarketError`` or ``httpx.HTTPStatusError``)."""
    if isinstance(exc, MarketError):
        status = exc.status
    elif isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    else:
        return isinstance(exc, httpx.HTTPError)  # connection refused, timeout, ...
    return status >= 500 or status in (408, 429)


class Track:
    """What a bid's events say: its running allocations, the ended ones, the preemptions.

    Normally one allocation runs at a time; when a node is lost the market may place the bid
    anew in the same tick, and that placement's event comes *before* the lost allocation's
    end. So running allocations queue in order, and the first one is the current one."""

    def __init__(self) -> None:
        self.running: list[int] = []
        self.ended: set[int] = set()
        self.nodes: dict[int, int] = {}
        self.preemptions = 0

    @property
    def live(self) -> int | None:
        return self.running[0] if self.running else None

    @classmethod
    def from_events(cls, events: list[dict]) -> Track:
        track = cls()
        for event in events:
            track.apply(event)
        return track

    def apply(self, event: dict) -> bool:
        """Fold one event in; True when it ended the current allocation."""
        kind, alloc = event["kind"], event["allocation_id"]
        self.nodes[alloc] = event["node_id"]
        if kind == "allocated" and alloc not in self.ended and alloc not in self.running:
            self.running.append(alloc)
        elif kind in ("preempted", "finished", "released"):
            self.ended.add(alloc)
            if kind == "preempted" and event["payload"].get("reason") != JOB_FAILED:
                self.preemptions += 1
            if alloc in self.running:
                current = alloc == self.running[0]
                self.running.remove(alloc)
                return current
        return False


def bid_costs(bid: dict, allocations: list[dict]) -> dict:
    """A bid's spot cost against the same GPU-hours on-demand, its preemptions, final saves
    and the work lost (seconds since the last checkpoint of preemptions without a final save).
    """
    on_demand_price = DEFAULT_CATALOG.get(bid["gpu_model"]).on_demand_price
    spot = sum(a["charged_amount"] for a in allocations)
    gpu_hours = sum(a["charged_seconds"] * a["gpu_count"] for a in allocations) / 3600
    preempted = [a for a in allocations if a["status"] == "preempted"]
    lost = sum(
        a["ended_at"] - max(a["last_checkpoint_at"] or a["started_at"], a["started_at"])
        for a in preempted
        if a["final_save"] != "ok" and a["ended_at"] is not None
    )
    on_demand = gpu_hours * on_demand_price
    return {
        "gpu_hours": gpu_hours,
        "spot_cost": spot,
        "on_demand_cost": on_demand,
        "on_demand_price": on_demand_price,
        "saving": 1 - spot / on_demand if on_demand > 0 else None,
        "preemptions": len(preempted),
        "final_saves_ok": sum(a["final_save"] == "ok" for a in allocations),
        "work_lost_seconds": lost,
    }


def _bids(allocations: list[dict], bid: dict) -> str:
    ids = sorted({a["bid_id"] for a in allocations} | {bid["id"]})
    return f"bid {ids[0]}" if len(ids) == 1 else "bids " + ", ".join(map(str, ids))


def allocation_report(bid: dict, allocations: list[dict]) -> tuple[list[dict], str]:
    """Rows for the allocations table and the markdown summary of the cost of a run's bid (and
    of the bids it replaced, whose allocations come with it): what was paid, on spot or
    on-demand, against the same GPU-hours all on-demand."""
    rows = []
    for a in sorted(allocations, key=lambda a: a["id"]):
        if a["status"] in ("reserved", "released"):
            continue
        end = a["ended_at"]
        rows.append(
            {
                "allocation": a["id"],
                "bid": a["bid_id"],
                "node": a["node_id"],
                "gpu": f"{a['gpu_count']} x {bid['gpu_model']}",
                "start": iso(a["started_at"]),
                "end": iso(end) if end else "running",
                "status": a["status"],
                "price": round(a["price"], 4),
                "cost": round(a["charged_amount"], 6),
            }
        )
    c = bid_costs(bid, allocations)
    saving = "n/a" if c["saving"] is None else f"{c['saving']:.0%}"
    summary = "\n".join(
        [
            f"### GPU cost of {_bids(allocations, bid)}",
            "",
            "| | |",
            "|---|---|",
            f"| GPUs | {describe(bid)} |",
            f"| GPU-hours | {c['gpu_hours']:.4f} |",
            f"| Cost paid | {c['spot_cost']:.6f} |",
            f"| On-demand cost | {c['on_demand_cost']:.6f} (at {c['on_demand_price']:.2f}/GPU-h) |",
            f"| Saving | {saving} |",
            f"| Preemptions | {c['preemptions']} |",
            f"| Work lost | {c['work_lost_seconds']:.1f} s (preemptions without a final save) |",
        ]
    )
    return rows, summary


# ---------------------------------------------------------------- market helpers


def market_of(configuration: SpotGPUJobConfiguration) -> SpotMarket:
    if configuration.market is None:
        raise ValueError(
            "no market: set the work pool's or deployment's 'market' variable to a Spot Market "
            "block (prefect block register -m prefect_spotgpu.blocks, then save one)"
        )
    return configuration.market


def check_storage(configuration: SpotGPUJobConfiguration) -> None:
    """Refuse, before any bid (and so any charge), a run with nowhere to keep checkpoints: its
    job would start, be billed, and fail on the node asking for its checkpoint location."""
    if configuration.checkpoint_storage is None:
        raise ValueError(
            "no checkpoint storage: set the work pool's or deployment's 'checkpoint_storage' "
            "variable to a Spot Checkpoint Storage block (spotgpu blocks save, then spotgpu "
            "pool setup POOL); nothing was bid"
        )


def market_client(market: SpotMarket) -> httpx.AsyncClient:
    return market.get_async_client()


def checked(response: httpx.Response, doing: str) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise MarketError(
            f"the market refused to {doing} (HTTP {response.status_code}): {detail}",
            response.status_code,
        )
    return response.json()


async def cancel_bid(http: httpx.AsyncClient, bid_id: int) -> None:
    response = await http.post(f"/bids/{bid_id}/cancel")
    if response.status_code not in (200, 409):
        checked(response, "cancel the bid")


async def set_webhook(http: httpx.AsyncClient, url: str) -> None:
    current = await http.get("/webhook")
    if current.status_code == 200 and current.json().get("url") == url:
        return
    checked(await http.put("/webhook", json={"url": url}), "set the notice webhook")


async def quote_text(http: httpx.AsyncClient, bid: dict) -> tuple[str, bool]:
    """What the market offers this bid now (``quote_summary``), from ``GET /prices``."""
    response = await http.get("/prices")
    if response.status_code != 200:
        return "no quote", False
    return quote_summary(bid, response.json())


def quote_summary(bid: dict, quotes: list[dict]) -> tuple[str, bool]:
    """A line on the pools a bid can run in, and whether none of them accepts its price (its
    maximum is below every node's reserve: it would wait for ever).

        >>> pool = {"gpu_model": "A100-80G", "region": "eu-west", "capacity": "spot",
        ...         "gpus_free": 1, "clearing_price": None, "reserve_price": 0.9}
        >>> bid = {"gpu_model": "A100-80G", "region": "any", "max_price": 0.4}
        >>> text, refused = quote_summary(bid, [pool])
        >>> refused, text.split(": ")[0]
        (True, 'no A100-80G node in any region accepts 0.40 per GPU-hour')
        >>> text.split(": ")[1]
        'the lowest reserve is 0.90; raise max_price to at least 0.90'
        >>> quote_summary({**bid, "max_price": 1.2}, [pool])
        ('market from 0.90 per GPU-hour, 1 GPU free', False)
    """
    pools = [
        q
        for q in quotes
        if q["gpu_model"] == bid["gpu_model"]
        and bid["region"] in ("any", q["region"])
        and q.get("capacity", "spot") == bid.get("capacity", "spot")
    ]
    if not pools:
        kind = "on-demand " if bid.get("capacity") == "on_demand" else ""
        return f"no {kind}{bid['gpu_model']} nodes in {bid['region']} yet", False
    reserves = [q["reserve_price"] for q in pools if q.get("reserve_price") is not None]
    if reserves and bid.get("capacity", "spot") == "spot" and bid["max_price"] < min(reserves):
        where = "any region" if bid["region"] == "any" else bid["region"]
        return (
            f"no {bid['gpu_model']} node in {where} accepts {bid['max_price']:.2f} per "
            f"GPU-hour: the lowest reserve is {min(reserves):.2f}; raise max_price to at "
            f"least {min(reserves):.2f}"
        ), True
    free = sum(q["gpus_free"] for q in pools)
    prices = [q["clearing_price"] or q["reserve_price"] for q in pools]
    prices = [p for p in prices if p is not None]
    price = f"from {min(prices):.2f}" if prices else "no price yet"
    return f"market {price} per GPU-hour, {free} GPU{'' if free == 1 else 's'} free", False


def describe(bid: dict) -> str:
    if bid.get("capacity") == "on_demand":
        return (
            f"{bid['gpu_count']} x {bid['gpu_model']} in {bid['region']}, on-demand at "
            f"{bid['max_price']:.2f} per GPU-hour"
        )
    return (
        f"{bid['gpu_count']} x {bid['gpu_model']} in {bid['region']}, "
        f"at most {bid['max_price']:.2f} per GPU-hour"
    )


def infrastructure_id(bid: dict) -> str:
    return f"{PID_PREFIX}{bid['id']}"


def resume_time(now: datetime, configuration: SpotGPUJobConfiguration) -> datetime:
    """When a preempted run should be picked up again: now, or for a cheap-window run whose
    window closed, when the next window opens."""
    if not configuration.cheap_window_only:
        return now
    start, _ = cheap_window(now + timedelta(seconds=NOTICE_SECONDS), configuration.timezone)
    return max(now, start)


def window_over(bid: dict) -> bool:
    """Whether a bid's cheap window has closed (or closes within a notice's length)."""
    end = bid.get("window_end")
    if not end:
        return False
    return aware(datetime.fromisoformat(end)).timestamp() <= time.time() + NOTICE_SECONDS


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def plain(payload: dict) -> dict:
    return {
        k: v for k, v in payload.items() if isinstance(v, str | int | float | bool) or v is None
    }
