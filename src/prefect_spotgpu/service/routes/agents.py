"""Node agent routes: an agent, with its node's token, acts only for its own node (it reads
the node with ``GET /nodes/me``, a ``nodes`` route). It sends heartbeats with telemetry (kept
with the version the agent sent: ``versions``), reconciles against the node's active
allocations (each running one with its job, environment opened), long-polls the node's
assignments and notices, and reports checkpoints, the final save and the job's end. Every
report, accepted or refused, is kept in the audit table ``node_reports``. An agent whose jobs
cannot start drains its own node (``drain``), as its owner would: the node then takes no new
work until its owner offers it again."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from prefect_spotgpu.market import AllocationStatus, NodeState, NoticeReason
from prefect_spotgpu.protocol import HOLDING_STATUSES, TELEMETRY_AGENT_VERSION
from prefect_spotgpu.service import crud, gangs, queries, schemas, versions
from prefect_spotgpu.service.deps import CurrentNode, Db
from prefect_spotgpu.service.errors import Forbidden, ServiceError
from prefect_spotgpu.service.models import BidRow
from prefect_spotgpu.service.routes.long_poll import long_poll
from prefect_spotgpu.service.routes.params import API, Cursor, Id, Wait, now
from prefect_spotgpu.service.sealing import Sealer, SealError

router = APIRouter(prefix=API, tags=["agents"])
logger = logging.getLogger("prefect_spotgpu.service")

RUNS_A_JOB = frozenset(s.value for s in HOLDING_STATUSES)
"""The allocations whose node is given their job: running, or noticed (saving); and with
``warm_replacement``, a one-node bid's migration target (:func:`_warms_up`)."""

WARMING_NOTICES = frozenset({NoticeReason.RECLAIMED.value, NoticeReason.BELOW_RESERVE.value})
"""The notices whose migration target is given its job warm: those the job's own node's owner
(a reclaim, a raised reserve) or its own bid (a release) caused. Never an outbid: any tenant can
outbid a job, and a provider could then make its own idle node the target (a node of exactly the
job's size, the lowest reserve) and read the job's secrets before the move is real. After an
outbid the target gets the job when the move is: once the old allocation has ended and the
reservation runs (docs/operators/security.md#no-free-preemption)."""


def _warms_up(allocation, bid: BidRow, settings, moved_by: str | None) -> bool:
    """A migration target that starts its job at the notice, in a waiting role: a one-node
    bid's (a gang's replacement waits for its whole gang), with ``warm_replacement`` on, whose
    bid was moved by a notice of ``WARMING_NOTICES`` (``moved_by``: the reason of its noticed
    allocation; None once that has ended: the target then runs the job, or soon will)."""
    return (
        settings.warm_replacement
        and allocation.status == AllocationStatus.RESERVED
        and allocation.kind == "migration"
        and bid.node_count == 1
        and moved_by in WARMING_NOTICES
    )


@router.post(
    "/nodes/{node_id}/heartbeat",
    response_model=schemas.NodeResponse,
    summary="The node agent's heartbeat, with telemetry",
)
def heartbeat(
    node_id: Id, data: schemas.Heartbeat, caller_node: CurrentNode, db: Db, request: Request
):
    """The node is alive; its telemetry is kept with the version its agent sent (its
    ``agent_version``: ``versions``, judged before), images and runner terms when they
    change."""
    _same_node(node_id, caller_node)
    telemetry = None
    if data.telemetry is not None:
        telemetry = data.telemetry.model_dump(mode="json", exclude_none=True)
        if (version := versions.sent_version(request)) is not None:
            telemetry[TELEMETRY_AGENT_VERSION] = version
    with db.begin() as session:
        node = crud.get_node(session=session, node_id=node_id, owner_id=None)
        return schemas.node_response(
            crud.heartbeat_node(
                session=session,
                node=node,
                telemetry=telemetry,
                images=data.images,
                address=data.address,
                runner=data.runner,
                default_image=data.default_image,
                job_subnet=data.job_subnet,
                now=now(),
            )
        )


