"""Gang bids in the service: one job on ``node_count`` nodes, stored as one ``bids`` row per member.

A gang of ``n`` is ``n`` rows written in one transaction (:func:`add_members`), ranks 0..n-1 in
id order, every row with the same terms, ``node_count`` n and ``gang_id`` rank 0's id (the
lowest); the market gets them rank 0 first (the outbox keeps their order). Only rank 0 keeps
the idempotency key. A cancel or a reprice through any member's id changes every member's row
(:func:`gang_rows`), and the market applies it to the whole gang; a member's finished job
finishes every row. Reads: a gang's member ids (:func:`members_of`), each allocation's rank
(:func:`allocation_ranks`) and where a member's gang meets (:func:`gang_places`: rank 0's node's
address, a port of the gang's own). Nothing here commits; the route does.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from prefect_spotgpu.market import NodeState
from prefect_spotgpu.protocol import HOLDING_STATUSES, UNSET_NODE_ADDRESS, AllocationStatus
from prefect_spotgpu.service.errors import Invalid
from prefect_spotgpu.service.models import AllocationRow, BidRow, NodeRow
from prefect_spotgpu.service.outbox import Entity, record_change
from prefect_spotgpu.service.schemas import BidCreate

MASTER_PORT_BASE = 20000
MASTER_PORTS = 12000
"""A gang's ``master_port`` is ``MASTER_PORT_BASE + gang_id % MASTER_PORTS``: one port per gang
(20000..31999), so two gangs whose rank 0 share a node do not collide (mostly), and below
Linux's ephemeral ports (32768 on), which an outgoing connection on the node could hold."""

_ACTIVE = tuple(s.value for s in AllocationStatus.active_statuses())
_HOLDING = frozenset(s.value for s in HOLDING_STATUSES)
_COPIED = (
    "tenant_id",
    "gpu_model",
    "region",
    "gpu_count",
    "max_price",
    "capacity",
    "window_start",
    "window_end",
    "deadline",
    "status",
    "hold_reason",
    "labels",
    "job",
    "job_env_sealed",
    "node_count",
    "min_node_count",
    "created_at",
    "updated_at",
)


def check_gang_fits(*, session: Session, data: BidCreate) -> None:
    """A 422 naming ``node_count`` (or ``min_node_count``, when given) when the bid's pool has
    fewer registered, non-lost nodes with at least its ``gpu_count`` GPUs than that (for region
    ``any``: in the region with the most)."""
    gpu_model, capacity, gpu_count = data.gpu_model, data.capacity, data.gpu_count
    region, nodes = data.region, data.min_node_count or data.node_count
    field = "node_count" if data.min_node_count is None else "min_node_count"
    counts = dict(
        session.execute(
            select(NodeRow.region, func.count())
            .where(
                NodeRow.gpu_model == gpu_model,
                NodeRow.capacity == capacity,
                NodeRow.gpu_count >= gpu_count,
                NodeRow.state != NodeState.LOST.value,
            )
            .group_by(NodeRow.region)
        ).all()
    )
    if region == "any":
        where, most = max(counts.items(), key=lambda kv: (kv[1], kv[0]), default=("any", 0))
    else:
        where, most = region, counts.get(region, 0)
    if nodes > most:
        raise Invalid(
            f"{field} {nodes} is more than the {most} registered {capacity} {gpu_model} "
            f"nodes with at least {gpu_count} GPUs in region {where}: a gang runs on "
            "distinct nodes of one region",
            field=field,
        )


def add_members(*, session: Session, first: BidRow) -> list[BidRow]:
    """Ranks 1..n-1 of the gang whose rank 0 is ``first`` (written, its change recorded):
    copies of its terms, in id order, each with its change in the outbox after rank 0's."""
    first.gang_id = first.id
    members = []
    for _ in range(first.node_count - 1):
        member = BidRow(gang_id=first.id, **{name: getattr(first, name) for name in _COPIED})
        session.add(member)
        session.flush()  # one at a time: each id above the one before
        record_change(session=session, entity=Entity.BID, entity_id=member.id, op="create")
        members.append(member)
    return members


def gang_rows(*, session: Session, bid: BidRow) -> list[BidRow]:
    """Every member row of ``bid``'s gang in rank order; ``[bid]`` for a one-node bid."""
    if bid.gang_id is None:
        return [bid]
    return list(
        session.scalars(select(BidRow).where(BidRow.gang_id == bid.gang_id).order_by(BidRow.id))
    )


