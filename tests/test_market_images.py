"""Placement prefers, among equal fits, a node that already holds the bid's image (no pull):
worked examples, one behaviour each. A tighter fit or a lower reserve still comes first."""

from prefect_spotgpu.market import Bid, Market, MarketConfig, Node

A100 = "A100-80G"
TORCH = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"


def market_with(*nodes, **config):
    market = Market(MarketConfig(**config))
    for node in nodes:
        market.upsert_node(node)
    return market


def node(i, gpus=8, images=(), region="eu-west", reserve=0.9):
    return Node(i, A100, region, gpus, reserve, images=frozenset(images))


def bid(i, gpus, image=None, region="eu-west", price=1.5):
    return Bid(i, A100, gpus, price, region=region, created_at=float(i), image=image)


def placed(decision):
    return {p.bid_id: p.node_id for p in decision.placements}


def test_among_equal_fits_the_node_with_the_image_wins():
    m = market_with(node(1), node(2, images={TORCH}), node(3))
    m.add_bid(bid(1, 2, TORCH))
    assert placed(m.tick(10.0)) == {1: 2}
    m.add_bid(bid(2, 8))  # no image: the lowest node id among equal fits, as before
    assert placed(m.tick(11.0)) == {2: 1}


def test_without_a_holder_the_rule_is_unchanged():
    m = market_with(node(1), node(2, images={"other:1"}))
    m.add_bid(bid(1, 2, TORCH))
    assert placed(m.tick(10.0)) == {1: 1}


def test_a_tighter_fit_beats_the_image():
    m = market_with(node(1, gpus=2), node(2, gpus=8, images={TORCH}))
    m.add_bid(bid(1, 2, TORCH))
    assert placed(m.tick(10.0)) == {1: 1}  # node 2 stays whole for an 8-GPU bid


def test_a_lower_reserve_beats_the_image():
    m = market_with(node(1, reserve=0.5), node(2, reserve=0.9, images={TORCH}))
    m.add_bid(bid(1, 2, TORCH))
    assert placed(m.tick(10.0)) == {1: 1}


def test_an_any_region_bid_goes_to_the_pool_whose_node_has_the_image():
    m = market_with(node(1, region="eu-west"), node(2, region="us-east", images={TORCH}))
    m.add_bid(bid(1, 2, TORCH, region="any"))
    assert placed(m.tick(10.0)) == {1: 2}


def test_images_follow_the_nodes_reports():
    m = market_with(node(1), node(2, images={TORCH}))
    m.tick(1.0)
    m.upsert_node(node(1, images={TORCH}))  # node 1 pulled it, node 2 pruned it
    m.upsert_node(node(2))
    m.add_bid(bid(1, 2, TORCH))
    assert placed(m.tick(10.0)) == {1: 1}
    m.upsert_node(node(1))
    m.upsert_node(node(2, images={TORCH}))
    m.add_bid(bid(2, 2, TORCH))  # node 1 has 6 free now, node 2 8: the tighter fit wins
    m.add_bid(bid(3, 6, TORCH))
    assert placed(m.tick(11.0)) == {2: 1, 3: 2}


def test_busy_pools_prefer_the_image_too():
    m = market_with(node(1), node(2), node(3, images={TORCH}))
    m.add_bid(bid(1, 4))
    m.add_bid(bid(2, 4))
    m.add_bid(bid(3, 4))
    assert placed(m.tick(1.0)) == {1: 1, 2: 1, 3: 2}
    m.add_bid(bid(4, 4, TORCH))  # node 2 has 4 free, node 3 8: node 2 fits tighter
    m.add_bid(bid(5, 2, TORCH))  # node 2 is full then: node 3
    assert placed(m.tick(2.0)) == {4: 2, 5: 3}


def test_first_fit_ignores_images():
    m = market_with(node(1), node(2, images={TORCH}), packing="first-fit")
    m.add_bid(bid(1, 2, TORCH))
    assert placed(m.tick(10.0)) == {1: 1}


def test_the_snapshot_keeps_images():
    m = market_with(node(1), node(2, images={TORCH}))
    m.add_bid(bid(1, 2, TORCH))
    state = m.snapshot()
    assert {n.id: n.images for n in state.nodes} == {1: frozenset(), 2: frozenset({TORCH})}
    assert [b.image for b in state.bids] == [TORCH]
    assert placed(Market.from_state(state).tick(10.0)) == {1: 2}


def test_bulk_loaded_bids_keep_their_images():
    import numpy as np

    m = market_with(node(1), node(2, images={TORCH}))
    m.add_bid_arrays(
        gpu_model=A100,
        region="eu-west",
        ids=np.array([1, 2]),
        gpu_counts=np.array([8, 2]),
        max_prices=np.array([1.5, 1.4]),
        created_at=np.array([0.0, 1.0]),
        images=[None, TORCH],
    )
    m.compact()
    assert placed(m.tick(10.0)) == {1: 1, 2: 2}


def test_a_large_fresh_pool_is_packed_in_bulk_whatever_the_images():
    """The documented trade-off (``bulk.IMAGE_AWARE_BULK_NODES``): a cold start of a pool
    this large is packed in bulk, for speed; every later tick prefers the image again."""
    from prefect_spotgpu.market.bulk import IMAGE_AWARE_BULK_NODES

    many = IMAGE_AWARE_BULK_NODES + 1
    m = market_with(*(node(i) for i in range(1, many)), node(many, images={TORCH}))
    m.add_bid(bid(1, 8, TORCH))
    assert placed(m.tick(10.0)) == {1: 1}  # bulk: the smallest, lowest node
    m.add_bid(bid(2, 8, TORCH))
    assert placed(m.tick(11.0)) == {2: many}  # one by one: the node with the image
