"""Worked examples of the clearing rule (docs/operators/architecture.md#design-3), one behaviour
each."""

import pytest

from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    Interval,
    Market,
    MarketConfig,
    Node,
    NodeState,
    NoticeReason,
    PlacementKind,
)

A100 = "A100-80G"


def market_with(*nodes, **config):
    market = Market(MarketConfig(**config))
    for node in nodes:
        market.upsert_node(node)
    return market


def bid(i, count, price, region="eu-west", created=0.0, **kw):
    return Bid(i, A100, count, price, region=region, created_at=created, **kw)


def placed(decision):
    return {p.bid_id: (p.node_id, p.kind) for p in decision.placements}


def test_highest_bids_win_and_the_highest_loser_sets_the_price():
    m = market_with(Node(1, A100, "eu-west", 4, 0.9))
    for i, price in enumerate([1.5, 1.2, 1.1, 1.0], start=1):
        m.add_bid(bid(i, 1, price))
    m.add_bid(bid(5, 1, 1.05))
    d = m.tick(10.0)
    assert set(placed(d)) == {1, 2, 3, 5}
    quote = d.quote(A100, "eu-west")
    assert quote.clearing_price == 1.0  # the (k+1)-th price
    assert quote.gpus_free == 0 and quote.waiting_bids == 1


def test_the_price_never_falls_below_the_reserve():
    m = market_with(Node(1, A100, "eu-west", 8, 0.9))
    m.add_bid(bid(1, 2, 1.5))
    assert m.tick(10.0).quote(A100, "eu-west").clearing_price == 0.9


def test_equal_prices_go_to_the_older_bid():
    m = market_with(Node(1, A100, "eu-west", 1, 0.5))
    m.add_bid(bid(2, 1, 1.0, created=5.0))
    m.add_bid(bid(1, 1, 1.0, created=7.0))
    assert set(placed(m.tick(10.0))) == {2}


def test_best_fit_keeps_whole_nodes_for_big_bids():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5), Node(2, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 2.0))  # lands on the 4-GPU node, keeping node 1 whole
    m.add_bid(bid(2, 8, 1.5))
    assert placed(m.tick(1.0)) == {1: (2, PlacementKind.NEW), 2: (1, PlacementKind.NEW)}


def test_first_fit_is_the_naive_alternative():
    m = market_with(
        Node(1, A100, "eu-west", 8, 0.5), Node(2, A100, "eu-west", 4, 0.5), packing="first-fit"
    )
    m.add_bid(bid(1, 4, 2.0))
    m.add_bid(bid(2, 8, 1.5))
    assert placed(m.tick(1.0)) == {1: (1, PlacementKind.NEW)}


def test_a_bid_only_lands_on_nodes_whose_reserve_it_meets():
    m = market_with(Node(1, A100, "eu-west", 8, 2.0), Node(2, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0))
    m.add_bid(bid(2, 8, 0.4))
    d = m.tick(1.0)
    assert placed(d) == {1: (2, PlacementKind.NEW)}
    assert d.charges.total() == 0  # charges start from the placement


def test_any_region_bids_use_every_pool_of_their_model():
    m = market_with(Node(1, A100, "eu-west", 2, 0.5), Node(2, A100, "us-east", 4, 0.5))
    m.add_bid(bid(1, 2, 2.0, region="eu-west"))
    m.add_bid(bid(2, 4, 1.0, region="any"))
    assert placed(m.tick(1.0)) == {1: (1, PlacementKind.NEW), 2: (2, PlacementKind.NEW)}


def test_incumbents_keep_their_gpus_within_the_hysteresis_margin():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.00))
    m.tick(1.0)
    m.add_bid(bid(2, 8, 1.05))  # exactly 5 % more: not enough
    d = m.tick(2.0)
    assert not d.notices and len(d.placements) == 0
    assert d.quote(A100, "eu-west").clearing_price == 1.05
    assert d.charges.price.tolist() == [0.5]  # the price set at the previous tick
    d = m.tick(3.0)
    assert d.charges.price.tolist() == [1.0]  # never above the incumbent's own max