def members_of(*, session: Session, bids: list[BidRow]) -> dict[int, list[int]]:
    """bid id -> its gang's member ids in rank order (``[]`` for a one-node bid)."""
    gangs = {b.gang_id for b in bids if b.gang_id is not None}
    members: defaultdict[int, list[int]] = defaultdict(list)
    if gangs:
        for bid_id, gang_id in session.execute(
            select(BidRow.id, BidRow.gang_id).where(BidRow.gang_id.in_(gangs)).order_by(BidRow.id)
        ):
            members[gang_id].append(bid_id)
    return {b.id: list(members[b.gang_id]) if b.gang_id is not None else [] for b in bids}


def allocation_ranks(*, session: Session, allocations: list[AllocationRow]) -> dict[int, int]:
    """bid id -> its rank, for the bids of ``allocations`` that are gang members."""
    bids = list(
        session.scalars(select(BidRow).where(BidRow.id.in_({a.bid_id for a in allocations})))
    )
    return {
        bid_id: members.index(bid_id)
        for bid_id, members in members_of(session=session, bids=bids).items()
        if members
    }


def gang_places(
    *, session: Session, allocations: list[AllocationRow], bids: dict[int, BidRow]
) -> dict[int, dict]:
    """allocation id -> its gang's ``{rank, world_size, master_addr, master_port,
    gpus_per_node, lead_allocation}``, for the allocations of gang members (``bids``: their
    bids by id).

    An allocation meets the allocations of its gang of the same run: a running or noticed one
    meets the running (or noticed) ones, a reservation the reservations (where the gang
    resumes). ``master_addr`` is rank 0's address there (the newest allocation, when there
    are several): its job address on a Docker node's job network (``job_network``), else its
    node's; ``lead_allocation`` is that allocation, ``peers`` the members' job addresses
    there, in rank order (who may reach the member on its job network). ``world_size`` is
    ``node_count``, or for a gang that may go on smaller, how many members hold such an
    allocation: the market places such a gang on its first ranks (``market/gangs.py``), so a
    member's rank is its place among the members all the same."""
    members = members_of(session=session, bids=[b for b in bids.values() if b.gang_id])
    ids = {i for gang in members.values() for i in gang}
    rows = session.execute(
        select(
            AllocationRow.bid_id,
            AllocationRow.id,
            AllocationRow.status,
            func.coalesce(AllocationRow.job_address, NodeRow.address),
            AllocationRow.job_address,
        )
        .join(NodeRow, NodeRow.id == AllocationRow.node_id)
        .where(AllocationRow.bid_id.in_(ids), AllocationRow.status.in_(_ACTIVE))
        .order_by(AllocationRow.id)
    ).all()
    held: dict[tuple[int, bool], tuple[int, str | None, str | None]] = {}
    for bid_id, alloc_id, status, address, job_address in rows:  # oldest first: newest wins
        held[(bid_id, status in _HOLDING)] = (alloc_id, address, job_address)
    places = {}
    for alloc in allocations:
        gang = members.get(alloc.bid_id)
        if not gang:
            continue
        bid = bids[alloc.bid_id]
        holding = alloc.status in _HOLDING
        lead, address, _ = held.get(
            (gang[0], holding), held.get((gang[0], not holding), (alloc.id, None, None))
        )
        world = bid.node_count
        if bid.min_node_count is not None:
            world = max(1, sum((m, holding) in held for m in gang))
        places[alloc.id] = {
            "rank": gang.index(alloc.bid_id),
            "world_size": world,
            "master_addr": address or UNSET_NODE_ADDRESS,
            "master_port": MASTER_PORT_BASE + bid.gang_id % MASTER_PORTS,
            "gpus_per_node": bid.gpu_count,
            "lead_allocation": lead,
        }
        members_held = [held[(m, holding)] for m in gang if (m, holding) in held]
        if any(job for _, _, job in members_held):  # (on job networks: ``job_network``)
            places[alloc.id]["peers"] = [  # (a member on a process node: its node's address)
                address for _, address, _ in members_held if _is_ipv4(address)
            ]
    return places


def _is_ipv4(address: str | None) -> bool:
    try:
        ipaddress.IPv4Address(address or "")
    except ValueError:
        return False
    return True
