"""Runners and images meet in the pure market: a bid lands only on a node that can run it as
asked (``types.Runner``). Worked examples, one behaviour each; the property tests of
``test_market_properties.py`` check the same over random market lives."""

from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    Market,
    MarketConfig,
    Node,
    NodeState,
    Runner,
)

A100 = "A100-80G"
TORCH = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"


def market_with(*nodes):
    market = Market(MarketConfig(notice_seconds=300))
    for node in nodes:
        market.upsert_node(node)
    return market


def node(
    i, runner, gpus=8, reserve=0.5, default_image=False, state=NodeState.LIVE, job_network=False
):
    return Node(
        i,
        A100,
        "eu-west",
        gpus,
        reserve,
        state,
        runner=runner,
        default_image=default_image,
        job_network=job_network,
    )


def bid(i, gpus=8, image=None, price=1.5, node_count=1, gang_id=None):
    return Bid(
        i,
        A100,
        gpus,
        price,
        region="eu-west",
        created_at=float(gang_id or i),
        image=image,
        node_count=node_count,
        gang_id=gang_id,
    )


def placed(decision):
    return {p.bid_id: p.node_id for p in decision.placements}


def test_an_image_bid_goes_to_a_docker_node_and_a_process_bid_to_a_process_node():
    # the process node is cheaper and registered first: without runners both would land there
    m = market_with(node(1, Runner.PROCESS, reserve=0.5), node(2, Runner.DOCKER, reserve=0.9))
    m.add_bid(bid(1, image=TORCH))
    m.add_bid(bid(2))
    assert placed(m.tick(10.0)) == {1: 2, 2: 1}


def test_an_image_bid_waits_for_a_docker_node_while_process_bids_behind_it_run():
    m = market_with(node(1, Runner.PROCESS), node(2, Runner.DOCKER))
    m.add_bid(bid(1, image=TORCH, price=3.0))
    m.add_bid(bid(2, image=TORCH, price=2.0))  # the docker node is taken: it waits
    m.add_bid(bid(3, price=1.0))  # same size, lower price, no image: the process node
    assert placed(m.tick(10.0)) == {1: 2, 3: 1}
    quote = next(q for q in m.tick(11.0).quotes if q.gpu_model == A100)
    assert quote.waiting_bids == 1


def test_an_outbidding_image_bid_evicts_only_on_a_docker_node():
    m = market_with(node(1, Runner.PROCESS), node(2, Runner.DOCKER))
    m.add_bid(bid(1, price=1.0))  # process, on node 1
    m.add_bid(bid(2, image=TORCH, price=1.0))  # image, on node 2
    assert placed(m.tick(10.0)) == {1: 1, 2: 2}
    m.add_bid(bid(3, image=TORCH, price=5.0))  # beats both: only bid 2's node can run it
    decision = m.tick(11.0)
    assert [n.allocation_id for n in decision.notices] == [2]  # bid 2's allocation
    assert placed(decision) == {3: 2}


def test_a_docker_node_with_a_default_image_serves_process_bids_and_one_without_does_not():
    bare = market_with(node(1, Runner.DOCKER))
    assert "without a default image" in bare.runners.unserved(bid(1))
    assert bare.runners.unserved(bid(2, image=TORCH)) is None
    bare.add_bid(bid(1))  # (the service would hold it; the market never places it wrongly)
    assert placed(bare.tick(10.0)) == {}
    with_default = market_with(node(1, Runner.DOCKER, default_image=True))
    assert with_default.runners.unserved(bid(1)) is None
    with_default.add_bid(bid(1))
    assert placed(with_default.tick(10.0)) == {1: 1}


def test_a_bid_no_node_serves_is_named_and_pools_without_nodes_say_nothing():
    m = market_with(node(1, Runner.PROCESS), node(2, Runner.PROCESS))
    reason = m.runners.unserved(bid(1, image=TORCH))
    assert reason.startswith("the A100-80G nodes in eu-west run jobs as host processes")
    assert TORCH in reason
    assert m.runners.unserved(bid(2)) is None
    # no node yet: nodes may come
    assert market_with().runners.unserved(bid(3, image=TORCH)) is None
    lost = market_with(node(1, Runner.DOCKER, state=NodeState.LOST), node(2, Runner.PROCESS))
    assert lost.runners.unserved(bid(4, image=TORCH)) is not None  # a lost node serves nothing


def test_an_agent_restarted_with_another_runner_is_offered_by_its_new_kind():
    m = market_with(node(1, Runner.DOCKER), node(2, Runner.PROCESS))
    m.upsert_node(node(1, Runner.PROCESS))  # the same host, now a process node
    m.add_bid(bid(1, image=TORCH))
    m.add_bid(bid(2))
    m.add_bid(bid(3))
    assert placed(m.tick(10.0)) == {2: 1, 3: 2}  # no image bid lands on the old docker node
    m.upsert_node(node(1, None))  # an agent that says nothing serves any bid, as before
    assert m.runners.unserved(bid(4, image=TORCH)) is None