def test_an_outbid_incumbent_gets_a_notice_and_the_challenger_its_gpus():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.add_bid(bid(2, 4, 0.9))
    m.tick(1.0)
    m.add_bid(bid(3, 8, 1.2))
    d = m.tick(2.0)
    notices = {n.bid_id: n for n in d.notices}
    assert set(notices) == {1, 2}
    assert all(n.reason is NoticeReason.OUTBID and n.deadline == 302.0 for n in notices.values())
    assert placed(d) == {3: (1, PlacementKind.TAKEOVER)}
    assert m.node_load(1) == (8, 0, 8, 8)  # both keep running through the notice
    # the first acks its final save; the second runs out its deadline
    settled = m.end_allocation(notices[1].allocation_id, AllocationStatus.PREEMPTED, 40.0)
    assert settled.charges.seconds.tolist() == [38.0]
    assert not m.tick(41.0).promotions  # still 4 GPUs in use by the second
    d = m.tick(400.0)
    assert [e.bid_id for e in d.endings] == [2] and d.endings[0].at == 302.0
    assert d.promotions == (placed_id := d.promotions[0],) and placed_id
    assert m.node_load(1) == (8, 8, 0, 0)


def test_the_weakest_incumbents_are_the_ones_evicted():
    m = market_with(Node(1, A100, "eu-west", 4, 0.5), Node(2, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.add_bid(bid(2, 4, 0.6))
    m.tick(1.0)
    m.add_bid(bid(3, 4, 1.1))  # beats bid 2 by more than 5 %, bid 1 by less
    d = m.tick(2.0)
    assert [n.bid_id for n in d.notices] == [2]


def test_a_reclaim_notices_and_migrates_at_once_when_a_free_node_exists():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5), Node(2, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0))
    m.tick(1.0)
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.5, NodeState.RECLAIMED))
    d = m.tick(2.0)
    assert [(n.bid_id, n.reason) for n in d.notices] == [(1, NoticeReason.RECLAIMED)]
    assert placed(d) == {1: (2, PlacementKind.MIGRATION)}
    migration = next(iter(d.placements))
    assert migration.status is AllocationStatus.RESERVED and migration.expires_at == 362.0
    # the job acks its final save: it restarts on the reserved node at the next tick
    m.end_allocation(d.notices[0].allocation_id, AllocationStatus.PREEMPTED, 20.0)
    d = m.tick(21.0)
    assert d.promotions == (migration.allocation_id,)


def test_a_lost_node_ends_its_allocations_at_once_and_the_bid_waits_again():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5), Node(2, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0))
    m.tick(1.0)
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.5, NodeState.LOST))
    d = m.tick(2.0)
    assert [(e.bid_id, e.status, e.reason) for e in d.endings] == [
        (1, AllocationStatus.PREEMPTED, "node lost")
    ]
    assert not d.notices
    assert placed(d) == {1: (2, PlacementKind.NEW)}  # resumes elsewhere in the same tick


def test_a_draining_node_keeps_its_work_and_takes_no_more():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(1.0)
    m.upsert_node(Node(1, A100, "eu-west", 8, 0.5, NodeState.DRAINING))
    m.add_bid(bid(2, 4, 1.0))
    d = m.tick(2.0)
    assert not d.notices and len(d.placements) == 0 and len(d.charges) == 1
    assert d.quote(A100, "eu-west").gpus_total == 0


def test_raising_the_reserve_above_a_bid_notices_it():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0))
    m.tick(1.0)
    m.upsert_node(Node(1, A100, "eu-west", 8, 1.5))
    d = m.tick(2.0)
    assert [(n.bid_id, n.reason) for n in d.notices] == [(1, NoticeReason.BELOW_RESERVE)]


