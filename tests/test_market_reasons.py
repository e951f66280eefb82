"""Why allocations end: every ending the market writes names an ``EndReason`` member.

One worked example per reason the market writes (the service names the others, for the end of a
job its agent reported), and a hypothesis-generated market life in which every ending of every
tick, cancel and ack is checked.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    EndReason,
    Interval,
    Market,
    MarketConfig,
    Node,
    NodeState,
)

A100 = "A100-80G"

MARKET_REASONS = {
    EndReason.NODE_LOST,
    EndReason.NODE_DRAINING,
    EndReason.NODE_RECLAIMED,
    EndReason.BELOW_RESERVE,
    EndReason.NOTICE_DEADLINE_PASSED,
    EndReason.RESERVATION_EXPIRED,
    EndReason.BID_CANCELLED,
    EndReason.BID_FINISHED,
    EndReason.ENDED_PREEMPTED,
    EndReason.ENDED_FINISHED,
    EndReason.ENDED_RELEASED,
}
"""The reasons the market itself writes (the rest are the service's)."""


def bid(i, count, price, created=0.0, **kw):
    return Bid(i, A100, count, price, region="eu-west", created_at=created, **kw)


def outbid_on_one_node(reserve=0.5):
    """Bid 1 runs on node 1 (4 GPUs), noticed as outbid; bid 2 reserves its GPUs."""
    m = Market(MarketConfig(notice_seconds=300))
    m.upsert_node(Node(1, A100, "eu-west", 4, reserve))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    m.add_bid(bid(2, 4, 2.0))
    m.tick(1.0)
    return m


def alloc_of(m, bid_id, status):
    return next(a for a in m.snapshot().allocations if a.bid_id == bid_id and a.status is status)


def node_lost():
    m = Market()
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5, NodeState.LOST))
    return m.tick(1.0).endings


def node_draining():
    m = outbid_on_one_node()
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5, NodeState.DRAINING))
    return m.tick(2.0).endings


def node_reclaimed():
    m = outbid_on_one_node()
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5, NodeState.RECLAIMED))
    return m.tick(2.0).endings


def below_reserve():
    m = outbid_on_one_node()
    m.upsert_node(Node(1, A100, "eu-west", 4, 3.0))
    return m.tick(2.0).endings


def notice_deadline_passed():
    return outbid_on_one_node().tick(400.0).endings


def reservation_expired():
    m = Market(MarketConfig(notice_seconds=300))
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    m.add_bid(bid(2, 4, 2.0, window=Interval(0.0, 1000.0)))
    m.tick(600.0)  # bid 1 outbid; bid 2 reserves, expiring at 960 (its window closes)
    return m.tick(1100.0).endings


def bid_cancelled():
    m = outbid_on_one_node()
    return m.cancel_bid(1, 2.0).endings


def bid_finished():
    m = Market(MarketConfig(notice_seconds=300))
    m.upsert_node(Node(1, A100, "eu-west", 4, 0.5))
    m.upsert_node(Node(2, A100, "eu-west", 4, 0.5))
    m.add_bid(bid(1, 4, 1.0))
    m.tick(0.0)
    ran = alloc_of(m, 1, AllocationStatus.RUNNING)
    m.upsert_node(Node(ran.node_id, A100, "eu-west", 4, 0.5, NodeState.RECLAIMED))
    m.tick(1.0)  # noticed, with a migration reservation on the other node
    noticed = alloc_of(m, 1, AllocationStatus.NOTICED)
    return m.end_allocation(noticed.id, AllocationStatus.FINISHED, 2.0).endings


def ended_preempted():
    m = outbid_on_one_node()
    noticed = alloc_of(m, 1, AllocationStatus.NOTICED)
    return m.end_allocation(noticed.id, AllocationStatus.PREEMPTED, 2.0).endings


def ended_finished():
    m = outbid_on_one_node()
    noticed = alloc_of(m, 1, AllocationStatus.NOTICED)
    return m.end_allocation(noticed.id, AllocationStatus.FINISHED, 2.0).endings


def ended_released():
    m = outbid_on_one_node()
    reserved = alloc_of(m, 2, AllocationStatus.RESERVED)
    return m.end_allocation(reserved.id, AllocationStatus.RELEASED, 2.0).endings


EXAMPLES = {
    EndReason.NODE_LOST: node_lost,
    EndReason.NODE_DRAINING: node_draining,
    EndReason.NODE_RECLAIMED: node_reclaimed,
    EndReason.BELOW_RESERVE: below_reserve,
    EndReason.NOTICE_DEADLINE_PASSED: notice_deadline_passed,
    EndReason.RESERVATION_EXPIRED: reservation_expired,
    EndReason.BID_CANCELLED: bid_cancelled,
    EndReason.BID_FINISHED: bid_finished,
    EndReason.ENDED_PREEMPTED: ended_preempted,
    EndReason.ENDED_FINISHED: ended_finished,
    EndReason.ENDED_RELEASED: ended_released,
}


def check_reasons(endings):
    for ending in endings:
        assert type(ending.reason) is EndReason, ending
        assert ending.reason in MARKET_REASONS, ending


def test_every_market_reason_has_an_example():
    assert set(EXAMPLES) == MARKET_REASONS


@pytest.mark.parametrize("reason", list(EXAMPLES), ids=lambda r: r.name)
def test_an_ending_names_its_reason(reason):
    endings = EXAMPLES[reason]()
    check_reasons(endings)
    assert reason in [e.reason for e in endings]


op_st = st.one_of(
    st.tuples(st.just("bid"), st.sampled_from((1, 2, 4)), st.sampled_from((0.4, 1.0, 2.0, 3.0))),
    st.tuples(st.just("cancel"), st.integers(0, 99)),
    st.tuples(st.just("end"), st.integers(0, 99)),
    st.tuples(
        st.just("node"),
        st.integers(0, 99),
        st.sampled_from(tuple(NodeState)),
        st.sampled_from((0.3, 0.5, 2.5)),
    ),
    st.tuples(st.just("tick"), st.sampled_from((1.0, 60.0, 301.0, 400.0))),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=40))
def test_every_ending_of_a_market_life_is_an_end_reason(ops):
    m = Market(MarketConfig(notice_seconds=300, reservation_grace_seconds=30))
    for i in (1, 2, 3):
        m.upsert_node(Node(i, A100, "eu-west", 4, 0.5))
    now, next_bid = 0.0, 1
    ending_of = {
        AllocationStatus.RESERVED: AllocationStatus.RELEASED,
        AllocationStatus.RUNNING: AllocationStatus.FINISHED,
        AllocationStatus.NOTICED: AllocationStatus.PREEMPTED,
    }
    for op in ops:
        state = m.snapshot()
        if op[0] == "bid":
            m.add_bid(bid(next_bid, op[1], op[2], created=now))
            next_bid += 1
        elif op[0] == "cancel" and state.bids:
            check_reasons(m.cancel_bid(state.bids[op[1] % len(state.bids)].id, now).endings)
        elif op[0] == "end" and state.allocations:
            alloc = state.allocations[op[1] % len(state.allocations)]
            check_reasons(m.end_allocation(alloc.id, ending_of[alloc.status], now).endings)
        elif op[0] == "node":
            node = state.nodes[op[1] % len(state.nodes)]
            m.upsert_node(Node(node.id, A100, "eu-west", 4, op[3], op[2]))
        elif op[0] == "tick":
            now += op[1]
            check_reasons(m.tick(now).endings)
    check_reasons(m.tick(now + 1000.0).endings)
