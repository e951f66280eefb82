"""Our greedy clearing against the welfare-optimal placement on small random markets."""

import random

from prefect_spotgpu.market import Bid, MarketConfig, MarketState, Node, clear
from prefect_spotgpu.market.optimum import optimal_welfare, welfare

REGIONS = ("eu-west", "us-east")


def random_instance(rng: random.Random):
    models = ("A100-80G", "RTX-4090")
    nodes = [
        Node(
            j + 1,
            rng.choice(models),
            rng.choice(REGIONS),
            rng.choice((1, 2, 4, 8)),
            rng.choice((0.2, 0.5, 0.8)),
        )
        for j in range(rng.randint(1, 4))
    ]
    bids = [
        Bid(
            i + 1,
            rng.choice(models),
            rng.choice((1, 1, 2, 2, 4, 8)),
            round(rng.uniform(0.1, 3.0), 2),
            region=rng.choice((*REGIONS, "any")),
            created_at=float(i),
        )
        for i in range(rng.randint(1, 12))
    ]
    return nodes, bids


def welfare_ratios(n: int, seed: int = 7, packing: str = "best-fit") -> list[float]:
    rng = random.Random(seed)
    config = MarketConfig(regions=frozenset(REGIONS), packing=packing)
    ratios = []
    for _ in range(n):
        nodes, bids = random_instance(rng)
        decision = clear(MarketState(tuple(nodes), tuple(bids), config=config), 1.0)
        ours = welfare({b.id: b for b in bids}, [p.bid_id for p in decision.placements])
        best = optimal_welfare(nodes, bids)
        assert ours <= best + 1e-9, "the greedy cannot beat the optimum"
        ratios.append(1.0 if best == 0 else ours / best)
    return ratios


def test_optimum_of_a_tiny_market_by_hand():
    nodes = [Node(1, "A100-80G", "eu-west", 8, 0.5)]
    bids = [
        Bid(1, "A100-80G", 1, 3.0, "eu-west"),
        Bid(2, "A100-80G", 8, 2.0, "eu-west"),
        Bid(3, "A100-80G", 4, 0.4, "eu-west"),
    ]
    # 8 GPUs at 2.0 (=16) beat 1 at 3.0 (=3); bid 3 is below the reserve
    assert optimal_welfare(nodes, bids) == 16.0


def test_greedy_welfare_is_close_to_the_optimum_on_1000_random_markets():
    ratios = welfare_ratios(1000)
    mean = sum(ratios) / len(ratios)
    # measured: mean 0.97, worst 0.13 (a small high bid that blocks a big, slightly lower one
    # on the only node: the price-priority rule accepts that loss to stay truthful and stable)
    assert mean >= 0.95, mean
    assert min(ratios) >= 0.10, min(ratios)
    assert sum(r == 1.0 for r in ratios) >= 750
