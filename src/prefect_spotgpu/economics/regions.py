"""Traces as regions: availability traces, the zones of one date as the regions of one market,
and what a policy sees of each region at a step.

A trace (../shared/traces, from the NSDI '24 "Can't Be Late" paper) gives, every
``gap_seconds``, how many spot instances of one type were available in one zone. Traces of the
same date, instance type and tick are the zones (regions) of one market (:class:`Regions`):
one pool per zone, on the common time grid, truncated to the shortest. A single trace is a
market of one region.

:class:`ClearingHistory` is the only forecast a policy gets: the clearing prices it has seen so
far in each region, by hour of day (competing demand follows a daily cycle), nothing of the
future.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefect_spotgpu.economics.deadline import RegionQuote
from prefect_spotgpu.market import PoolQuote


@dataclass(frozen=True)
class Trace:
    name: str
    gap_seconds: float
    available: np.ndarray  # instances available at each tick
    gpus_per_node: int

    @property
    def hours(self) -> float:
        return len(self.available) * self.gap_seconds / 3600

    @property
    def zone(self) -> str:
        """The zone, e.g. ``us-east-1a`` of ``.../us-east-1a_v100_1``: the pool's region."""
        return self.name.rsplit("/", 1)[-1].rsplit("_", 2)[0]

    @property
    def kind(self) -> str:
        """Folder, date and instance type, e.g. ``1-node/aws-02-15-2023/v100_1``."""
        folder, stem = self.name.rsplit("/", 1)
        return f"{folder}/{stem.split('_', 1)[1]}"

    def truncated(self, length: int) -> Trace:
        return Trace(self.name, self.gap_seconds, self.available[:length], self.gpus_per_node)


def load_trace(path: Path) -> Trace:
    raw = json.loads(Path(path).read_text())
    data = np.asarray(raw["data"], dtype=np.int64)
    size = path.stem.rsplit("_", 1)[-1]
    gpus = int(size) if size.isdigit() and int(size) in (1, 2, 4, 8) else 1
    name = f"{path.parent.parent.name}/{path.parent.name}/{path.stem}"
    return Trace(name, float(raw["metadata"]["gap_seconds"]), data, gpus)


def load_traces(root: Path) -> list[Trace]:
    """Every trace under ``root``, sorted by name."""
    return sorted((load_trace(p) for p in Path(root).rglob("*.json")), key=lambda t: t.name)


@dataclass(frozen=True)
class Regions:
    """The zones of one date and instance type as the regions of one market, on one grid."""

    name: str  # e.g. "1-node/aws-02-15-2023/v100_1"
    traces: tuple[Trace, ...]  # one per region, all of the same length, sorted by zone

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("a market needs one region at least")
        first = self.traces[0]
        for t in self.traces:
            if t.gap_seconds != first.gap_seconds or t.gpus_per_node != first.gpus_per_node:
                raise ValueError(f"{t.name}: another tick or node size than {first.name}")
            if len(t.available) != len(first.available):
                raise ValueError(f"{t.name}: another length than {first.name}")
        if len({t.zone for t in self.traces}) != len(self.traces):
            raise ValueError(f"{self.name}: two traces of one zone")

    @classmethod
    def single(cls, trace: Trace) -> Regions:
        return cls(trace.name, (trace,))

    @classmethod
    def of(cls, traces: list[Trace]) -> Regions:
        """Traces of one kind as one market, truncated to the shortest."""
        length = min(len(t.available) for t in traces)
        kept = sorted((t.truncated(length) for t in traces), key=lambda t: t.zone)
        return cls(traces[0].kind, tuple(kept))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.zone for t in self.traces)

    @property
    def gap_seconds(self) -> float:
        return self.traces[0].gap_seconds

    @property
    def gpus_per_node(self) -> int:
        return self.traces[0].gpus_per_node

    @property
    def length(self) -> int:
        return len(self.traces[0].available)


def multi_zone_markets(traces: list[Trace]) -> list[Regions]:
    """The traces grouped by date, instance type and tick, where a group has two zones or more."""
    groups: dict[tuple[str, float], list[Trace]] = {}
    for t in traces:
        groups.setdefault((t.kind, t.gap_seconds), []).append(t)
    return [Regions.of(g) for _, g in sorted(groups.items()) if len(g) > 1]


def region_seed(seed: int, index: int) -> int:
    """The competing demand's seed of region ``index`` (region 0 keeps the job's seed, so a
    market of one region replays exactly as the single-region replay does)."""
    return seed + 7919 * index


class ClearingHistory:
    """The clearing prices seen so far per region, by hour of day; the forecast of the next
    ``horizon_h`` hours is the mean of each coming hour's profile (the overall mean for an hour
    not seen yet), None before any price is seen."""

    def __init__(self, regions: int, horizon_h: int = 6) -> None:
        self.horizon_h = horizon_h
        self.sums = np.zeros((regions, 24))
        self.counts = np.zeros((regions, 24))

    def add(self, region: int, now: float, price: float) -> None:
        hour = int(now // 3600) % 24
        self.sums[region, hour] += price
        self.counts[region, hour] += 1

    def forecast(self, region: int, now: float) -> float | None:
        seen = self.counts[region].sum()
        if seen == 0:
            return None
        overall = self.sums[region].sum() / seen
        hours = (int(now // 3600) + np.arange(self.horizon_h)) % 24
        counts = self.counts[region, hours]
        slot = np.where(counts > 0, self.sums[region, hours] / np.maximum(counts, 1), overall)
        return round(float(slot.mean()), 4)


def region_quote(
    quote: PoolQuote,
    *,
    cap: float,
    reserve: float,
    hysteresis: float,
    gpus_per_node: int,
    mine: bool,
    forecast: float | None,
) -> RegionQuote:
    """What a policy sees of one pool after a tick (``RegionQuote.read``)."""
    return RegionQuote.read(
        quote.region, clearing_price=quote.clearing_price, reserve=reserve,
        gpus_total=quote.gpus_total, gpus_free=quote.gpus_free, gpus_per_node=gpus_per_node,
        cap=cap, hysteresis=hysteresis, mine=mine, forecast=forecast,
    )  # fmt: skip
