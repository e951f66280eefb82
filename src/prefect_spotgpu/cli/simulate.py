"""A short simulated market: a few pools, bids arriving, a reclaim, a few clearing rounds.

The first README command runs it (``spotgpu demo``). Everything here is deterministic for a
given seed; it drives the real ``market.Market`` exactly as the service's tick loop will.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from prefect_spotgpu.market import (
    DEFAULT_CATALOG,
    Bid,
    Decision,
    Market,
    MarketConfig,
    Node,
    NodeState,
)
from prefect_spotgpu.market.decision import PlacementKind

POOLS = (
    ("RTX-4090", "eu-west", 6, 8, 0.30),
    ("RTX-4090", "us-east", 4, 8, 0.32),
    ("A100-80G", "eu-west", 4, 8, 0.90),
    ("H100-80G", "us-east", 3, 8, 2.00),
)
"""(model, region, nodes, GPUs per node, owner's reserve per GPU-hour)."""


@dataclass(frozen=True, slots=True)
class Round:
    number: int
    now: float
    decision: Decision
    events: tuple[str, ...]


def simulate(rounds: int = 6, seed: int = 2026, tick_seconds: float = 60.0) -> Iterator[Round]:
    """Yield each clearing round of a small simulated market."""
    rng = random.Random(seed)
    market = Market(MarketConfig(notice_seconds=300))
    node_id = 0
    for model, region, count, gpus, reserve in POOLS:
        for _ in range(count):
            node_id += 1
            market.upsert_node(Node(node_id, model, region, gpus, reserve))
    bid_id = 0
    now = 1_780_000_000.0
    for number in range(1, rounds + 1):
        events = []
        for _ in range(rng.randint(12, 24)):
            bid_id += 1
            model, region, *_ = rng.choice(POOLS)
            on_demand = DEFAULT_CATALOG.get(model).on_demand_price
            price = round(on_demand * rng.uniform(0.35, 0.85), 2)
            count = rng.choice((1, 1, 2, 4, 8))
            market.add_bid(
                Bid(
                    bid_id,
                    model,
                    count,
                    price,
                    region=rng.choice((region, region, "any")),
                    created_at=now,
                )
            )
        if number == 3:
            market.upsert_node(Node(1, "RTX-4090", "eu-west", 8, 0.30, NodeState.RECLAIMED))
            events.append("owner reclaims node 1 (RTX-4090, eu-west)")
        decision = market.tick(now)
        for notice in decision.notices:
            events.append(
                f"notice to bid {notice.bid_id} on node {notice.node_id}: "
                f"{notice.reason.value}, save by +{notice.deadline - now:.0f} s"
            )
        for placement in decision.placements:
            if placement.kind != PlacementKind.NEW:
                events.append(
                    f"bid {placement.bid_id}: {placement.kind.value} reservation "
                    f"on node {placement.node_id}"
                )
        yield Round(number, now, decision, tuple(events))
        now += tick_seconds