@router.post(
    "/nodes/{node_id}/drain",
    response_model=schemas.NodeResponse,
    summary="The node agent drains its own node: its jobs cannot start",
)
def drain(node_id: Id, data: schemas.NodeDrain, caller_node: CurrentNode, db: Db):
    """A live node becomes draining, as its owner's ``PATCH /nodes/{node_id}`` makes it: its
    running jobs go on, it takes no new work until its owner offers it again (``state``
    live). A node in any other state is left as it is (an agent never undoes its owner's
    reclaim). The reason goes to the service's log."""
    _same_node(node_id, caller_node)
    with db.begin() as session:
        node = crud.get_node(session=session, node_id=node_id, owner_id=None)
        if node.state == NodeState.LIVE:
            crud.update_node(
                session=session,
                node=node,
                data=schemas.NodeUpdate(state=NodeState.DRAINING.value),
            )
            logger.warning("node %s drained by its agent: %s", node_id, data.reason)
        return schemas.node_response(node)


@router.get(
    "/nodes/{node_id}/allocations",
    response_model=list[schemas.Assignment],
    summary="The node's active allocations (for reconciliation)",
)
def node_allocations(node_id: Id, caller_node: CurrentNode, db: Db, request: Request):
    """A job, its environment opened, goes only to the node that holds a running (or noticed)
    allocation of its bid, while it holds it, or (``warm_replacement``) a one-node bid's
    migration target from a reclaim's or a reserve's notice on (:func:`_warms_up`: never an
    outbid's); another reserved allocation shows no job yet. A gang member's says where its
    gang meets (``gang``: rank, world size, rank 0's address)."""
    _same_node(node_id, caller_node)
    sealer = request.app.state.sealer
    settings = request.app.state.settings
    with db.begin() as session:
        allocations = crud.list_allocations(session=session, node_id=node_id, active_only=True)
        bids = queries.get_bids(session=session, bid_ids={a.bid_id for a in allocations})
        places = gangs.gang_places(session=session, allocations=allocations, bids=bids)
        migrating = {a.bid_id for a in allocations if a.kind == "migration"}
        moved_by = queries.list_notice_reasons(session=session, bid_ids=migrating)
        return [
            schemas.Assignment(
                **schemas.allocation_response(a).model_dump(exclude={"rank"}),
                rank=places[a.id]["rank"] if a.id in places else None,
                tenant_id=a.tenant_id,
                job=_job(bids[a.bid_id], sealer)
                if a.status in RUNS_A_JOB
                or _warms_up(a, bids[a.bid_id], settings, moved_by.get(a.bid_id))
                else None,
                checkpoint_key=f"bid-{a.bid_id}",
                job_address=a.job_address,
                gang=places.get(a.id),
            )
            for a in allocations
        ]


def _job(bid: BidRow, sealer: Sealer) -> dict | None:
    """The bid's job for its node; one that cannot be opened is logged and left out (the
    agent then reports the allocation failed), never a 500 for the node's every job."""
    try:
        return crud.job_for_node(bid=bid, sealer=sealer)
    except SealError:
        logger.error("bid %s: its sealed job environment does not open with this key", bid.id)
        return None


@router.get(
    "/nodes/{node_id}/events",
    response_model=schemas.EventsPage,
    summary="Long-poll the node's assignments and notices",
)
async def node_events(
    node_id: Id,
    caller_node: CurrentNode,
    db: Db,
    request: Request,
    after: Cursor = 0,
    timeout: Wait = 25.0,
):
    _same_node(node_id, caller_node)
    return await long_poll(request, db, after, timeout, node_id=node_id)


@router.post(
    "/allocations/{allocation_id}/report",
    response_model=schemas.AllocationResponse,
    summary="Report a checkpoint, the final save, the job's end or an image pull's progress",
)
def report(allocation_id: Id, data: schemas.AllocationReport, caller_node: CurrentNode, db: Db):
    """Accepted only for the calling node's own allocation in its current epoch; every report,
    accepted or refused, is kept in the audit table ``node_reports``."""
    audit = {"node_id": caller_node, "allocation_id": allocation_id, "report": data}
    try:
        with db.begin() as session:
            alloc = crud.report_allocation(session=session, **audit, now=now())
            crud.audit_report(session=session, **audit, status_code=200, detail=None, now=now())
            return schemas.allocation_response(alloc)
    except ServiceError as exc:
        with db.begin() as session:
            crud.audit_report(
                session=session,
                **audit,
                status_code=exc.status_code,
                detail=exc.message,
                now=now(),
            )
        raise


def _same_node(node_id: int, caller_node: int) -> None:
    if node_id != caller_node:
        raise Forbidden(f"this token belongs to node {caller_node}, not node {node_id}")
