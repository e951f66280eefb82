"""Clearing benchmark: how long one tick takes with N open bids on M nodes (issue: foundation).

Workload: 20 pools (5 GPU models x 4 regions), M = N / 10 nodes of 8 GPUs, bids asking
1/2/4/8 GPUs at 0.3-1.0x the model's on-demand price (10 % of them for any region), owner
reserves at 0.4x on-demand. Two kinds of tick:

- cold: the whole book is new (a fresh market loads N bids, then clears once);
- steady: 1 % of the bids changed since the last tick (a third new, a third cancelled, a third
  repriced by x0.8-1.25), incumbents running; the median of several ticks.

Side by side in one run: our engine; the same engine without its vectorised admission (the
one-by-one greedy loop, ``packing="first-fit"``); a cold rebuild against the incremental
steady tick; (``images``) the same market where every bid names one of three images and
half the nodes hold one: placement prefers, among equal fits, a node with the bid's image;
and (``gangs``) the same workload where 10 % of the N bids are gangs of 2-8 nodes, each of
its member bids added with ``add_bid`` as the service adds them (so ``gangs_member_bids``
counts more than N bids); and (``runners``) the same workload on mixed pools, where half the
nodes run processes and half Docker (a quarter of all nodes with a default image) and half the
bids name an image: each bid may take only a node that serves it (none is misplaced).
Welfare against the exact optimum is measured on 1,000 small random markets. Pinned to one
core. Prints one JSON object.

    python benchmarks/clearing.py [--sizes 10000,100000,1000000] [--steady-ticks 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from prefect_spotgpu.market import DEFAULT_CATALOG, Bid, Market, MarketConfig, Node, Runner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

RUNNERS = (  # by node id mod 4: (runner, default image)
    (Runner.DOCKER, True),
    (Runner.PROCESS, False),
    (Runner.DOCKER, False),
    (Runner.PROCESS, False),
)
MODELS = ("RTX-4090", "RTX-3090Ti", "A100-80G", "H100-80G", "H200")
REGIONS = ("ap-east", "eu-west", "us-central", "us-east")
SIZES = np.array([1, 2, 4, 8])
IMAGES = ("pytorch/pytorch:2.5.1", "nvcr.io/nvidia/pytorch:25.06-py3", "ml/train:1")


def build_market(
    n_bids: int,
    rng: np.random.Generator,
    packing: str = "best-fit",
    images: bool = False,
    runners: bool = False,
):
    """A market with its nodes registered, and the bid arrays to load (not yet loaded); with
    ``images``, every even node holds one image and every bid names one; with ``runners``,
    odd nodes run processes, even ones Docker (every fourth with a default image) and half the
    bids name an image (mixed pools: each bid only on a node that serves it)."""
    market = Market(MarketConfig(packing=packing))
    n_nodes = max(n_bids // 10, len(MODELS) * len(REGIONS))
    node_id = 0
    per_pool = n_nodes // (len(MODELS) * len(REGIONS))
    for model in MODELS:
        reserve = round(DEFAULT_CATALOG.get(model).on_demand_price * 0.4, 2)
        for region in REGIONS:
            for _ in range(per_pool):
                node_id += 1
                held = frozenset({IMAGES[node_id % 3]} if images and node_id % 2 == 0 else ())
                runner = RUNNERS[node_id % 4] if runners else (None, False)
                market.upsert_node(
                    Node(
                        node_id,
                        model,
                        region,
                        8,
                        reserve,
                        images=held,
                        runner=runner[0],
                        default_image=runner[1],
                    )
                )
    model_of = rng.integers(0, len(MODELS), n_bids)
    region_of = rng.integers(0, len(REGIONS), n_bids)
    region_of[rng.random(n_bids) < 0.10] = -1
    on_demand = np.array([DEFAULT_CATALOG.get(m).on_demand_price for m in MODELS])
    bids = {
        "ids": np.arange(1, n_bids + 1),
        "model": model_of,
        "region": region_of,
        "gpus": rng.choice(SIZES, n_bids),
        "price": np.round(on_demand[model_of] * rng.uniform(0.3, 1.0, n_bids), 2),
        "created": np.arange(n_bids, dtype=np.float64),
    }
    if images:
        bids["image"] = rng.integers(0, len(IMAGES), n_bids)
    if runners:  # -1: no image
        bids["image"] = np.where(rng.random(n_bids) < 0.5, rng.integers(0, len(IMAGES), n_bids), -1)
    return market, node_id, bids


def add_gangs(market: Market, rng: np.random.Generator, n_gangs: int, first_id: int, now: float):
    """``n_gangs`` gang bids of 2-8 nodes (one member bid per node), added one by one as the
    service adds them; returns the next free bid id."""
    on_demand = np.array([DEFAULT_CATALOG.get(m).on_demand_price for m in MODELS])
    next_id = first_id
    for _ in range(n_gangs):
        model = int(rng.integers(0, len(MODELS)))
        region = int(rng.integers(-1, len(REGIONS)))
        count = int(rng.integers(2, 9))
        terms = {
            "gpu_model": MODELS[model],
            "gpu_count": int(rng.choice(SIZES)),
            "max_price": round(float(on_demand[model] * rng.uniform(0.3, 1.0)), 2),
            "region": "any" if region < 0 else REGIONS[region],
            "created_at": now,
            "node_count": count,
            "gang_id": next_id,
        }
        for k in range(count):
            market.add_bid(Bid(next_id + k, **terms))
        next_id += count
    return next_id


def load(market: Market, bids: dict) -> None:
    """Load bids one (model, region) group at a time, as the service's bulk loader would."""
    group = bids["model"] * (len(REGIONS) + 1) + (bids["region"] + 1)
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(len(MODELS) * (len(REGIONS) + 1) + 1))
    for g in range(len(bounds) - 1):
        sel = order[bounds[g] : bounds[g + 1]]
        if len(sel) == 0:
            continue
        mi, ri = divmod(g, len(REGIONS) + 1)
        market.add_bid_arrays(
            gpu_model=MODELS[mi],
            region="any" if ri == 0 else REGIONS[ri - 1],
            ids=bids["ids"][sel],
            gpu_counts=bids["gpus"][sel],
            max_prices=bids["price"][sel],
            created_at=bids["created"][sel],
            images=[IMAGES[i] if i >= 0 else None for i in bids["image"][sel]]
            if "image" in bids
            else None,
        )


