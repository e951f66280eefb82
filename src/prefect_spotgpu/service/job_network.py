"""Docker nodes' job networks in the service: whose subnet is whose, and each job's address.

A Docker node started with ``--job-subnet`` runs its containers on a network of that subnet,
which the operator routes between the GPU hosts (docs/operators/gpu-hosts.md#job-networks): a
gang's members, on several hosts, reach each other there and nothing else reaches them
(the agent's firewall, ``agent/runners/job_network.py``). The service gives every allocation
on such a node an address of the subnet when the market places it (:func:`assign_addresses`,
in the tick's transaction: the tick leader is the only writer of new allocations), the lowest
that no active allocation of the node holds; ``gangs.gang_places`` tells each member its
peers' addresses and rank 0's, the gang's ``MASTER_ADDR``.

A node's subnet is its provider's word: one overlapping another node's would give two jobs
one address, so it is refused (:func:`check_subnet_free`, a 422 naming ``job_subnet``).
"""

from __future__ import annotations

import ipaddress

from sqlalchemy import select
from sqlalchemy.orm import Session

from prefect_spotgpu.protocol import AllocationStatus
from prefect_spotgpu.service.errors import Invalid
from prefect_spotgpu.service.models import AllocationRow, NodeRow

_ACTIVE = tuple(s.value for s in AllocationStatus.active_statuses())
FIRST_HOST = 2
"""A job network's first job address is its network address + 2: + 1 is the bridge's own
(the gateway Docker gives the network, ``agent/runners/job_network.py``)."""


def check_subnet_free(*, session: Session, node_id: int | None, subnet: str) -> None:
    """A 422 naming ``job_subnet`` when ``subnet`` overlaps another node's job network."""
    mine = ipaddress.IPv4Network(subnet)
    others = session.execute(
        select(NodeRow.job_subnet).where(
            NodeRow.job_subnet.is_not(None), NodeRow.id != (node_id or 0)
        )
    ).scalars()
    for theirs in others:
        if mine.overlaps(ipaddress.IPv4Network(theirs)):
            raise Invalid(
                f"job_subnet {subnet} overlaps {theirs}, another node's job network: each "
                "node's must be its own, routed to it (docs/operators/gpu-hosts.md#job-networks)",
                field="job_subnet",
            )


def assign_addresses(*, session: Session, rows: list[dict]) -> None:
    """Give each new allocation (a row of ``gate.create_allocations``) on a node with a job
    network its ``job_address``: the node's lowest address from ``FIRST_HOST`` that neither an
    active allocation of the node nor an earlier row holds. A node with every address taken
    (a /24 holds 253: more than any node's jobs) gives none, and its job fails to start,
    saying why (``agent/runners/docker.py``)."""
    nodes = {r["node_id"] for r in rows}
    if not nodes:
        return
    subnets = dict(
        session.execute(
            select(NodeRow.id, NodeRow.job_subnet).where(
                NodeRow.id.in_(nodes), NodeRow.job_subnet.is_not(None)
            )
        ).all()
    )
    if not subnets:
        return
    taken: dict[int, set[str]] = {node: set() for node in subnets}
    for node, address in session.execute(
        select(AllocationRow.node_id, AllocationRow.job_address).where(
            AllocationRow.node_id.in_(subnets),
            AllocationRow.status.in_(_ACTIVE),
            AllocationRow.job_address.is_not(None),
        )
    ):
        taken[node].add(address)
    for row in rows:
        node = row["node_id"]
        row["job_address"] = None  # (every row the same keys: one insert for the lot)
        if node not in subnets:
            continue
        net = ipaddress.IPv4Network(subnets[node])
        for offset in range(FIRST_HOST, net.num_addresses - 1):  # (not the broadcast)
            address = str(net.network_address + offset)
            if address not in taken[node]:
                taken[node].add(address)
                row["job_address"] = address
                break
