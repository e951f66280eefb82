"""Property tests of the clearing engine against the invariants of
docs/operators/architecture.md#design-3.

A hypothesis-generated life of a small market — bids arriving, repriced and cancelled, nodes
reclaimed, lost, drained and re-priced, jobs acking and finishing, time passing — with every
invariant checked after every tick, and every tick's decision compared with the decision of a
market rebuilt cold from the same state.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from market_checks import (
    bid_fits_pool,
    check_allocations,
    check_capacity,
    check_free_fit_used,
    check_gangs,
    check_outbid_rule,
    expected_prices,
)
from prefect_spotgpu.market import (
    AllocationStatus,
    Bid,
    EndReason,
    Interval,
    Market,
    MarketConfig,
    Node,
    NodeState,
    Runner,
    clear,
)

MODELS = ("A100-80G", "RTX-4090", "A100-80G/on_demand")  # model[/capacity]
REGIONS = ("eu-west", "us-east")
IMAGES = ("pytorch:1", "tensorrt:1")
RUNNERS = (  # (runner, default image, job network): said by none, process, docker, docker with
    (None, False, False),  # a default, docker with a job network (it runs gang members)
    (Runner.PROCESS, False, False),
    (Runner.DOCKER, False, False),
    (Runner.DOCKER, True, False),
    (Runner.DOCKER, False, True),
)
PRICES = (0.3, 0.5, 0.8, 1.0, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0)

node_st = st.tuples(
    st.sampled_from(MODELS),
    st.sampled_from(REGIONS),
    st.sampled_from((1, 2, 3, 4, 6, 8, 12, 16)),
    st.sampled_from((0.2, 0.5, 1.0)),
)
bid_st = st.tuples(
    st.sampled_from(MODELS),
    st.sampled_from((*REGIONS, "any")),
    st.sampled_from((1, 1, 2, 2, 3, 4, 6, 8)),
    st.sampled_from(PRICES),
    st.sampled_from((None, None, None, (0, 900), (200, 5000))),
)
op_st = st.one_of(
    st.tuples(st.just("reprice"), st.integers(0, 10**6), st.sampled_from(PRICES)),
    st.tuples(st.just("cancel"), st.integers(0, 10**6)),
    st.tuples(
        st.just("node"),
        st.integers(0, 10**6),
        st.sampled_from(("reclaim", "lose", "drain", "live", "reserve", "runner")),
    ),
    st.tuples(st.just("ack"), st.integers(0, 10**6)),
    st.tuples(st.just("finish"), st.integers(0, 10**6)),
)
round_st = st.tuples(
    st.lists(bid_st, min_size=0, max_size=5),
    st.lists(op_st, min_size=0, max_size=2),
    st.sampled_from((1, 1, 5, 60, 301, 400)),
)
# a life: rounds of (new bids, other changes, then a tick after dt seconds), flattened
step_st = st.lists(round_st, min_size=1, max_size=12).map(
    lambda rounds: [
        step
        for bids, ops, dt in rounds
        for step in [*(("bid", b) for b in bids), *ops, ("tick", dt)]
    ]
)


def _pick(items, i):
    return items[i % len(items)] if items else None


class ExactBook:
    """What each allocation owes, exactly (a Fraction of micros), against what it was
    charged (whole micros): while it runs the two differ by under one micro; once it has
    ended it paid the exact amount rounded up to a whole micro."""

    def __init__(self) -> None:
        self.owed: dict[int, Fraction] = {}
        self.paid: dict[int, int] = {}
        self.ended: set[int] = set()

    def bill(self, charges, endings=()) -> None:
        for c in charges:
            assert isinstance(c.amount, int)
            ms = round(c.seconds * 1000)
            assert ms == c.seconds * 1000  # whole milliseconds
            micros_per_hour = round(c.price * 1_000_000)
            owed = Fraction(micros_per_hour * c.gpu_count * ms, 3_600_000)
            self.owed[c.allocation_id] = self.owed.get(c.allocation_id, Fraction(0)) + owed
            self.paid[c.allocation_id] = self.paid.get(c.allocation_id, 0) + c.amount
        self.ended.update(e.allocation_id for e in endings)
        assert all(type(e.reason) is EndReason for e in endings), endings
        for alloc_id, owed in self.owed.items():
            paid = self.paid[alloc_id]
            if alloc_id in self.ended:
                assert paid == math.ceil(owed), (alloc_id, owed, paid)
            else:
                assert 0 <= owed - paid < 1, (alloc_id, owed, paid)


def run_life(nodes, steps, hysteresis=0.05, check_each_tick=True):
    config = MarketConfig(hysteresis=hysteresis, notice_seconds=300, regions=frozenset(REGIONS))
    market = Market(config)
    for i, (model, region, count, reserve) in enumerate(nodes, start=1):
        model, _, capacity = model.partition("/")
        images = frozenset(IMAGES[: i % 3])  # some nodes hold images: placement prefers them
        runner, default_image, job_network = RUNNERS[i % len(RUNNERS)]  # some serve one kind
        market.upsert_node(
            Node(
                i,
                model,
                region,
                count,
                reserve,
                capacity=capacity or "spot",
                images=images if runner != Runner.PROCESS else frozenset(),
                runner=runner,
                default_image=default_image,
                job_network=job_network,
            )
        )
    now, next_bid = 0.0, 1
    total_charged = 0
    book = ExactBook()
    expected: dict[int, float] = {}  # allocation id -> price in force (checker's view)
    last_tick = None
    for step in steps:
        kind = step[0]
        state = market.snapshot()
        if kind == "bid":
            model, region, count, price, window, *gang = step[1]
            model, _, capacity = model.partition("/")
            node_count = gang[0] if gang else 1
            shrinks = len(gang) > 1 and gang[1] and node_count > 1  # it may go on one smaller
            first = next_bid
            for member in range(node_count):  # a gang: node_count member bids, first id first
                bid = Bid(
                    next_bid,
                    model,
                    count,
                    price,
                    region=region,
                    created_at=now,
                    window=None if window is None else Interval(*window),
                    capacity=capacity or "spot",
                    image=IMAGES[first % 3] if first % 3 < len(IMAGES) else None,
                    node_count=node_count,
                    gang_id=first if node_count > 1 else None,
                    min_node_count=node_count - 1 if shrinks else None,
                )
                unserved = market.runners.unserved(bid) if member == 0 else None
                if unserved is not None:  # no node of its pools serves it: the service holds it
                    assert not any(
                        bid_fits_pool(bid, n) for n in state.nodes if n.state != NodeState.LOST
                    ), unserved
                    next_bid = first + node_count
                    break
                market.add_bid(bid)
                next_bid += 1
        elif kind == "reprice" and state.bids:
            repriced = _pick(state.bids, step[1])
            market.reprice_bid(repriced.id, step[2])  # running ones: from the next tick
        elif kind == "cancel" and state.bids:
            settled = market.cancel_bid(_pick(state.bids, step[1]).id, now)
            total_charged += settled.charges.total()
            book.bill(settled.charges, settled.endings)
        elif kind == "node":
            node = _pick(state.nodes, step[1])
            change = step[2]
            if node.state is NodeState.LOST and change != "live":
                continue
            new_state = {
                "reclaim": NodeState.RECLAIMED,
                "lose": NodeState.LOST,
                "drain": NodeState.DRAINING,
                "live": NodeState.LIVE,
            }.get(change, node.state)
            reserve = node.reserve_price * 3 if change == "reserve" else node.reserve_price
            serving = (node.runner, node.default_image, node.job_network)
            if change == "runner":  # an agent restarted with another runner: the next one
                serving = RUNNERS[(RUNNERS.index(serving) + 1) % len(RUNNERS)]
            runner, default_image, job_network = serving
            market.upsert_node(
                Node(
                    node.id,
                    node.gpu_model,
                    node.region,
                    node.gpu_count,
                    reserve,
                    new_state,
                    node.capacity,
                    runner=runner,
                    default_image=default_image,
                    job_network=job_network,
                )
            )
        elif kind in ("ack", "finish"):
            want = AllocationStatus.NOTICED if kind == "ack" else AllocationStatus.RUNNING
            allocs = [a for a in state.allocations if a.status is want]
            if allocs:
                alloc = _pick(allocs, step[1])
                status = AllocationStatus.PREEMPTED if kind == "ack" else AllocationStatus.FINISHED
                settled = market.end_allocation(alloc.id, status, now)
                total_charged += settled.charges.total()
                book.bill(settled.charges, settled.endings)
                for c in settled.charges:
                    assert math.isclose(c.price, expected[c.allocation_id])
        elif kind == "tick":
            now += step[1]
            before = market.snapshot()
            cold = clear(before, now) if check_each_tick else None
            decision = market.tick(now)
            if cold is not None:
                assert decision.equals(cold), "incremental and cold decisions differ"
            after = market.snapshot()
            check_tick(before, after, decision, expected, now)
            total_charged += decision.charges.total()
            book.bill(decision.charges, decision.endings)
            last_tick = decision
    return market, total_charged, last_tick


def check_tick(before, after, decision, expected, now):
    check_capacity(after)
    check_allocations(after)
    check_outbid_rule(after, now)
    check_free_fit_used(after, now)
    check_gangs(after, now)
    # charges: each row bills the price the checker computed at the previous tick
    for c in decision.charges:
        # whole micros: the exact amount plus the carry in (< 1), rounded down (a last charge:
        # up); ExactBook checks the totals to the micro
        assert -1 - 1e-6 < c.amount - c.price * 1e6 * c.gpu_count * c.seconds / 3600 < 2 + 1e-6
        assert c.allocation_id in expected, f"charge for unknown allocation {c.allocation_id}"
        assert c.price == pytest.approx(expected[c.allocation_id])
    prices = expected_prices(after, decision, expected)
    for a in after.allocations:
        if a.status.is_charged():
            assert a.price == pytest.approx(prices[a.id]), (a, prices[a.id])
            assert now - 0.001 < a.charged_until <= now  # billed to the whole millisecond
    expected.clear()
    expected.update(prices)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.lists(node_st, min_size=2, max_size=5), steps=step_st)
def test_invariants_hold_through_a_market_life(nodes, steps):
    run_life(nodes, steps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(node_st, min_size=2, max_size=5),
    steps=step_st,
    hysteresis=st.sampled_from((0, 0.2)),
)
def test_invariants_hold_for_any_hysteresis(nodes, steps, hysteresis):
    run_life(nodes, steps, hysteresis=hysteresis)


@settings(max_examples=100, deadline=None)
@given(nodes=st.lists(node_st, min_size=1, max_size=4), steps=step_st, data=st.data())
def test_a_losing_bid_raised_above_everyone_wins_next_tick(nodes, steps, data):
    """A waiting bid raised beyond every other bid's price times (1 + hysteresis), with a
    node of its pool that could hold it once the incumbents left, wins the next tick."""
    market, _, _ = run_life(nodes, [*steps, ("tick", 1)], check_each_tick=False)
    state = market.snapshot()
    active = {a.bid_id for a in state.allocations}
    waiting = [b for b in state.bids if b.id not in active and b.window is None]
    if not waiting:
        return
    bid = data.draw(st.sampled_from(waiting))
    top = max(b.max_price for b in state.bids) * 1.05 + 1.0
    reserved = {}
    for a in state.allocations:
        if a.status is AllocationStatus.RESERVED:
            reserved[a.node_id] = reserved.get(a.node_id, 0) + a.gpu_count
    fits = any(
        n.state is NodeState.LIVE
        and bid_fits_pool(bid, n)  # (its pool, and a runner that serves it)
        and n.reserve_price <= top
        and n.gpu_count - reserved.get(n.id, 0) >= bid.gpu_count
        for n in state.nodes
    )
    market.reprice_bid(bid.id, top)
    decision = market.tick(market.now + 1)
    won = {p.bid_id for p in decision.placements}
    assert (bid.id in won) == fits


@settings(max_examples=100, deadline=None)
@given(
    nodes=st.lists(node_st, min_size=2, max_size=5), bids=st.lists(bid_st, min_size=1, max_size=20)
)
def test_a_bid_below_every_reserve_never_runs(nodes, bids):
    market = Market(MarketConfig(regions=frozenset(REGIONS)))
    for i, (model, region, count, reserve) in enumerate(nodes, start=1):
        model, _, capacity = model.partition("/")
        market.upsert_node(Node(i, model, region, count, reserve, capacity=capacity or "spot"))
    for i, (model, region, count, _, _) in enumerate(bids, start=1):
        model, _, capacity = model.partition("/")
        market.add_bid(Bid(i, model, count, 0.1, region=region, capacity=capacity or "spot"))
    decision = market.tick(10.0)
    assert len(decision.placements) == 0
    for q in decision.quotes:
        assert q.clearing_price is None or q.clearing_price >= q.reserve_price


@settings(max_examples=50, deadline=None)
@given(nodes=st.lists(node_st, min_size=2, max_size=5), steps=step_st)
def test_clearing_is_deterministic(nodes, steps):
    market, _, _ = run_life(nodes, steps, check_each_tick=False)
    state = market.snapshot()
    now = market.now + 7 if market.now > -math.inf else 7.0
    assert clear(state, now).equals(clear(state, now))
