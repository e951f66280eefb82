"""Our greedy clearing against the welfare-optimal placement on small random markets."""

import random

from prefect_spotgpu.market import Bid, MarketConfig, MarketState, Node, clear
from prefect_spotgpu.market.optimum import optimal_welfare, welfare

REGIONS = ("eu-west", "us-east")


def random_instance(rng: random.Random, gangs: bool = False):
    """A small random market; with ``gangs``, up to 6 nodes and some bids are gangs of 2-3
    nodes (at most 16 member bids in all)."""
    models = ("A100-80G", "RTX-4090")
    nodes = [
        Node(
            j + 1,
            rng.choice(models),
            rng.choice(REGIONS),
            rng.choice((1, 2, 4, 8)),
            rng.choice((0.2, 0.5, 0.8)),
        )
        for j in range(rng.randint(2 if gangs else 1, 6 if gangs else 4))
    ]
    bids, next_id = [], 1
    for i in range(rng.randint(1, 12)):
        count = rng.choice((1, 1, 2, 3)) if gangs else 1
        if len(bids) + count > 16:
            break
        terms = {
            "gpu_model": rng.choice(models),
            "gpu_count": rng.choice((1, 1, 2, 2, 4, 8)),
            "max_price": round(rng.uniform(0.1, 3.0), 2),
            "region": rng.choice((*REGIONS, "any")),
            "created_at": float(i),
        }
        gang = {"node_count": count, "gang_id": next_id} if count > 1 else {}
        bids.extend(Bid(next_id + k, **terms, **gang) for k in range(count))
        next_id += count
    return nodes, bids


def welfare_ratios(
    n: int, seed: int = 7, packing: str = "best-fit", gangs: bool = False
) -> list[float]:
    rng = random.Random(seed)
    config = MarketConfig(regions=frozenset(REGIONS), packing=packing)
    ratios = []
    for _ in range(n):
        nodes, bids = random_instance(rng, gangs)
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


def test_greedy_welfare_with_gangs_is_close_to_the_optimum_on_500_random_markets():
    ratios = welfare_ratios(500, gangs=True)
    mean = sum(ratios) / len(ratios)
    # measured: mean 0.976, worst 0.27 (a gang that outprices bids of more total value)
    assert mean >= 0.95, mean