def test_a_cheap_window_bid_runs_inside_it_and_is_noticed_for_its_end():
    window = Interval(1000.0, 5000.0)
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0, window=window))
    assert len(m.tick(999.0).placements) == 0  # not open yet
    assert len(m.tick(1000.0).placements) == 1
    assert not m.tick(4699.0).notices  # 301 s before the end
    d = m.tick(4700.0)  # 300 s before the end: the notice's deadline is the window's end
    assert [(n.reason, n.deadline) for n in d.notices] == [(NoticeReason.WINDOW_CLOSING, 5000.0)]
    d = m.tick(5001.0)
    assert [(e.status, e.at) for e in d.endings] == [(AllocationStatus.PREEMPTED, 5000.0)]
    assert len(d.placements) == 0  # and it does not start again outside its window


def test_charges_bill_each_second_at_the_price_in_force():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 2, 2.0))
    m.add_bid(bid(2, 6, 1.0))
    m.add_bid(bid(3, 4, 0.8))  # loses: sets the price at 0.8
    m.tick(0.0)
    d = m.tick(10.0)
    # in whole micros: 0.8 x 2 x 10 s = 4444.4 micros, 0.8 x 6 x 10 s = 13333.3 (a third carried)
    assert sorted(zip(d.charges.bid_id.tolist(), d.charges.amount.tolist(), strict=False)) == [
        (1, 4444),
        (2, 13333),
    ]
    settled = m.cancel_bid(2, at=15.0)  # the job ends: final charge, GPUs free
    # 6666.7 + the third carried: 15 s of 0.8 x 6 GPUs cost exactly 20000 micros in all
    assert settled.charges.amount.tolist() == [6667]
    assert [e.status for e in settled.endings] == [AllocationStatus.FINISHED]
    d = m.tick(20.0)
    assert placed(d) == {3: (1, PlacementKind.NEW)}
    assert d.quote(A100, "eu-west").clearing_price == 0.5  # nobody loses: the reserve


def test_a_finished_job_closes_its_bid():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0))
    d = m.tick(0.0)
    m.end_allocation(next(iter(d.placements)).allocation_id, "finished", 5.0)
    assert m.snapshot().bids == ()
    with pytest.raises(KeyError):
        m.cancel_bid(1, 6.0)


def test_ending_an_allocation_checks_the_status():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    m.add_bid(bid(1, 8, 1.0))
    alloc = next(iter(m.tick(0.0).placements)).allocation_id
    with pytest.raises(ValueError, match="cannot end as released"):
        m.end_allocation(alloc, "released", 1.0)
    with pytest.raises(ValueError, match="terminal status"):
        m.end_allocation(alloc, "running", 1.0)
    with pytest.raises(KeyError):
        m.end_allocation(999, "finished", 1.0)


# ---------------------------------------------------------------- regressions from review


def test_bulk_packing_never_overcommits_nodes_whose_size_is_not_a_power_of_two():
    m = market_with(Node(1, A100, "eu-west", 6, 1.0), Node(2, A100, "eu-west", 6, 1.0))
    m.add_bid(bid(1, 3, 2.0))
    for i in (2, 3, 4):
        m.add_bid(bid(i, 2, 1.5))
    m.tick(10.0)
    for node_id in (1, 2):
        cap, running, _, _ = m.node_load(node_id)
        assert running <= cap


def test_any_region_bids_take_the_tightest_pool_in_bulk():
    m = market_with(
        Node(1, A100, "eu-west", 8, 1.0),
        Node(2, A100, "us-east", 4, 1.0),
        Node(3, A100, "us-east", 4, 1.0),
    )
    m.add_bid(bid(1, 4, 3.0, region="any"))
    m.add_bid(bid(2, 8, 2.0, region="eu-west"))
    assert set(placed(m.tick(0.0))) == {1, 2}


