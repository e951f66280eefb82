"""Gang bids in the pure market: all or nothing, one notice, resume
on the surviving nodes plus a reserved replacement.

The property tests run the same hypothesis-generated market lives as
``test_market_properties.py`` with gangs of 2-3 nodes mixed in, and check every invariant
after every tick (``market_checks.check_gangs`` among them) and that every tick's decision
equals that of a market rebuilt cold from the same state.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from market_checks import check_gangs, gangs
from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    EndReason,
    Interval,
    Market,
    MarketConfig,
    Node,
    NodeState,
    NoticeReason,
    clear,
)
from prefect_spotgpu.market.optimum import optimal_welfare, welfare
from test_market_properties import MODELS, PRICES, REGIONS, op_st, run_life

GANG_MODELS = ("A100-80G", "A100-80G", "A100-80G", *MODELS[1:])  # mostly one pool's model
gang_node_st = st.tuples(
    st.sampled_from(GANG_MODELS),
    st.sampled_from((REGIONS[0], *REGIONS)),
    st.sampled_from((2, 4, 8, 8, 16)),
    st.sampled_from((0.2, 0.5, 1.0)),
)
gang_bid_st = st.tuples(
    st.sampled_from(GANG_MODELS),
    st.sampled_from((*REGIONS, "any")),
    st.sampled_from((1, 2, 2, 4, 8)),
    st.sampled_from(PRICES),
    st.sampled_from((None, None, None, (0, 900))),
    st.sampled_from((1, 1, 2, 2, 3)),  # node_count
    st.sampled_from((False, False, True)),  # it may go on one node smaller (min_node_count)
)
reclaim_st = st.tuples(
    st.just("node"), st.integers(0, 10**6), st.sampled_from(("reclaim", "lose", "live", "live"))
)
gang_step_st = st.lists(
    st.tuples(
        st.lists(gang_bid_st, min_size=0, max_size=3),
        st.lists(st.one_of(op_st, reclaim_st), min_size=0, max_size=3),
        st.sampled_from((1, 1, 5, 60, 301, 400)),
    ),
    min_size=1,
    max_size=12,
).map(
    lambda rounds: [
        step
        for bids, ops, dt in rounds
        for step in [*(("bid", b) for b in bids), *ops, ("tick", dt)]
    ]
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.lists(gang_node_st, min_size=3, max_size=7), steps=gang_step_st)
def test_invariants_hold_with_gangs_mixed_in(nodes, steps):
    run_life(nodes, steps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.lists(gang_node_st, min_size=3, max_size=7), steps=gang_step_st)
def test_invariants_hold_with_gangs_and_no_hysteresis(nodes, steps):
    run_life(nodes, steps, hysteresis=0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spare=st.integers(1, 3),
    nodes=st.lists(gang_node_st, min_size=0, max_size=3),
    steps=gang_step_st,
)
def test_invariants_hold_for_a_running_gang_through_reclaims(spare, nodes, steps):
    """A 2- or 3-node gang runs first, with spare nodes beside it: the random life that
    follows reclaims, loses, outbids and acks its members."""
    pool = [("A100-80G", "eu-west", 8, 0.5)] * (2 + spare)
    first = [("bid", ("A100-80G", "eu-west", 8, 1.2, None, 1 + spare % 2 + 1)), ("tick", 1)]
    run_life(pool + nodes, first + steps)


# ---------------------------------------------------------------------- scenarios


def gang(first: int, nodes: int, gpus: int, price: float, **terms) -> list[Bid]:
    return [
        Bid(first + i, "A100-80G", gpus, price, node_count=nodes, gang_id=first, **terms)
        for i in range(nodes)
    ]


def market_of(*nodes: Node, notice: float = 300.0) -> Market:
    market = Market(MarketConfig(notice_seconds=notice))
    for node in nodes:
        market.upsert_node(node)
    return market


def node(i: int, gpus: int = 8, region: str = "eu-west", reserve: float = 0.5, **kw) -> Node:
    return Node(i, "A100-80G", region, gpus, reserve, **kw)


def placed(decision) -> dict[int, int]:
    return {p.bid_id: p.node_id for p in decision.placements}


def test_a_gang_runs_on_distinct_nodes_or_not_at_all():
    market = market_of(node(1), node(2))
    for bid in gang(10, 3, 4, 2.0, region="eu-west"):  # 3 nodes wanted, 2 exist
        market.add_bid(bid)
    assert len(market.tick(1.0).placements) == 0  # room for 4 members of 4 GPUs: still none
    market.upsert_node(node(3))
    where = placed(market.tick(2.0))
    assert sorted(where) == [10, 11, 12] and len(set(where.values())) == 3


def test_a_gang_outprices_one_node_bids_and_waits_whole_behind_higher_ones():
    market = market_of(node(1, 4), node(2, 4))
    market.add_bid(Bid(1, "A100-80G", 4, 3.0, region="eu-west"))  # takes a whole node
    for bid in gang(10, 2, 4, 2.0, region="eu-west"):
        market.add_bid(bid)
    market.add_bid(Bid(20, "A100-80G", 2, 1.0, region="eu-west"))
    where = placed(market.tick(1.0))
    assert 1 in where and 10 not in where and 11 not in where
    assert where[20] != where[1]  # the cheaper bid takes the free node: the gang cannot use it
    state = market.snapshot()
    check_gangs(state, 1.0)


def test_a_gang_in_any_region_lands_in_one_region():
    market = market_of(
        node(1, region="eu-west"), node(2, region="us-east"), node(3, region="us-east")
    )
    for bid in gang(10, 2, 8, 2.0):  # region any: eu-west has one node, us-east two
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    assert sorted(where.values()) == [2, 3]


def test_a_gang_no_single_region_can_hold_waits_and_holds_nothing():
    market = market_of(node(1, region="eu-west"), node(2, region="us-east"))
    for bid in gang(10, 2, 8, 2.0):
        market.add_bid(bid)
    decision = market.tick(1.0)
    assert len(decision.placements) == 0
    assert not market.snapshot().allocations
    quote = decision.quote("A100-80G", "eu-west")
    assert quote.waiting_bids == 1 and quote.gpus_free == 8


def test_a_reclaim_of_one_member_notices_the_gang_and_reserves_survivors_plus_a_replacement():
    market = market_of(node(1), node(2), node(3))
    for bid in gang(10, 2, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    lost_node = where[10]
    survivor = where[11]
    spare = ({1, 2, 3} - set(where.values())).pop()
    market.upsert_node(node(lost_node, state=NodeState.RECLAIMED))
    decision = market.tick(2.0)
    notices = {n.bid_id: n for n in decision.notices}
    assert sorted(notices) == [10, 11]
    assert {n.deadline for n in notices.values()} == {302.0}
    assert {n.reason for n in notices.values()} == {NoticeReason.RECLAIMED}
    reserved = {(p.bid_id, p.node_id, p.kind.value) for p in decision.placements}
    assert reserved == {(10, spare, "migration"), (11, survivor, "takeover")}
    # each member acks its final save; the gang starts again only once both have stopped
    state = market.snapshot()
    running = {a.bid_id: a.id for a in state.allocations if a.status is AllocationStatus.NOTICED}
    market.end_allocation(running[10], AllocationStatus.PREEMPTED, 5.0)
    assert not market.tick(6.0).promotions
    market.end_allocation(running[11], AllocationStatus.PREEMPTED, 7.0)
    decision = market.tick(8.0)
    assert len(decision.promotions) == 2
    on = {a.bid_id: a.node_id for a in market.snapshot().allocations}
    assert on == {10: spare, 11: survivor}


def test_a_gang_without_a_replacement_waits_whole_then_resumes_when_capacity_returns():
    market = market_of(node(1), node(2))
    for bid in gang(10, 2, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    market.upsert_node(node(where[10], state=NodeState.RECLAIMED))
    decision = market.tick(2.0)
    assert len(decision.notices) == 2 and len(decision.placements) == 0  # nothing reserved
    for a in market.snapshot().allocations:
        market.end_allocation(a.id, AllocationStatus.PREEMPTED, 3.0)
    assert len(market.tick(4.0).placements) == 0
    state = market.snapshot()
    assert not state.allocations and {b.id for b in state.bids} == {10, 11}
    check_gangs(state, 4.0)
    market.upsert_node(node(3))
    assert sorted(placed(market.tick(5.0))) == [10, 11]


def test_a_member_lost_without_notice_preempts_the_whole_gang():
    market = market_of(node(1), node(2), node(3))
    for bid in gang(10, 3, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    market.upsert_node(node(where[11], state=NodeState.LOST))
    decision = market.tick(2.0)
    ends = {e.bid_id: (e.status, e.reason) for e in decision.endings}
    assert ends[11] == (AllocationStatus.PREEMPTED, EndReason.NODE_LOST)
    assert ends[10] == ends[12] == (AllocationStatus.PREEMPTED, EndReason.GANG_MEMBER_ENDED)
    assert not market.snapshot().allocations  # it waits whole (two nodes left: too few)


def test_an_outbid_member_gives_the_gang_one_notice_and_the_challenger_its_node():
    market = market_of(node(1), node(2), node(3))
    for bid in gang(10, 2, 8, 1.0, region="eu-west"):
        market.add_bid(bid)
    market.add_bid(Bid(1, "A100-80G", 8, 0.8, region="eu-west"))
    where = placed(market.tick(1.0))
    market.cancel_bid(1, 2.0)  # node free again: the replacement
    market.add_bid(Bid(2, "A100-80G", 8, 3.0, region="eu-west", created_at=2.0))
    decision = market.tick(3.0)
    assert decision.placements  # the challenger took the free node
    market.add_bid(Bid(3, "A100-80G", 8, 3.0, region="eu-west", created_at=3.0))
    decision = market.tick(4.0)  # no free node: it evicts one member; the gang is noticed
    assert sorted(n.bid_id for n in decision.notices) == [10, 11]
    assert {n.reason for n in decision.notices} == {NoticeReason.OUTBID}
    taken = {p.node_id for p in decision.placements if p.bid_id == 3}
    assert taken <= set(where[b] for b in (10, 11))
    check_gangs(market.snapshot(), 4.0)


def test_a_gang_evicts_weaker_incumbents_as_reservations_for_every_member():
    market = market_of(node(1), node(2))
    market.add_bid(Bid(1, "A100-80G", 8, 0.6, region="eu-west"))
    market.add_bid(Bid(2, "A100-80G", 8, 0.6, region="eu-west"))
    market.tick(1.0)
    for bid in gang(10, 2, 8, 2.0, region="eu-west", created_at=1.0):
        market.add_bid(bid)
    decision = market.tick(2.0)
    assert sorted(n.bid_id for n in decision.notices) == [1, 2]
    kinds = {p.bid_id: p.kind.value for p in decision.placements}
    assert kinds == {10: "takeover", 11: "takeover"}
    for a in market.snapshot().allocations:
        if a.status is AllocationStatus.NOTICED:
            market.end_allocation(a.id, AllocationStatus.PREEMPTED, 3.0)
    assert len(market.tick(4.0).promotions) == 2


def test_one_finished_member_finishes_the_gang_and_a_cancel_closes_every_member():
    market = market_of(node(1), node(2))
    for bid in gang(10, 2, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    market.tick(1.0)
    rank0 = next(a for a in market.snapshot().allocations if a.bid_id == 10)
    settled = market.end_allocation(rank0.id, AllocationStatus.FINISHED, 60.0)
    assert sorted(e.bid_id for e in settled.endings) == [10, 11]
    assert {c.seconds for c in settled.charges} == {59.0}  # every member paid to the end
    assert not market.snapshot().bids
    for bid in gang(20, 2, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    market.tick(61.0)
    settled = market.cancel_bid(21, 70.0)  # any member's id cancels the gang
    assert sorted(e.bid_id for e in settled.endings) == [20, 21] and not market.snapshot().bids


def test_a_repriced_member_reprices_the_gang():
    market = market_of(node(1), node(2))
    for bid in gang(10, 2, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    market.reprice_bid(11, 0.4)  # below every reserve
    assert len(market.tick(1.0).placements) == 0
    assert {b.max_price for b in market.snapshot().bids} == {0.4}


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (Bid(11, "A100-80G", 4, 2.0, node_count=2, gang_id=10), "gang's first member first"),
        (Bid(10, "A100-80G", 4, 2.0, node_count=2, gang_id=10), None),
    ],
)
def test_a_member_needs_its_first_member_and_shares_its_terms(member, message):
    market = market_of(node(1), node(2))
    if message:
        with pytest.raises(ValueError, match=message):
            market.add_bid(member)
        return
    market.add_bid(member)
    with pytest.raises(ValueError, match="share every term"):
        market.add_bid(Bid(11, "A100-80G", 4, 2.5, node_count=2, gang_id=10))
    market.add_bid(Bid(11, "A100-80G", 4, 2.0, node_count=2, gang_id=10))
    with pytest.raises(ValueError, match="already has its 2 members"):
        market.add_bid(Bid(12, "A100-80G", 4, 2.0, node_count=2, gang_id=10))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"node_count": 0}, "node_count"),
        ({"node_count": 65, "gang_id": 1}, "node_count"),
        ({"node_count": True}, "node_count"),
        ({"node_count": 2}, "gang_id"),
        ({"node_count": 1, "gang_id": 1}, "gang_id"),
        ({"node_count": 2, "gang_id": 9}, "gang_id"),
    ],
)
def test_bad_gang_terms_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Bid(5, "A100-80G", 4, 2.0, **kwargs)


# ---------------------------------------------------------------------- welfare


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from((2, 4, 8)), min_size=2, max_size=5),
    bids=st.lists(
        st.tuples(st.sampled_from((1, 2, 4, 8)), st.sampled_from(PRICES), st.sampled_from((1, 2))),
        min_size=1,
        max_size=7,
    ),
)
def test_welfare_with_gangs_is_at_most_the_optimum_and_usually_near_it(sizes, bids):
    nodes = [Node(i, "A100-80G", "eu-west", s, 0.2) for i, s in enumerate(sizes, start=1)]
    market = market_of(*nodes)
    all_bids, next_id = [], 1
    for gpus, price, count in bids:
        members = (
            gang(next_id, count, gpus, price)
            if count > 1
            else [Bid(next_id, "A100-80G", gpus, price)]
        )
        for b in members:
            market.add_bid(b)
        all_bids.extend(members)
        next_id += len(members)
    won = {p.bid_id for p in market.tick(1.0).placements}
    got = welfare({b.id: b for b in all_bids}, won)
    best = optimal_welfare(nodes, all_bids)
    assert got <= best + 1e-9
    check_gangs(market.snapshot(), 1.0)


def test_a_cold_rebuild_in_the_middle_of_a_gang_notice_decides_the_same():
    market = market_of(node(1), node(2), node(3))
    for bid in gang(10, 2, 8, 2.0, region="eu-west"):
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    market.upsert_node(node(where[10], state=NodeState.RECLAIMED))
    market.tick(2.0)
    noticed = [a for a in market.snapshot().allocations if a.status is AllocationStatus.NOTICED]
    market.end_allocation(noticed[0].id, AllocationStatus.PREEMPTED, 3.0)  # one acked, one not
    state = market.snapshot()
    assert clear(state, 4.0).equals(market.tick(4.0))


# ---------------------------------------------------------------------- the cold tick in bulk


class OneByOne(Market):
    """The same market with the bulk replay of fresh pools turned off: every bid the perfect
    packing leaves goes through the one-by-one loop (claims, evictions and all)."""

    def _fresh_model(self, model: int) -> bool:
        return False


cold_node_st = st.tuples(
    st.sampled_from(("A100-80G", "A100-80G", "RTX-4090")),
    st.sampled_from(REGIONS),
    st.sampled_from((1, 2, 3, 4, 6, 8, 8, 8, 16)),
    st.sampled_from((None, None, None, None, 1.0)),  # None: its pool's reserve (else: not fresh)
    st.sampled_from((False, False, False, False, True)),  # holds an image (not fresh either)
)
cold_bid_st = st.tuples(
    st.sampled_from(("A100-80G", "A100-80G", "RTX-4090")),
    st.sampled_from((*REGIONS, "any", "any")),
    st.sampled_from((1, 1, 2, 2, 3, 4, 8, 16)),
    st.sampled_from(PRICES),
    st.sampled_from((1, 1, 1, 2, 2, 3, 4)),  # node_count
    st.sampled_from((None, None, None, (0, 900), (2000, 5000))),  # window
    st.integers(0, 4),  # 0: a gang short of one member (it waits, and blocks its book)
    st.sampled_from((False, False, True)),  # it may go on one node smaller (min_node_count)
)


def cold_markets(nodes, bids, arrays):
    """The same fresh market twice, bulk and one by one: plain bids and gangs interleaved in
    price (ids in arrival order), optionally with a bulk-loaded book of plain bids."""
    config = MarketConfig(regions=frozenset(REGIONS))
    markets = (Market(config), OneByOne(config))
    for market in markets:
        for i, (model, region, gpus, reserve, image) in enumerate(nodes, start=1):
            pool_reserve = 0.5 if (model, region) < ("B", REGIONS[1]) else 1.0
            held = frozenset({"pytorch:1"}) if image else frozenset()
            market.upsert_node(Node(i, model, region, gpus, reserve or pool_reserve, images=held))
        next_id = 1
        for model, region, gpus, price, count, window, short, shrinks in bids:
            members = count - 1 if count > 1 and short == 0 else count
            for rank in range(members):
                market.add_bid(
                    Bid(
                        next_id + rank,
                        model,
                        gpus,
                        price,
                        region=region,
                        created_at=float(next_id % 7),
                        window=None if window is None else Interval(*window),
                        node_count=count,
                        gang_id=next_id if count > 1 else None,
                        min_node_count=count - 1 if shrinks and count > 1 else None,
                    )
                )
            next_id += count
        if arrays:  # a bulk-loaded book of plain bids, placed in bulk (perfect packing) first
            size = len(arrays)
            market.add_bid_arrays(
                gpu_model="A100-80G",
                region=REGIONS[0],
                ids=np.arange(10_000, 10_000 + size),
                gpu_counts=np.asarray(arrays),
                max_prices=np.asarray([PRICES[(i * 7) % len(PRICES)] for i in range(size)]),
                created_at=np.zeros(size),
            )
    return markets


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(cold_node_st, min_size=1, max_size=12),
    bids=st.lists(cold_bid_st, min_size=1, max_size=30),
    arrays=st.one_of(st.just([]), st.lists(st.sampled_from((1, 2, 4, 8)), max_size=12)),
    dt=st.sampled_from((1.0, 301.0, 2500.0)),
)
def test_a_cold_tick_with_gangs_decides_as_the_one_by_one_loop(nodes, bids, arrays, dt):
    """The bulk path of a fresh market (perfect packing, then the exact replay that takes
    gangs, all or nothing on distinct nodes of one pool) decides every cold tick exactly as
    the one-by-one loop would: the same allocations, nodes, ids and order, prices and
    charges -- and so does every tick after it."""
    bulk, one_by_one = cold_markets(nodes, bids, arrays)
    now = 0.0
    for step in range(3):
        now += dt
        decision = bulk.tick(now)
        assert decision.equals(one_by_one.tick(now)), f"tick {step} differs"
        state = bulk.snapshot()
        if all(len(ms) == ms[0].node_count for ms in gangs(state).values()):
            check_gangs(state, now)  # (a gang short of a member blocks its book, by design)
        assert clear(state, now + 1).equals(OneByOne.from_state(state).tick(now + 1))
        for market in (bulk, one_by_one):  # the next tick: some bids leave, a node is lost
            if state.bids:
                market.cancel_bid(state.bids[step % len(state.bids)].id, now)
            market.upsert_node(Node(1, *nodes[0][:3], 1.0, state=NodeState.LOST))


def test_a_gang_between_plain_bids_is_placed_whole_in_the_cold_tick():
    """Price order, all or nothing and distinct nodes in the bulk path: the gang at 2.0 takes
    two distinct nodes before the 1.5 bids fill what is left; the 3-node gang at 1.8 cannot
    find three free nodes and waits whole; the 1.0 bids behind it still run."""
    nodes = [node(i, gpus) for i, gpus in enumerate((8, 8, 4, 4), start=1)]
    bulk, one_by_one = market_of(*nodes), OneByOne()
    for n in nodes:
        one_by_one.upsert_node(n)
    bids = [
        Bid(1, "A100-80G", 4, 3.0, region="eu-west"),  # the best: node 3 (the tightest)
        *gang(10, 2, 8, 2.0, region="eu-west"),  # two whole nodes: 1 and 2
        *gang(20, 3, 2, 1.8, region="eu-west"),  # needs 3 nodes with 2 free: only node 4
        Bid(30, "A100-80G", 2, 1.5, region="eu-west"),
        Bid(31, "A100-80G", 2, 1.5, region="eu-west"),
        Bid(32, "A100-80G", 2, 1.0, region="eu-west"),
    ]
    for market in (bulk, one_by_one):
        for b in bids:
            market.add_bid(b)
    decision = bulk.tick(1.0)
    assert decision.equals(one_by_one.tick(1.0))
    assert placed(decision) == {1: 3, 10: 1, 11: 2, 30: 4, 31: 4}
    assert decision.quote("A100-80G", "eu-west").waiting_bids == 2  # the gang (one entry), 32
    check_gangs(bulk.snapshot(), 1.0)


def test_a_gang_that_finds_too_few_nodes_or_members_takes_nothing_in_the_cold_tick():
    """A 3-node gang on a 2-node pool, and a gang still short of a member, both outbid the
    one-node bids; each waits whole, taking no node from the bids behind it."""
    bulk, one_by_one = market_of(node(1), node(2)), OneByOne()
    for n in (node(1), node(2)):
        one_by_one.upsert_node(n)
    bids = [
        *gang(10, 3, 4, 3.0, region="eu-west"),  # three nodes wanted, two exist
        gang(20, 2, 2, 2.5, region="eu-west")[0],  # its second member has not arrived
        Bid(30, "A100-80G", 8, 2.0, region="eu-west"),
        Bid(31, "A100-80G", 8, 1.9, region="eu-west"),
    ]
    for market in (bulk, one_by_one):
        for b in bids:
            market.add_bid(b)
    decision = bulk.tick(1.0)
    assert decision.equals(one_by_one.tick(1.0))
    assert placed(decision) == {30: 1, 31: 2}
    check_gangs(bulk.snapshot(), 1.0)


def test_the_replay_sorts_a_large_book_a_slice_at_a_time_and_misses_nothing():
    """5,000 high bids for a region with no node come first in price; the bids that fit come
    after them, beyond the first slice the replay sorts: they are placed all the same."""
    markets = (market_of(node(1, region="us-east")), OneByOne())
    markets[1].upsert_node(node(1, region="us-east"))
    for market in markets:
        market.upsert_node(node(2, region="eu-west", state=NodeState.DRAINING))
        ids = np.arange(1, 5001)
        market.add_bid_arrays(
            gpu_model="A100-80G",
            region="eu-west",  # a pool with no live node: no fit
            ids=ids,
            gpu_counts=np.ones(5000, np.int64),
            max_prices=np.full(5000, 3.0),
            created_at=np.zeros(5000),
        )
        for b in (*gang(6000, 2, 4, 1.0, region="us-east"), *gang(6002, 2, 4, 0.9)):
            market.add_bid(b)
        market.add_bid(Bid(6010, "A100-80G", 4, 0.8, region="any"))
        market.add_bid(Bid(6011, "A100-80G", 4, 0.7, region="us-east"))
    decision = markets[0].tick(1.0)
    assert decision.equals(markets[1].tick(1.0))
    assert placed(decision) == {6010: 1, 6011: 1}  # a gang needs two nodes: one exists


# ------------------------------------------------------- gangs that may go on smaller


def test_a_gang_that_may_shrink_runs_on_the_nodes_there_are_and_never_below_its_least():
    market = market_of(node(1))
    for bid in gang(10, 3, 8, 2.0, region="eu-west", min_node_count=2):
        market.add_bid(bid)
    assert not market.tick(1.0).placements  # one node: below its least, it waits whole
    market.upsert_node(node(2))
    where = placed(market.tick(2.0))
    assert sorted(where) == [10, 11] and len(set(where.values())) == 2  # its first ranks
    state = market.snapshot()
    check_gangs(state, 2.0)
    assert {b.id for b in state.bids} == {10, 11, 12}  # the third member parked, not waiting
    assert market.tick(3.0).quote("A100-80G", "eu-west").waiting_bids == 0


def test_a_reclaimed_member_without_a_replacement_leaves_a_gang_that_may_shrink_smaller():
    market = market_of(node(1), node(2))
    for bid in gang(10, 2, 8, 2.0, region="eu-west", min_node_count=1):
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    market.upsert_node(node(where[10], state=NodeState.RECLAIMED))
    decision = market.tick(2.0)
    assert sorted(n.bid_id for n in decision.notices) == [10, 11]  # one notice, as ever
    reserved = {(p.bid_id, p.node_id, p.kind.value) for p in decision.placements}
    # the survivor's own GPUs, for rank 0: a gang gone smaller holds its first ranks
    assert reserved == {(10, where[11], "takeover")}
    running = {a.bid_id: a.id for a in market.snapshot().allocations if a.status.holds_gpus()}
    market.end_allocation(running[10], AllocationStatus.PREEMPTED, 3.0)
    assert not market.tick(4.0).promotions  # rank 1 still runs there: nobody starts yet
    market.end_allocation(running[11], AllocationStatus.PREEMPTED, 5.0)
    decision = market.tick(6.0)
    assert len(decision.promotions) == 1
    on = {a.bid_id: (a.node_id, a.status) for a in market.snapshot().allocations}
    assert on == {10: (where[11], AllocationStatus.RUNNING)}  # one node: a world of 1
    check_gangs(market.snapshot(), 6.0)


def test_a_gang_run_smaller_grows_back_at_its_next_notice_when_nodes_are_free():
    market = market_of(node(1), node(2))
    for bid in gang(10, 3, 8, 2.0, region="eu-west", min_node_count=2):
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    assert sorted(where) == [10, 11]
    market.upsert_node(node(3))
    market.upsert_node(node(4))
    assert not market.tick(2.0).placements  # a running gang does not grow mid-run
    market.upsert_node(node(where[11], state=NodeState.RECLAIMED))
    decision = market.tick(3.0)
    reserved = {p.bid_id: (p.node_id, p.kind.value) for p in decision.placements}
    assert reserved[10] == (where[10], "takeover")
    assert {reserved[11][0], reserved[12][0]} == {3, 4}  # the noticed and the parked member
    for a in market.snapshot().allocations:
        if a.status is AllocationStatus.NOTICED:
            market.end_allocation(a.id, AllocationStatus.PREEMPTED, 4.0)
    assert len(market.tick(5.0).promotions) == 3  # whole again
    check_gangs(market.snapshot(), 5.0)


def test_a_gang_that_runs_whole_still_waits_whole_without_a_replacement():
    """The default: min_node_count None is node_count (the scenario above, without it)."""
    market = market_of(node(1), node(2))
    for bid in gang(10, 2, 8, 2.0, region="eu-west"):
        assert bid.least_nodes == 2
        market.add_bid(bid)
    where = placed(market.tick(1.0))
    market.upsert_node(node(where[10], state=NodeState.RECLAIMED))
    assert not market.tick(2.0).placements


@pytest.mark.parametrize("least", [0, 3, -1, True, 1.5, "1"])
def test_a_bad_min_node_count_names_the_field(least):
    with pytest.raises(ValueError, match="min_node_count"):
        Bid(1, "A100-80G", 8, 2.0, node_count=2, gang_id=1, min_node_count=least)


def test_members_must_agree_on_min_node_count():
    market = market_of(node(1), node(2))
    first, second = gang(10, 2, 8, 2.0, region="eu-west", min_node_count=1)
    market.add_bid(first)
    with pytest.raises(ValueError, match="share every term"):
        market.add_bid(Bid(11, "A100-80G", 8, 2.0, region="eu-west", node_count=2, gang_id=10))
    market.add_bid(second)


def test_a_cold_tick_places_a_gang_smaller_exactly_as_the_one_by_one_loop():
    nodes = [node(1), node(2)]
    bulk, one_by_one = market_of(*nodes), OneByOne()
    for n in nodes:
        one_by_one.upsert_node(n)
    bids = [*gang(10, 3, 8, 2.0, region="eu-west", min_node_count=2), Bid(20, "A100-80G", 8, 1.0)]
    for market in (bulk, one_by_one):
        for b in bids:
            market.add_bid(b)
    decision = bulk.tick(1.0)
    assert decision.equals(one_by_one.tick(1.0))
    assert sorted(placed(decision)) == [10, 11]
    state = bulk.snapshot()
    check_gangs(state, 1.0)
    assert clear(state, 2.0).equals(OneByOne.from_state(state).tick(2.0))
