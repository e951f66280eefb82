"""Bad input to the market's constructors fails with a ValueError naming the field and value."""

import math

import numpy as np
import pytest

from prefect_spotgpu.market import (
    Allocation,
    Bid,
    Interval,
    Market,
    MarketConfig,
    MarketState,
    Node,
)

BAD_PRICES = [0, -1.5, math.nan, math.inf, -math.inf, "1.2", None, True]


@pytest.mark.parametrize("price", BAD_PRICES)
def test_bid_price_must_be_positive_and_finite(price):
    with pytest.raises(ValueError, match="max_price") as err:
        Bid(1, "A100-80G", 1, price)
    assert repr(price) in str(err.value)


@pytest.mark.parametrize("price", BAD_PRICES)
def test_node_reserve_must_be_positive_and_finite(price):
    with pytest.raises(ValueError, match="reserve_price"):
        Node(1, "A100-80G", "eu-west", 8, price)


@pytest.mark.parametrize("count", [0, -1, 17, 100, 2.0, True])
def test_gpu_count_between_one_and_a_node(count):
    with pytest.raises(ValueError, match="gpu_count") as err:
        Bid(1, "A100-80G", count, 1.0)
    assert repr(count) in str(err.value)
    with pytest.raises(ValueError, match="gpu_count"):
        Node(1, "A100-80G", "eu-west", count, 1.0)


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="gpu_model 'B200' is not a known GPU model"):
        Bid(1, "B200", 1, 1.0)


@pytest.mark.parametrize("region", ["", "EU WEST!", "-x", 5, "any"])
def test_node_region_must_be_a_region_name(region):
    with pytest.raises(ValueError, match="region"):
        Node(1, "A100-80G", region, 8, 1.0)


def test_bid_region_unknown_to_the_market_is_rejected():
    state_nodes = (Node(1, "A100-80G", "eu-west", 8, 1.0),)
    with pytest.raises(ValueError, match="region 'us-east' of bid 7 is not a known region"):
        MarketState(state_nodes, (Bid(7, "A100-80G", 1, 1.0, region="us-east"),))
    market = Market(MarketConfig(regions=frozenset({"eu-west"})))
    with pytest.raises(ValueError, match="region 'ap-south' is not a known region"):
        market.add_bid(Bid(1, "A100-80G", 1, 1.0, region="ap-south"))
    market.add_bid(Bid(2, "A100-80G", 1, 1.0, region="any"))  # any is always fine


def test_windows_and_times_are_checked():
    with pytest.raises(ValueError, match=r"window\.end must be after window\.start"):
        Interval(10, 10)
    with pytest.raises(ValueError, match="created_at"):
        Bid(1, "A100-80G", 1, 1.0, created_at=math.nan)
    with pytest.raises(ValueError, match="deadline"):
        Bid(1, "A100-80G", 1, 1.0, deadline=math.inf)
    with pytest.raises(ValueError, match="now must not go backwards"):
        market = Market()
        market.tick(10)
        market.tick(9)


def test_config_is_checked_and_unknown_policy_lists_valid_ones():
    with pytest.raises(ValueError, match="hysteresis"):
        MarketConfig(hysteresis=-0.1)
    with pytest.raises(ValueError, match="notice_seconds"):
        MarketConfig(notice_seconds=0)
    with pytest.raises(ValueError, match="'cheapest' is not known; valid policies: best-fit"):
        MarketConfig(packing="cheapest")


def test_state_references_are_checked():
    node = Node(1, "A100-80G", "eu-west", 8, 1.0)
    bid = Bid(1, "A100-80G", 1, 1.5, region="eu-west")
    alloc = Allocation(5, 1, 2, 1, "running", 0.0, 0.0)
    with pytest.raises(ValueError, match="unknown node_id 2"):
        MarketState((node,), (bid,), (alloc,), next_allocation_id=6)
    with pytest.raises(ValueError, match="duplicate bid id 1"):
        MarketState((node,), (bid, bid))
    with pytest.raises(ValueError, match="next_allocation_id"):
        MarketState((node,), (bid,), (Allocation(5, 1, 1, 1, "running", 0.0, 0.0),))
    with pytest.raises(ValueError, match="needs a deadline"):
        Allocation(5, 1, 1, 1, "noticed", 0.0, 0.0)


def test_bulk_load_rejects_bad_rows_and_writes_nothing():
    market = Market()
    market.upsert_node(Node(1, "A100-80G", "eu-west", 8, 1.0))
    good = dict(
        gpu_model="A100-80G",
        region="eu-west",
        ids=np.arange(3),
        gpu_counts=np.array([1, 2, 4]),
        max_prices=np.array([1.0, 2.0, 3.0]),
        created_at=np.zeros(3),
    )
    for field, bad in [
        ("max_prices", np.array([1.0, np.nan, 3.0])),
        ("gpu_counts", np.array([1, 0, 4])),
        ("ids", np.array([1, 1, 2])),
    ]:
        with pytest.raises(ValueError):
            market.add_bid_arrays(**{**good, field: bad})
    assert market.snapshot().bids == ()
    market.add_bid_arrays(**good)
    assert len(market.snapshot().bids) == 3
    with pytest.raises(ValueError, match="already in the book"):
        market.add_bid_arrays(**good)