def test_a_gang_that_names_an_image_takes_docker_nodes_with_a_job_network_only():
    m = market_with(
        node(1, Runner.PROCESS),
        node(2, Runner.DOCKER, job_network=True),
        node(3, Runner.PROCESS),
        node(4, None),
        node(5, Runner.DOCKER, gpus=1),  # the tightest fit, but its containers reach no host
    )
    m.add_bid(bid(10, image=TORCH, gpus=1, node_count=2, gang_id=10))
    m.add_bid(bid(11, image=TORCH, gpus=1, node_count=2, gang_id=10))
    assert sorted(placed(m.tick(10.0)).values()) == [2, 4]  # one with a network, one not said
    m.add_bid(bid(12, image=TORCH, gpus=1))  # a one-node bid takes the network-less node
    assert placed(m.tick(11.0)) == {12: 5}


def test_a_gang_in_containers_where_no_docker_node_has_a_job_network_is_unserved():
    m = market_with(node(1, Runner.DOCKER), node(2, Runner.DOCKER, default_image=True))
    gang = bid(10, image=TORCH, node_count=2, gang_id=10)
    assert "--job-subnet" in m.runners.unserved(gang)
    assert m.runners.unserved(bid(12, image=TORCH)) is None  # one node: any Docker node serves it
    m.add_bid(gang)
    m.add_bid(bid(11, image=TORCH, node_count=2, gang_id=10))
    assert placed(m.tick(10.0)) == {}  # and the market never places it on them
    m.upsert_node(node(3, Runner.DOCKER, job_network=True))
    assert m.runners.unserved(gang) is None


def test_a_snapshot_keeps_what_each_node_serves():
    m = market_with(node(1, Runner.PROCESS), node(2, Runner.DOCKER), node(3, None))
    serves = {n.id: n.serves for n in m.snapshot().nodes}
    assert serves == {1: 5, 2: 2, 3: 7}  # (serving.serves_mask)


def test_a_bad_runner_is_refused_naming_the_field():
    import pytest

    with pytest.raises(ValueError, match="runner must be one of process, docker"):
        Node(1, A100, "eu-west", 8, 0.5, runner="podman")
    with pytest.raises(ValueError, match="default_image must be a boolean"):
        Node(1, A100, "eu-west", 8, 0.5, runner=Runner.DOCKER, default_image="yes")
    with pytest.raises(ValueError, match="job_network must be a boolean"):
        Node(1, A100, "eu-west", 8, 0.5, runner=Runner.DOCKER, job_network=1)


def test_in_a_mixed_pool_an_image_bid_waiting_for_docker_does_not_raise_process_prices():
    """A hostile buyer's high image bids that only a Docker node could take do not set what
    the jobs on process nodes pay; the losers of their own kind do."""
    m = market_with(node(1, Runner.PROCESS, gpus=8, reserve=0.5), node(2, Runner.DOCKER, gpus=8))
    m.add_bid(bid(1, price=1.0))  # process: node 1
    m.add_bid(bid(2, image=TORCH, price=3.0))  # image: node 2
    m.add_bid(bid(3, image=TORCH, price=3.1))  # image: node 2 is taken, it waits
    m.add_bid(bid(4, price=0.8))  # process: loses to bid 1, sets the process price
    m.tick(10.0)
    quote = next(q for q in m.tick(11.0).quotes if q.gpu_model == A100)
    assert quote.kind_prices is not None and quote.kind_prices[0] == 0.8
    assert quote.kind_prices[1] >= 3.0
    process_job = next(a for a in m.snapshot().allocations if a.bid_id == 1)
    assert m.price_in_force(process_job.id) == 0.8  # the process price, not the image bids' 3+


def test_a_node_that_stops_serving_its_jobs_notices_them_and_releases_its_reservations():
    """An agent restarted with another runner: its running image job gets a notice (as at a
    reclaim) and resumes on a node that serves it; nothing starts there that it cannot run."""
    m = market_with(node(1, Runner.DOCKER), node(2, Runner.DOCKER))
    m.add_bid(bid(1, image=TORCH))
    assert placed(m.tick(10.0)) == {1: 1}
    m.upsert_node(node(1, Runner.PROCESS))
    decision = m.tick(11.0)
    assert [(n.allocation_id, n.reason) for n in decision.notices] == [(1, "reclaimed")]
    migrated = [p for p in decision.placements if p.bid_id == 1]
    assert [p.node_id for p in migrated] == [2]  # reserved where it can run
    m.upsert_node(node(2, Runner.PROCESS))  # that one changes too, before the job stops
    m.tick(12.0)
    settled = m.end_allocation(1, AllocationStatus.PREEMPTED, 13.0)
    assert settled is not None
    decision = m.tick(14.0)
    assert all(p.node_id not in (1, 2) for p in decision.placements)  # nowhere it cannot run
    assert m.snapshot().allocations == () or all(
        a.status is not AllocationStatus.RUNNING for a in m.snapshot().allocations
    )


def test_a_pool_whose_nodes_all_serve_everything_again_is_priced_uniformly():
    m = market_with(node(1, Runner.PROCESS), node(2, None))
    m.add_bid(bid(1))
    m.tick(10.0)
    assert next(q for q in m.tick(11.0).quotes if q.gpu_model == A100).kind_prices is not None
    m.upsert_node(node(1, None))
    quote = next(q for q in m.tick(12.0).quotes if q.gpu_model == A100)
    assert quote.kind_prices is None  # as a market rebuilt from its snapshot would say