def cold_tick(
    n_bids: int,
    seed: int,
    packing: str = "best-fit",
    images: bool = False,
    gangs: float = 0.0,
    runners: bool = False,
) -> dict:
    """One cold tick; ``gangs``: that share of the ``n_bids`` bids are gangs of 2-8 nodes."""
    rng = np.random.default_rng(seed)
    n_gangs = int(n_bids * gangs)
    market, n_nodes, bids = build_market(n_bids - n_gangs, rng, packing, images, runners)
    t0 = time.perf_counter()
    load(market, bids)
    if n_gangs:
        add_gangs(market, rng, n_gangs, n_bids * 10, 0.0)
    t1 = time.perf_counter()
    decision = market.tick(1_000.0)
    t2 = time.perf_counter()
    return {
        "market": market,
        "rng": rng,
        "nodes": n_nodes,
        "load_seconds": t1 - t0,
        "tick_seconds": t2 - t1,
        "placements": len(decision.placements),
        "gpus_placed": int(decision.placements.gpu_count.sum()),
        "on_a_node_with_the_image": _with_image(market, decision) if images else None,
        "on_a_node_that_does_not_serve_it": _misplaced(market, decision) if runners else None,
    }


def _misplaced(market: Market, decision) -> int:
    """Placements on a node whose runner does not serve the bid (must be none)."""
    rows, b = market.index.node_row, market.index.b
    return sum(
        not market.index.serves(rows[int(n)], int(b.image[market.index.bid_row[int(i)]]))
        for i, n in zip(decision.placements.bid_id, decision.placements.node_id, strict=True)
    )


def _with_image(market: Market, decision) -> float:
    """The share of placements on a node that holds the bid's image."""
    rows = market.index.node_row
    hits = sum(
        int(market.index.b.image[market.index.bid_row[int(b)]])
        in market.index.n_images[rows[int(n)]]
        for b, n in zip(decision.placements.bid_id, decision.placements.node_id, strict=True)
    )
    return round(hits / max(len(decision.placements), 1), 3)