def test_a_reservation_does_not_start_outside_its_window():
    m = market_with(Node(1, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    m.add_bid(bid(2, 4, 2.0, window=Interval(0.0, 1000.0)))
    m.tick(600.0)  # bid 1 outbid; bid 2 reserves, expiring at 960
    d = m.tick(1100.0)
    assert d.promotions == ()
    assert [e.reason for e in d.endings if e.bid_id == 2] == ["reservation expired"]


def test_a_migration_keeps_its_free_gpus_when_a_neighbour_is_noticed():
    m = market_with(Node(1, A100, "eu-west", 8, 0.5), Node(2, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 2.0))
    m.add_bid(bid(2, 4, 1.0))
    m.tick(0.0)  # bid 1 -> node 2, bid 2 -> node 1
    m.upsert_node(Node(2, A100, "eu-west", 4, 0.5, NodeState.RECLAIMED))
    m.tick(100.0)  # bid 1 noticed; migration reserved on node 1's free GPUs
    m.upsert_node(Node(1, A100, "eu-west", 8, 1.5))  # bid 2 now below the reserve
    m.add_bid(bid(3, 4, 1.6, created=200.0))
    m.tick(200.0)
    # bid 3 claims the GPUs bid 2 will free, not those reserved for bid 1
    assert m.node_load(1) == (8, 0, 4, 8)
    noticed = next(
        a
        for a in m.snapshot().allocations
        if a.bid_id == 1 and a.status is AllocationStatus.NOTICED
    )
    m.end_allocation(noticed.id, "preempted", 205.0)
    assert len(m.tick(206.0).promotions) == 1  # bid 1 resumes at once


def test_a_draining_node_releases_its_reservations():
    m = market_with(Node(1, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    m.add_bid(bid(2, 4, 2.0))
    m.tick(1.0)  # bid 1 outbid, bid 2 reserves the node
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5, NodeState.DRAINING))
    d = m.tick(2.0)
    assert [(e.bid_id, e.reason) for e in d.endings] == [(2, "node draining")]
    assert m.tick(301.0).promotions == ()


def test_a_late_ack_is_billed_only_to_the_notice_deadline():
    m = market_with(Node(1, A100, "eu-west", 4, 1.0))
    m.add_bid(bid(1, 4, 2.0))
    m.tick(0.0)
    m.upsert_node(Node(1, A100, "eu-west", 4, 1.0, NodeState.RECLAIMED))
    notice = m.tick(10.0).notices[0]
    settled = m.end_allocation(notice.allocation_id, "preempted", 400.0)
    assert settled.charges.seconds.tolist() == [300.0]
    assert settled.endings[0].at == 310.0


def test_a_lowered_bid_is_billed_at_its_new_maximum_from_the_next_tick():
    m = market_with(Node(1, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 2.0))
    m.add_bid(bid(2, 4, 1.2))  # loses: the price is 1.2
    m.tick(0.0)
    m.reprice_bid(1, 1.19)  # still holds (1.2 is within the hysteresis margin)
    first = m.tick(10.0).charges
    assert first.price.tolist() == [1.2]  # the ten seconds ran under the old terms
    assert m.tick(20.0).charges.price.tolist() == [1.19]


def test_a_reprice_cannot_lower_the_price_of_seconds_already_run():
    """A tenant who lowers its maximum just before each tick would otherwise have every
    second billed at a price it never bid while it ran."""
    m = market_with(Node(1, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 2.0))
    m.add_bid(bid(2, 4, 1.5))
    m.tick(0.0)
    billed = []
    for t in (10.0, 20.0, 30.0):
        m.reprice_bid(1, 1.45)  # holds: 1.5 < 1.45 * 1.05
        billed += m.tick(t).charges.price.tolist()
        m.reprice_bid(1, 2.0)
    assert billed == [1.5, 1.45, 1.45]  # never below what was in force while it ran


def test_a_release_pays_its_nodes_reserve_until_it_ends():
    """Lowering a running bid below the reserve notices its job (the worker's release); the
    notice's minutes are billed at the reserve, not at the near-zero maximum: a tenant cannot
    cycle reprices to run on notices for free."""
    m = market_with(Node(1, A100, "eu-west", 4, 0.9))
    m.add_bid(bid(1, 4, 1.4))
    m.tick(0.0)
    m.reprice_bid(1, 0.0001)
    decision = m.tick(10.0)
    (notice,) = decision.notices
    assert notice.reason is NoticeReason.BELOW_RESERVE
    assert decision.charges.price.tolist() == [0.9]
    assert m.tick(70.0).charges.price.tolist() == [0.9]  # noticed: still the reserve
    settled = m.end_allocation(notice.allocation_id, "preempted", 100.0)
    assert settled.charges.price.tolist() == [0.9]
    assert settled.charges.seconds.tolist() == [30.0]


def test_a_raised_reserve_never_bills_a_job_above_its_maximum():
    """The owner's raise notices the job too, but the tenant never agreed to more than its
    maximum: its notice is billed at that maximum at most."""
    m = market_with(Node(1, A100, "eu-west", 4, 0.9))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    m.upsert_node(Node(1, A100, "eu-west", 4, 1.5))
    decision = m.tick(10.0)
    assert [n.reason for n in decision.notices] == [NoticeReason.BELOW_RESERVE]
    assert max(m.tick(20.0).charges.price.tolist()) <= 1.0


def test_bulk_loading_rejects_fractional_and_out_of_range_values():
    import numpy as np

    m = market_with(Node(1, A100, "eu-west", 8, 0.5))
    good = dict(
        gpu_model=A100,
        region="eu-west",
        ids=np.array([1]),
        gpu_counts=np.array([2]),
        max_prices=np.array([1.0]),
        created_at=np.array([0.0]),
    )
    with pytest.raises(ValueError, match="ids must be integers"):
        m.add_bid_arrays(**{**good, "ids": np.array([1.9])})
    with pytest.raises(ValueError, match="gpu_counts must be integers"):
        m.add_bid_arrays(**{**good, "gpu_counts": np.array([2.7])})
    with pytest.raises(ValueError, match="tenant_ids"):
        m.add_bid_arrays(**good, tenant_ids=np.array([-1]))
    with pytest.raises(ValueError, match="2\\*\\*62"):
        Bid(2**63, A100, 1, 1.0)
    assert m.snapshot().bids == ()


def test_spot_and_on_demand_capacity_never_mix():
    """An any-region spot bid never lands on an on-demand node, however high it bids, and an
    on-demand bid never on a spot node; each kind has its own quote."""
    m = market_with(
        Node(1, A100, "eu-west", 4, 0.9),
        Node(2, A100, "us-east", 4, 2.10, capacity="on_demand"),
    )
    m.add_bid(bid(1, 4, 1.2, region="any"))
    m.add_bid(bid(2, 4, 5.0, region="any"))  # would outbid anything, still only spot nodes
    m.add_bid(bid(3, 4, 2.10, region="any", capacity="on_demand"))
    d = m.tick(1.0)
    assert placed(d) == {2: (1, PlacementKind.NEW), 3: (2, PlacementKind.NEW)}
    assert d.quote(A100, "eu-west").clearing_price == 1.2
    on_demand = d.quote(A100, "us-east", "on_demand")
    assert on_demand.clearing_price == 2.10 and on_demand.gpus_free == 0
    with pytest.raises(KeyError):
        d.quote(A100, "us-east")


def test_an_on_demand_allocation_is_never_outbid():
    """On-demand bids all carry the on-demand price, so a later one waits instead of evicting:
    only the owner's reclaim notices an on-demand job."""
    m = market_with(Node(1, A100, "eu-west", 4, 2.10, capacity="on_demand"))
    m.add_bid(bid(1, 4, 2.10, capacity="on_demand"))
    m.tick(1.0)
    m.add_bid(bid(2, 4, 2.10, capacity="on_demand"))
    d = m.tick(2.0)
    assert not d.notices and not d.placements
    m.upsert_node(Node(1, A100, "eu-west", 4, 2.10, NodeState.RECLAIMED, capacity="on_demand"))
    d = m.tick(3.0)
    assert [(n.bid_id, n.reason) for n in d.notices] == [(1, NoticeReason.RECLAIMED)]


def test_a_node_cannot_change_its_capacity():
    m = market_with(Node(1, A100, "eu-west", 4, 0.9))
    with pytest.raises(ValueError, match="capacity cannot change"):
        m.upsert_node(Node(1, A100, "eu-west", 4, 0.9, capacity="on_demand"))
    with pytest.raises(ValueError, match="capacity must be one of spot, on_demand"):
        Bid(1, A100, 1, 1.0, capacity="reserved")
