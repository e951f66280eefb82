"""A node agent's word on its own presence: it leaves (it was asked to stop: SIGTERM, Ctrl-C,
``systemctl stop``) and it is back (it started again).

An agent that leaves takes its node back, as its owner's reclaim would: the node becomes
``reclaimed``, so the market notices its running allocations (each job saves and stops; the
runs resume elsewhere) and places nothing there. Unlike the owner's reclaim, the node keeps
what it was (``state_before_loss``, as a lost node does), and the agent's return offers it
again as it was: an agent never undoes its owner's word (an owner's reclaim or drain meanwhile
replaces what the node kept, and it stays so)."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from prefect_spotgpu.market import NodeState
from prefect_spotgpu.service import crud, gate, schemas
from prefect_spotgpu.service.deps import CurrentNode, Db
from prefect_spotgpu.service.models import NodeRow
from prefect_spotgpu.service.outbox import Entity, record_change
from prefect_spotgpu.service.routes.agents import _same_node
from prefect_spotgpu.service.routes.params import API, Id

router = APIRouter(prefix=API, tags=["agents"])
logger = logging.getLogger("prefect_spotgpu.service")

LEAVES_FROM = (NodeState.LIVE.value, NodeState.DRAINING.value)
"""The states an agent's leave takes a node from (reclaimed or lost: nothing to do)."""


@router.post(
    "/nodes/{node_id}/leave",
    response_model=schemas.NodeResponse,
    summary="The node agent stops: its jobs get their notice and resume elsewhere",
)
def leave(node_id: Id, caller_node: CurrentNode, db: Db):
    _same_node(node_id, caller_node)
    with db.begin() as session:
        node = crud.get_node(session=session, node_id=node_id, owner_id=None)
        if node.state in LEAVES_FROM:
            _move(session, node, NodeState.RECLAIMED, state_before_loss=node.state)
            logger.warning("node %s: its agent stops; its jobs are noticed", node_id)
        return schemas.node_response(node)


@router.post(
    "/nodes/{node_id}/back",
    response_model=schemas.NodeResponse,
    summary="The node agent started again: a node its agent left is as it was",
)
def back(node_id: Id, caller_node: CurrentNode, db: Db):
    _same_node(node_id, caller_node)
    with db.begin() as session:
        node = crud.get_node(session=session, node_id=node_id, owner_id=None)
        if node.state == NodeState.RECLAIMED and node.state_before_loss is not None:
            # left by its agent (an owner's reclaim keeps nothing): live only for a provider
            _move(session, node, crud.returning_state(session, node), state_before_loss=None)
        return schemas.node_response(node)


def _move(session, node: NodeRow, to: NodeState, **fields) -> None:
    gate.set_node_state(session=session, node=node, to=to, **fields)
    record_change(session=session, entity=Entity.NODE, entity_id=node.id, op="upsert")
