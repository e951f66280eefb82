"""The market's parts are objects given the index and the parts they call, each usable alone
(``market/index.py``'s module docstring lists the graph)."""

from __future__ import annotations

import inspect

import pytest

from prefect_spotgpu.market import Bid, Market, Node
from prefect_spotgpu.market.allocations import Allocations
from prefect_spotgpu.market.bulk import BulkAdmission
from prefect_spotgpu.market.clearing import Clearing
from prefect_spotgpu.market.decision import PlacementKind
from prefect_spotgpu.market.gangs import Gangs
from prefect_spotgpu.market.holds import Holds
from prefect_spotgpu.market.incumbents import victims_on
from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.pricing import Pricing
from prefect_spotgpu.market.runners import Runners

PARTS = (Pricing, Allocations, Gangs, BulkAdmission, Clearing, Holds, Runners)


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.__name__)
def test_each_part_is_given_the_index_and_inherits_nothing(part):
    assert part.__bases__ == (object,), f"{part.__name__} inherits {part.__bases__}"
    first = next(iter(inspect.signature(part).parameters))
    assert first == "index", f"{part.__name__}'s first argument is {first!r}, not the index"


def test_the_market_is_composed_of_its_parts_on_one_index():
    market = Market()
    assert Market.__bases__ == (object,)
    for name, part in vars(market).items():
        if isinstance(part, PARTS):
            assert part.index is market.index, f"market.{name} has another index"
    assert market.allocations.gangs is market.gangs  # the one cycle, wired once


class Spy:
    """The real ``Allocations`` (so the index changes as it would), with the placements and
    notices asked of it recorded: what a part decided, seen at the interface it was given."""

    def __init__(self, real: Allocations) -> None:
        self.real = real
        self.calls: list[tuple] = []

    def place(self, brow, nrow, kind, now, expires=None):
        self.calls.append(("place", brow, nrow, kind))
        return self.real.place(brow, nrow, kind, now, expires)

    def notice(self, arow, reason, deadline, now):
        self.calls.append(("notice", arow, reason))
        return self.real.notice(arow, reason, deadline, now)

    def outbid(self, takeover, victims, deadline, now):
        self.calls.append(("outbid", takeover, tuple(victims)))
        return self.real.outbid(takeover, victims, deadline, now)

    def __getattr__(self, name):
        return getattr(self.real, name)


def two_nodes_one_pool() -> Market:
    """Two A100 nodes of one pool at different reserves (so the cold-tick shortcuts, which need
    one reserve, leave the clearing to its one-by-one loop)."""
    market = Market()
    market.upsert_node(Node(1, "A100-80G", "eu-west", 8, reserve_price=0.5))
    market.upsert_node(Node(2, "A100-80G", "eu-west", 4, reserve_price=0.9))
    return market


def test_the_clearing_alone_places_through_the_allocations_it_is_given():
    market = two_nodes_one_pool()
    market.add_bid(Bid(10, "A100-80G", 4, 1.2, region="eu-west"))
    ix = market.index
    spy = Spy(market.allocations)
    clearing = Clearing(ix, spy, market.gangs, BulkAdmission(ix))
    market.tick(now=0.0)  # (the tick's upkeep before the clearing: nodes live, books open)
    assert market.allocation_status(1) is not None  # the market's own clearing placed bid 10
    market.add_bid(Bid(11, "A100-80G", 4, 1.1, region="eu-west"))
    clearing.clear_model(ix.intern_model("A100-80G"), now=1.0)
    # bid 10 took node 2 (the tightest fit); bid 11 takes the free GPUs of node 1
    assert spy.calls == [("place", ix.bid_row[11], ix.node_row[1], PlacementKind.NEW)]


def test_an_eviction_notices_through_the_allocations_it_is_given():
    market = two_nodes_one_pool()
    market.add_bid(Bid(10, "A100-80G", 8, 0.6, region="eu-west"))
    market.add_bid(Bid(11, "A100-80G", 4, 1.0, region="eu-west"))
    market.tick(now=0.0)
    ix = market.index
    spy = Spy(market.allocations)
    clearing = Clearing(ix, spy, market.gangs, BulkAdmission(ix))
    market.add_bid(Bid(12, "A100-80G", 8, 2.0, region="eu-west"))
    ix.tick_number += 1  # (bid 10's allocation is an incumbent from an earlier tick)
    clearing.clear_model(ix.intern_model("A100-80G"), now=1.0)
    kinds = [c[0] for c in spy.calls]
    assert kinds == ["place", "outbid"], spy.calls  # reserve first, then notice the victim
    assert spy.calls[0][1:] == (ix.bid_row[12], ix.node_row[1], PlacementKind.TAKEOVER)
    (victim,) = spy.calls[1][2]
    assert int(ix.a.bid[victim]) == ix.bid_row[10]  # bid 10's allocation, on node 1
    assert ix.a.fee_owed[spy.calls[1][1]] > 0  # the takeover owes the notice's fee


def test_victims_are_read_off_the_index_by_price_and_hysteresis():
    market = two_nodes_one_pool()
    market.add_bid(Bid(10, "A100-80G", 8, 1.0, region="eu-west"))
    market.tick(now=0.0)
    ix: MarketIndex = market.index
    ix.tick_number += 1
    node = ix.node_row[1]
    (arow,) = ix.node_alloc_rows(node)
    assert victims_on(ix, node, 8, 2.0) == [arow]
    assert victims_on(ix, node, 8, 1.0 * (1 + ix.config.hysteresis)) is None  # not beaten
    assert victims_on(ix, node, 8, 0.4) is None  # below the node's reserve


def test_pricing_alone_quotes_the_index_as_the_tick_did():
    market = two_nodes_one_pool()
    market.add_bid(Bid(10, "A100-80G", 8, 1.0, region="eu-west"))
    market.add_bid(Bid(11, "A100-80G", 8, 0.7, region="eu-west"))  # loses: sets the price
    decision = market.tick(now=0.0)
    quotes, _ = Pricing(market.index).quotes(0.0)
    assert quotes == decision.quotes
    assert decision.quote("A100-80G", "eu-west").clearing_price == 0.7


def test_holds_alone_hold_and_release_a_bid_on_the_index():
    market = two_nodes_one_pool()
    market.add_bid(Bid(10, "A100-80G", 4, 1.0, region="eu-west"))
    holds = Holds(market.index, market.allocations)
    holds.hold_bid(10)
    assert market.holds.is_held(10)  # one index: the market's own part sees it
    assert holds.unhold_bid(10) and not market.holds.is_held(10)
