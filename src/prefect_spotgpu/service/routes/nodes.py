"""Node routes for their owners: a provider registers a node (its agent's token is returned
once) and lists, reads and changes its nodes (reserve price; drain, reclaim or offer again);
the admin sees and changes every node. An agent reads its own node (``GET /nodes/me``,
declared before ``/nodes/{node_id}`` so that it is matched first); its other routes are
``agents``'s, its token's ``access``'s. Who may call each route is in ``roles.ROUTE_ROLES``."""

from __future__ import annotations

from fastapi import APIRouter

from prefect_spotgpu.service import crud, schemas
from prefect_spotgpu.service.deps import CurrentNode, CurrentTenant, Db, TenantOrAdmin
from prefect_spotgpu.service.routes.params import API, Id, now

router = APIRouter(prefix=API)


@router.post(
    "/nodes",
    status_code=201,
    response_model=schemas.NodeCreated,
    tags=["nodes"],
    summary="Register a node you own (providers only); returns its agent token once",
)
def register_node(data: schemas.NodeCreate, tenant_id: CurrentTenant, db: Db):
    with db.begin() as session:
        node, token = crud.register_node(session=session, owner_id=tenant_id, data=data, now=now())
        return {**schemas.node_response(node).model_dump(), "token": token}


@router.get(
    "/nodes",
    response_model=list[schemas.NodeResponse],
    tags=["nodes"],
    summary="Your nodes (all nodes for the admin)",
)
def list_nodes(caller: TenantOrAdmin, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        return [schemas.node_response(n) for n in crud.list_nodes(session=session, owner_id=owner)]


@router.get(
    "/nodes/me",
    response_model=schemas.NodeResponse,
    tags=["agents"],
    summary="The node this agent token belongs to",
)
def my_node(caller_node: CurrentNode, db: Db):
    with db.begin() as session:
        return schemas.node_response(
            crud.get_node(session=session, node_id=caller_node, owner_id=None)
        )


@router.get("/nodes/{node_id}", response_model=schemas.NodeResponse, tags=["nodes"])
def get_node(node_id: Id, caller: TenantOrAdmin, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        return schemas.node_response(
            crud.get_node(session=session, node_id=node_id, owner_id=owner)
        )


@router.patch(
    "/nodes/{node_id}",
    response_model=schemas.NodeResponse,
    tags=["nodes"],
    summary="Set a node's reserve price, drain it, reclaim it or offer it again",
)
def update_node(node_id: Id, data: schemas.NodeUpdate, caller: TenantOrAdmin, db: Db):
    with db.begin() as session:
        owner = None if caller.admin else caller.tenant_id
        node = crud.get_node(session=session, node_id=node_id, owner_id=owner)
        return schemas.node_response(
            crud.update_node(
                session=session, node=node, data=data, provider=caller.admin or caller.provider
            )
        )
