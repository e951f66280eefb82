"""Which status changes are legal: the allocation's and the node's tables, as plain data.

The market service writes these rows only through its gate (``service/gate.py``), which checks
every change against these tables before its compare-and-set; property tests check the engine
against them. A bid's table is ``protocol.BID_FROM_STATES`` (``BidStatus`` lives there).
"""

from __future__ import annotations

from prefect_spotgpu.market.types import AllocationStatus, NodeState

_A = AllocationStatus
ALLOCATION_FROM_STATES: dict[AllocationStatus, frozenset[AllocationStatus]] = {
    _A.RUNNING: frozenset({_A.RESERVED}),  # a reservation promoted
    _A.NOTICED: frozenset({_A.RUNNING}),
    _A.PREEMPTED: frozenset({_A.RUNNING, _A.NOTICED}),
    _A.FINISHED: frozenset({_A.RUNNING, _A.NOTICED}),
    _A.RELEASED: frozenset({_A.RESERVED}),
}
"""For each status, the statuses an allocation may come from (the service's gate checks every
write against it; a terminal status is left for nothing)."""
ALLOCATION_NEW_STATES = frozenset({_A.RUNNING, _A.RESERVED})
"""The statuses an allocation may be created in."""

_N = NodeState
NODE_FROM_STATES: dict[NodeState, frozenset[NodeState]] = {
    _N.LIVE: frozenset({_N.LIVE, _N.DRAINING, _N.RECLAIMED, _N.LOST}),  # the owner; a return
    _N.DRAINING: frozenset({_N.LIVE, _N.DRAINING, _N.RECLAIMED, _N.LOST}),
    _N.RECLAIMED: frozenset({_N.LIVE, _N.DRAINING, _N.RECLAIMED, _N.LOST}),
    _N.LOST: frozenset({_N.LIVE, _N.DRAINING, _N.RECLAIMED}),  # silence, whatever the state
}
"""For each node state, the states a node may come from: its owner sets live, draining or
reclaimed from any state (a lost node too: the owner's word outlives the agent's outage);
silence makes any other state lost; a lost node's agent that returns restores the state it
had. No node stays lost twice (a loss is recorded once)."""
NODE_NEW_STATES = frozenset({_N.LIVE})
"""A node registers live."""


def refusal(what: str, current, to, from_states: dict, terminal=frozenset()) -> str | None:
    """Why ``what`` may not go from ``current`` to ``to`` under ``from_states``; None when it
    may.

    >>> refusal("bid", "open", "cancelled", {"cancelled": {"open"}}) is None
    True
    >>> refusal("bid", "finished", "open", {"open": {"held"}}, terminal={"finished"})
    'bid is finished, which is final'
    >>> refusal("node", "live", "open", {"open": {"held"}})
    'node: live -> open is not allowed (open comes from held)'
    """
    if current in terminal:
        return f"{what} is {current}, which is final"
    allowed = from_states.get(to, frozenset())
    if current not in allowed:
        sources = ", ".join(sorted(str(s) for s in allowed)) or "nothing"
        return f"{what}: {current} -> {to} is not allowed ({to} comes from {sources})"
    return None
