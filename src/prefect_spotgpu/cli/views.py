"""What ``spotgpu prices``, ``spotgpu bids`` and ``spotgpu nodes`` show: pure functions from the
market's replies (the shared vocabulary's models, ``prefect_spotgpu.messages``, where it has
one; else JSON bodies) and ``now``, in UNIX seconds, to strings and rich tables. No I/O and no
clock here, so every view is tested on tabled inputs; the commands in ``market_cmds`` fetch,
parse and print.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime

from rich.markup import escape
from rich.table import Table

from prefect_spotgpu.economics.schedules import aware
from prefect_spotgpu.market import NodeState
from prefect_spotgpu.messages import (
    AllocationResponse,
    BidResponse,
    NodeResponse,
    TenantResponse,
)
from prefect_spotgpu.protocol import HOLDING_STATUSES, AllocationStatus, BidStatus

BLOCKS = "▁▂▃▄▅▆▇█"

BID_COLORS = {
    BidStatus.OPEN: "green",
    BidStatus.HELD: "yellow",
    BidStatus.CANCELLED: "dim",
    BidStatus.FINISHED: "blue",
}
ALLOCATION_COLORS = {
    AllocationStatus.RESERVED: "cyan",
    AllocationStatus.RUNNING: "green",
    AllocationStatus.NOTICED: "yellow",
    AllocationStatus.PREEMPTED: "red",
    AllocationStatus.FINISHED: "blue",
    AllocationStatus.RELEASED: "dim",
}
NODE_COLORS = {
    NodeState.LIVE: "green",
    NodeState.DRAINING: "yellow",
    NodeState.RECLAIMED: "magenta",
    NodeState.LOST: "red",
}


def sparkline(values: Sequence[float | None], gap: str = " ") -> str:
    """One block character per value, scaled between the series' min and max; a missing value
    (None or NaN) is ``gap``, and a flat series is a flat line at mid height.

    >>> sparkline([1, 2, 3, 4, 5, 6, 7, 8])
    '▁▂▃▄▅▆▇█'
    >>> sparkline([0.9, None, 1.1, 1.1])
    '▁ ██'
    >>> sparkline([2.0, 2.0])
    '▄▄'
    """
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return gap * len(values)
    low, high = min(present), max(present)
    top = len(BLOCKS) - 1
    out = []
    for v in values:
        if v is None or math.isnan(v):
            out.append(gap)
        elif high == low:
            out.append(BLOCKS[top // 2])
        else:
            out.append(BLOCKS[round((v - low) / (high - low) * top)])
    return "".join(out)


def hourly_closes(bars: Sequence[dict], *, now: float, hours: int = 24) -> list[float | None]:
    """The close of each of the last ``hours`` hours (the current one last) from the bodies of
    ``GET /prices/{model}/{region}/hourly``; None for an hour without a bar."""
    last = int(now // 3600)
    slots: list[float | None] = [None] * hours
    for bar in bars:
        index = int(parse_time(bar["hour"]) // 3600) - (last - hours + 1)
        if 0 <= index < hours:
            slots[index] = bar["close"]
    return slots


def squeeze(values: Sequence[float | None], width: int) -> list[float | None]:
    """``values`` in ``width`` equal runs, each the last value present in its run (a narrower
    sparkline of the same period); as they are when they fit.

    >>> squeeze([1.0, 2.0, None, None, 5.0, None], 3)
    [2.0, None, 5.0]
    """
    if len(values) <= width:
        return list(values)
    run = -(-len(values) // width)
    chunks = [values[i : i + run] for i in range(0, len(values), run)]
    return [next((v for v in reversed(c) if v is not None), None) for c in chunks]


def parse_time(value: str) -> float:
    """UNIX seconds of an ISO 8601 time from the API (naive means UTC)."""
    return aware(datetime.fromisoformat(value)).timestamp()


def age(seconds: float) -> str:
    """A short age: ``4s``, ``12m``, ``3h``, ``2d``."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def colored(value: str, colors: dict[str, str]) -> str:
    color = colors.get(value)
    return f"[{color}]{escape(value)}[/{color}]" if color else escape(value)


# ---------------------------------------------------------------- bids


def current_allocation(
    allocations: Sequence[AllocationResponse],
) -> AllocationResponse | None:
    """The allocation that stands for the bid now: one holding GPUs, else a reservation, else
    the latest one (ended)."""
    if not allocations:
        return None
    rank = {**dict.fromkeys(HOLDING_STATUSES, 2), AllocationStatus.RESERVED: 1}
    return max(allocations, key=lambda a: (rank.get(a.status, 0), a.id))