def steady_ticks(
    market: Market,
    rng: np.random.Generator,
    n_bids: int,
    ticks: int,
    images: bool = False,
    gangs: float = 0.0,
    runners: bool = False,
) -> dict:
    now, next_id = 1_000.0, n_bids + 1
    next_gang_id = n_bids * 20
    apply_times, tick_times, notices, placements = [], [], [], []
    on_demand = np.array([DEFAULT_CATALOG.get(m).on_demand_price for m in MODELS])
    for _ in range(ticks):
        changes = max(n_bids // 100, 3)
        third = changes // 3
        open_ids = np.fromiter(market.index.bid_row.keys(), np.int64)  # the benchmark's shortcut
        picked = rng.choice(open_ids, 2 * third, replace=False)
        t0 = time.perf_counter()
        new = {
            "ids": np.arange(next_id, next_id + third),
            "model": rng.integers(0, len(MODELS), third),
            "region": rng.integers(-1, len(REGIONS), third),
            "gpus": rng.choice(SIZES, third),
            "created": np.full(third, now),
        }
        new["price"] = np.round(on_demand[new["model"]] * rng.uniform(0.3, 1.0, third), 2)
        if images:
            new["image"] = rng.integers(0, len(IMAGES), third)
        if runners:
            new["image"] = np.where(
                rng.random(third) < 0.5, rng.integers(0, len(IMAGES), third), -1
            )
        next_id += third
        load(market, new)
        if gangs:
            next_gang_id = add_gangs(market, rng, int(third * gangs), next_gang_id, now)
        for bid_id in picked[:third].tolist():
            if market.has_bid(bid_id):  # (a gang member's cancel closed its whole gang)
                market.cancel_bid(bid_id, now + 0.5)
        snapshot_prices = market.index.b.price  # read-only use: the current prices by row
        rows = market.index.bid_row
        for bid_id, factor in zip(
            picked[third:].tolist(), rng.uniform(0.8, 1.25, third), strict=True
        ):
            if not market.has_bid(bid_id):
                continue
            price = round(float(snapshot_prices[rows[bid_id]]) * float(factor), 2)
            market.reprice_bid(bid_id, max(price, 0.01))
        t1 = time.perf_counter()
        now += 1.0
        decision = market.tick(now)
        t2 = time.perf_counter()
        apply_times.append(t1 - t0)
        tick_times.append(t2 - t1)
        notices.append(len(decision.notices))
        placements.append(len(decision.placements))
    return {
        "tick_seconds": statistics.median(tick_times),
        "tick_seconds_max": max(tick_times),
        "apply_seconds": statistics.median(apply_times),
        "changes_per_tick": 3 * (max(n_bids // 100, 3) // 3),
        "notices_per_tick": statistics.median(notices),
        "placements_per_tick": statistics.median(placements),
    }


def welfare(n: int) -> dict:
    from test_optimum import welfare_ratios

    out = {}
    for packing in ("best-fit", "first-fit"):
        ratios = welfare_ratios(n, packing=packing)
        out[packing] = {
            "mean": round(sum(ratios) / n, 4),
            "worst": round(min(ratios), 4),
            "optimal_share": round(sum(r == 1.0 for r in ratios) / n, 3),
        }
    return out


def gang_welfare(n: int) -> dict:
    """Best fit against the exact optimum on small markets where some bids are gangs."""
    from test_optimum import welfare_ratios

    ratios = welfare_ratios(n, gangs=True)
    return {
        "mean": round(sum(ratios) / n, 4),
        "worst": round(min(ratios), 4),
        "optimal_share": round(sum(r == 1.0 for r in ratios) / n, 3),
    }


def variant_figures(row: dict, kind: str, cold: dict, steady: dict) -> None:
    """A variant's cold and steady ticks into ``row`` as ``{kind}_*``, beside the plain run's
    (the ratios: None where the plain tick took no measurable time)."""
    row[f"{kind}_cold_seconds_per_tick"] = round(cold["tick_seconds"], 4)
    row[f"{kind}_steady_seconds_per_tick"] = round(steady["tick_seconds"], 4)
    row[f"{kind}_gpus_placed_cold"] = cold["gpus_placed"]
    for tick, seconds in (("cold", cold["tick_seconds"]), ("steady", steady["tick_seconds"])):
        plain = row[f"{tick}_seconds_per_tick"]
        row[f"{kind}_vs_plain_{tick}_ratio"] = round(seconds / plain, 2) if plain else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--steady-ticks", type=int, default=5)
    parser.add_argument("--welfare-instances", type=int, default=1000)
    parser.add_argument("--no-naive", action="store_true", help="skip the one-by-one baseline")
    parser.add_argument("--no-images", action="store_true", help="skip the run with images")
    parser.add_argument("--no-gangs", action="store_true", help="skip the run with 10%% gangs")
    parser.add_argument(
        "--no-runners", action="store_true", help="skip the run with process and Docker nodes"
    )
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        cold = cold_tick(n, seed=n)
        steady = steady_ticks(cold["market"], cold["rng"], n, args.steady_ticks)
        row = {
            "bids": n,
            "nodes": cold["nodes"],
            "gpus": cold["nodes"] * 8,
            "cold_seconds_per_tick": round(cold["tick_seconds"], 4),
            "cold_load_seconds": round(cold["load_seconds"], 4),
            "cold_load_and_tick_seconds": round(cold["load_seconds"] + cold["tick_seconds"], 4),
            "steady_seconds_per_tick": round(steady["tick_seconds"], 4),
            "steady_seconds_per_tick_max": round(steady["tick_seconds_max"], 4),
            "steady_apply_seconds": round(steady["apply_seconds"], 4),
            "steady_changes_per_tick": steady["changes_per_tick"],
            "steady_notices_per_tick": steady["notices_per_tick"],
            "steady_placements_per_tick": steady["placements_per_tick"],
            "placements_cold": cold["placements"],
            "gpus_placed_cold": cold["gpus_placed"],
            "bids_per_second_cold": round(n / cold["tick_seconds"]),
            "steady_vs_cold_ratio": round(steady["tick_seconds"] / cold["tick_seconds"], 3),
        }
        del cold
        if not args.no_naive:
            naive = cold_tick(n, seed=n, packing="first-fit")
            row["naive_one_by_one_cold_seconds"] = round(naive["tick_seconds"], 4)
            row["naive_gpus_placed"] = naive["gpus_placed"]
            row["speedup_vs_one_by_one"] = (
                round(naive["tick_seconds"] / cold_s, 1)
                if (cold_s := row["cold_seconds_per_tick"])
                else None
            )
            del naive
        if not args.no_images:
            with_images = cold_tick(n, seed=n, images=True)
            steady_images = steady_ticks(
                with_images["market"], with_images["rng"], n, args.steady_ticks, images=True
            )
            variant_figures(row, "images", with_images, steady_images)
            row["images_cold_placements_on_a_node_with_the_image"] = with_images[
                "on_a_node_with_the_image"
            ]
            del with_images
        if not args.no_runners:
            mixed = cold_tick(n, seed=n, runners=True)
            steady_mixed = steady_ticks(
                mixed["market"], mixed["rng"], n, args.steady_ticks, runners=True
            )
            variant_figures(row, "runners", mixed, steady_mixed)
            row["runners_placements_on_a_node_that_does_not_serve_it"] = mixed[
                "on_a_node_that_does_not_serve_it"
            ]
            del mixed
        if not args.no_gangs:
            with_gangs = cold_tick(n, seed=n, gangs=0.10)
            steady_gangs = steady_ticks(
                with_gangs["market"], with_gangs["rng"], n, args.steady_ticks, gangs=0.10
            )
            row["gangs_share_of_bids"] = 0.10
            row["gangs_member_bids"] = len(with_gangs["market"].index.bid_row)
            row["gangs_cold_load_seconds"] = round(with_gangs["load_seconds"], 4)
            variant_figures(row, "gangs", with_gangs, steady_gangs)
            del with_gangs
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    largest = max(results, key=lambda r: r["bids"])
    out = {
        "benchmark": "clearing",
        "one_core": True,
        "pools": len(MODELS) * len(REGIONS),
        "results": results,
        "welfare_vs_optimum": welfare(args.welfare_instances),
        "welfare_vs_optimum_with_gangs": gang_welfare(args.welfare_instances),
        "targets": {
            "at_bids": largest["bids"],
            "cold_tick_le_1s": largest["cold_seconds_per_tick"] <= 1.0,
            "steady_tick_le_0_1s": largest["steady_seconds_per_tick"] <= 0.1,
            # None: that run was skipped
            **{
                f"{kind}_{tick}_tick_le_{name}": None
                if f"{kind}_{tick}_seconds_per_tick" not in largest
                else largest[f"{kind}_{tick}_seconds_per_tick"] <= limit
                for kind in ("images", "gangs", "runners")
                for tick, name, limit in (("cold", "1s", 1.0), ("steady", "0_1s", 0.1))
            },
        },
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