def bids_table(
    bids: Sequence[BidResponse],
    allocations: dict[int, list[AllocationResponse]],
    *,
    tenant: TenantResponse,
) -> Table:
    """The tenant's bids with their current allocation and their cost so far (the sum of
    every allocation's ``charged_amount``); ``tenant``: ``GET /me``."""
    table = Table(
        title=f"Bids of {escape(tenant.name)}",
        title_justify="left",
        caption=f"balance {tenant.balance:.4f}",
        caption_justify="left",
    )
    for name, justify in (
        ("id", "right"),
        ("GPUs", "left"),
        ("region", "left"),
        ("capacity", "left"),
        ("max price", "right"),
        ("status", "left"),
        ("created (UTC)", "left"),
        ("allocation", "left"),
        ("price", "right"),
        ("cost so far", "right"),
    ):
        table.add_column(name, justify=justify, overflow="fold")  # wrap, never cut (80 columns)
    for bid in bids:
        allocs = allocations.get(bid.id, [])
        now = current_allocation(allocs)
        status = colored(bid.status, BID_COLORS)
        if bid.hold_reason:
            status += f" ({escape(bid.hold_reason)})"
        created = aware(bid.created_at).astimezone(UTC)
        table.add_row(
            str(bid.id),
            f"{bid.gpu_model} x{bid.gpu_count}",
            escape(bid.region),
            escape(bid.capacity),
            f"{bid.max_price:.2f}",
            status,
            created.strftime("%Y-%m-%d %H:%M"),
            "-" if now is None else f"node {now.node_id} " + colored(now.status, ALLOCATION_COLORS),
            "-" if now is None else f"{now.price:.2f}",
            f"{sum(a.charged_amount for a in allocs):.4f}",
        )
    return table


# ---------------------------------------------------------------- nodes


def gpus_used(node: NodeResponse, busy: dict[int, int]) -> str:
    """``used/total`` GPUs of a node; ``busy`` maps node ids to GPUs running or noticed
    (``GET /market/nodes``: ``gpus_busy``)."""
    return f"{busy.get(node.id, 0)}/{node.gpu_count}"


def telemetry_cells(telemetry: dict | None) -> tuple[str, str, str]:
    """Mean utilisation, hottest temperature and memory in use over the node's GPUs, from its
    agent's last heartbeat (``telemetry["gpus"]``); ``-`` where the agent did not report it."""
    gpus = [g for g in (telemetry or {}).get("gpus") or [] if isinstance(g, dict)]

    def values(*keys: str) -> list[float]:
        found = []
        for g in gpus:
            value = next((g[k] for k in keys if isinstance(g.get(k), int | float)), None)
            if value is not None:
                found.append(float(value))
        return found

    util = values("utilization", "utilization_gpu")
    temp = values("temperature", "temperature_c", "temp_c")
    memory = values("memory_used_mb")
    return (
        f"{sum(util) / len(util):.0f}%" if util else "-",
        f"{max(temp):.0f}°C" if temp else "-",
        f"{sum(memory) / 1024:.1f} GB" if memory else "-",
    )


def nodes_table(nodes: Sequence[NodeResponse], busy: dict[int, int], *, now: float) -> Table:
    """Nodes (``GET /nodes``) with their state, GPUs in use, telemetry and heartbeat age.

    Telemetry columns that say nothing for any node (declared GPUs report none) are left out,
    so such a table fits 80 columns; what does not fit wraps, never cut."""
    columns = (
        ("id", "right"),
        ("name", "left"),
        ("model", "left"),
        ("region", "left"),
        ("capacity", "left"),
        ("state", "left"),
        ("GPUs used", "right"),
        ("jobs", "right"),
        ("util", "right"),
        ("temp", "right"),
        ("memory", "right"),
        ("reserve", "right"),
        ("heartbeat", "right"),
    )
    rows = []
    for node in nodes:
        jobs = (node.telemetry or {}).get("jobs")
        rows.append(
            (
                str(node.id),
                escape(node.name),
                escape(node.gpu_model),
                escape(node.region),
                escape(node.capacity),
                colored(node.state, NODE_COLORS),
                gpus_used(node, busy),
                str(jobs) if isinstance(jobs, int) else "-",
                *telemetry_cells(node.telemetry),
                f"{node.reserve_price:.2f}",
                age(now - aware(node.last_heartbeat_at).timestamp()) + " ago",
            )
        )
    silent = {"util", "temp", "memory"}
    shown = [
        i
        for i, (name, _) in enumerate(columns)
        if not rows or not (name in silent and all(row[i] == "-" for row in rows))
    ]
    table = Table(title="Nodes", title_justify="left")
    for i in shown:
        name, justify = columns[i]
        table.add_column(name, justify=justify, overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table
