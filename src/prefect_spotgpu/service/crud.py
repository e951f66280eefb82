"""Data functions: keyword-only ``verb_noun(*, session, ...)``; they never commit.

Tenants and keys, nodes, bids, and reads of allocations, events and prices. API writes that the
tick leader must see (bids, nodes, reports, credits) also record a change in the
``market_changes`` outbox (:func:`~prefect_spotgpu.service.outbox.record_change`) in the same
transaction, so nothing accepted is lost. Nothing here writes an allocation row: the tick
leader does, through ``gate``. The ledger (credits), the sealing of job environments, an
agent's reports and a tenant's webhook (``webhook_settings``) have modules of their own; the
routes call them as ``crud.<name>`` too. Admission reserves a bid's credit (``credit``).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from prefect_spotgpu.market import DEFAULT_CATALOG, NodeState
from prefect_spotgpu.protocol import LIVE_BID_STATUSES, AllocationStatus, BidStatus, Capacity
from prefect_spotgpu.service import credit, gangs, gate, images, job_network, schemas
from prefect_spotgpu.service.errors import Conflict, Forbidden, NotFound
from prefect_spotgpu.service.ledger import CreditKind, add_credit
from prefect_spotgpu.service.ledger import ledger_entries as ledger_entries
from prefect_spotgpu.service.models import (
    AllocationRow,
    ApiKey,
    BidRow,
    EventRow,
    NodeRow,
    PriceBar,
    Tenant,
)
from prefect_spotgpu.service.outbox import Entity, record_change
from prefect_spotgpu.service.reports import audit_report as audit_report
from prefect_spotgpu.service.reports import report_allocation as report_allocation
from prefect_spotgpu.service.sealing import Sealer, seal_job
from prefect_spotgpu.service.sealing import check_sealing_key as check_sealing_key
from prefect_spotgpu.service.sealing import job_for_node as job_for_node
from prefect_spotgpu.service.sealing import seal_plaintext_jobs as seal_plaintext_jobs
from prefect_spotgpu.service.webhook_settings import (
    check_webhook_destination as check_webhook_destination,
)
from prefect_spotgpu.service.webhook_settings import list_deliveries as list_deliveries
from prefect_spotgpu.service.webhook_settings import set_webhook as set_webhook

ACTIVE = tuple(s.value for s in AllocationStatus.active_statuses())


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(24)}"


# ---------------------------------------------------------------- tenants and keys


def create_tenant(
    *, session: Session, name: str, starting_credit: int, now: datetime
) -> tuple[Tenant, str]:
    """A tenant and its first key; ``starting_credit`` in micros."""
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise Conflict(f"tenant name {name!r} is taken", field="name")
    tenant = Tenant(name=name, credits_micros=0, spent_micros=0, created_at=now)
    try:
        with session.begin_nested():
            session.add(tenant)
            session.flush()
    except IntegrityError:  # a concurrent request took the name first
        raise Conflict(f"tenant name {name!r} is taken", field="name") from None
    key = issue_key(session=session, tenant_id=tenant.id, now=now)
    if starting_credit > 0:
        add_credit(
            session=session,
            tenant_id=tenant.id,
            amount=starting_credit,
            kind=CreditKind.STARTING,
            reason="starting credit for a new tenant",
            now=now,
        )
    return tenant, key


def issue_key(*, session: Session, tenant_id: int, now: datetime) -> str:
    """A new API key for the tenant (only its hash is kept); returns the key, shown once."""
    key = new_secret("sgk")
    session.add(
        ApiKey(tenant_id=tenant_id, key_hash=hash_secret(key), prefix=key[:8], created_at=now)
    )
    return key


def revoke_keys(*, session: Session, tenant_id: int, now: datetime) -> int:
    """Revoke every live key of the tenant; how many were revoked. The tenant's row is
    locked first, so two concurrent rotations leave exactly one live key."""
    session.get(Tenant, tenant_id, with_for_update=True)
    return session.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    ).rowcount


def replace_keys(*, session: Session, tenant_id: int, now: datetime) -> str:
    """Revoke every key of the tenant and issue one new key (returned, shown once)."""
    revoke_keys(session=session, tenant_id=tenant_id, now=now)
    return issue_key(session=session, tenant_id=tenant_id, now=now)


def set_provider(*, session: Session, tenant: Tenant, provider: bool) -> Tenant:
    """Allow a tenant to register nodes, or take that back: a former provider's live nodes
    drain (their running jobs finish, they take no new work)."""
    tenant.provider = provider
    if not provider:
        for node in session.scalars(
            select(NodeRow).where(NodeRow.owner_id == tenant.id, NodeRow.state == NodeState.LIVE)
        ):
            gate.set_node_state(session=session, node=node, to=NodeState.DRAINING)
            record_change(session=session, entity=Entity.NODE, entity_id=node.id, op="upsert")
    return tenant


def get_tenant(*, session: Session, tenant_id: int) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id} not found")
    return tenant


# ---------------------------------------------------------------- nodes


def register_node(
    *, session: Session, owner_id: int, data: schemas.NodeCreate, now: datetime
) -> tuple[NodeRow, str]:
    if (
        session.scalar(
            select(NodeRow.id).where(NodeRow.owner_id == owner_id, NodeRow.name == data.name)
        )
        is not None
    ):
        raise Conflict(f"you already have a node named {data.name!r}", field="name")
    if data.job_subnet is not None:
        job_network.check_subnet_free(session=session, node_id=None, subnet=data.job_subnet)
    token = new_secret("sgn")
    node = NodeRow(
        owner_id=owner_id,
        name=data.name,
        gpu_model=data.gpu_model,
        region=data.region,
        gpu_count=data.gpu_count,
        reserve_price=data.reserve_price,
        capacity=data.capacity,
        state=NodeState.LIVE.value,
        token_hash=hash_secret(token),
        declared=data.declared,
        inventory=None
        if data.inventory is None
        else [g.model_dump(mode="json", exclude_none=True) for g in data.inventory],
        telemetry=None,
        address=data.address,
        runner=data.runner,
        default_image=data.default_image,
        job_subnet=data.job_subnet,
        last_heartbeat_at=now,
        created_at=now,
    )
    try:
        with session.begin_nested():
            session.add(node)
            session.flush()
    except IntegrityError:  # a concurrent request took the name first
        raise Conflict(f"you already have a node named {data.name!r}", field="name") from None
    record_change(session=session, entity=Entity.NODE, entity_id=node.id, op="upsert")
    return node, token


def rotate_node_token(*, session: Session, node: NodeRow) -> str:
    """A new agent token for the node; the old one is refused from now on."""
    token = new_secret("sgn")
    node.token_hash = hash_secret(token)
    return token


def revoke_node_token(*, session: Session, node: NodeRow) -> None:
    """No token works for the node any more (its agent stops; the owner may rotate later)."""
    node.token_hash = hash_secret(new_secret("revoked"))


def get_node(*, session: Session, node_id: int, owner_id: int | None) -> NodeRow:
    """A node; ``owner_id`` None means the admin, who sees every node."""
    node = session.get(NodeRow, node_id)
    if node is None or (owner_id is not None and node.owner_id != owner_id):
        raise NotFound(f"node {node_id} not found")
    return node


def list_nodes(*, session: Session, owner_id: int | None) -> list[NodeRow]:
    query = select(NodeRow).order_by(NodeRow.id)
    if owner_id is not None:
        query = query.where(NodeRow.owner_id == owner_id)
    return list(session.scalars(query))


def heartbeat_node(
    *,
    session: Session,
    node: NodeRow,
    telemetry: dict | None,
    now: datetime,
    images: list[str] | None = None,
    address: str | None = None,
    runner: str | None = None,
    default_image: str | None = None,
    job_subnet: str | None = None,
) -> NodeRow:
    """A heartbeat: the node is alive; its telemetry, the images it holds and how it runs jobs
    (a change goes to the tick leader: placement prefers a node with a bid's image, and places
    a bid only on a node whose runner serves it; a gang member only on one with a job
    network)."""
    node.last_heartbeat_at = now
    if address is not None:  # where other nodes reach it (a gang's rank 0: MASTER_ADDR)
        node.address = address
    if telemetry is not None:
        node.telemetry = telemetry
    changed = False
    if images is not None and sorted(set(images)) != (node.images or []):
        node.images = sorted(set(images))
        changed = True
    said = (runner, default_image, job_subnet)
    if runner is not None and said != (node.runner, node.default_image, node.job_subnet):
        if job_subnet is not None and job_subnet != node.job_subnet:
            job_network.check_subnet_free(session=session, node_id=node.id, subnet=job_subnet)
        node.runner, node.default_image, node.job_subnet = said
        changed = True
    if changed and node.state != NodeState.LOST:  # a lost node's return records it below
        record_change(session=session, entity=Entity.NODE, entity_id=node.id, op="upsert")
    if node.state == NodeState.LOST:  # the agent is back: the node as it was, empty
        back = returning_state(session, node)
        gate.set_node_state(session=session, node=node, to=back, state_before_loss=None)
        record_change(session=session, entity=Entity.NODE, entity_id=node.id, op="upsert")
    return node


def returning_state(session: Session, node: NodeRow) -> NodeState:
    """What a node whose agent is back becomes: a live node offers its GPUs again, unless its
    owner is no longer a provider; a reclaimed or draining one stays so (the owner's word
    outlives the agent's outage or stop)."""
    owner = session.get(Tenant, node.owner_id)
    before = NodeState(node.state_before_loss or NodeState.LIVE)
    offers = before is NodeState.LIVE and owner is not None and owner.provider
    return NodeState.LIVE if offers else before if before != NodeState.LIVE else NodeState.DRAINING


def update_node(
    *, session: Session, node: NodeRow, data: schemas.NodeUpdate, provider: bool = True
) -> NodeRow:
    """Change a node's reserve or state. A former provider (``provider`` False) may still
    drain or reclaim its nodes, never offer them again or reprice them."""
    if not provider and (data.reserve_price is not None or data.state == NodeState.LIVE):
        raise Forbidden(
            "only a provider may offer a node or set its reserve: the operator grants that role"
        )
    if data.reserve_price is not None and node.capacity == Capacity.ON_DEMAND:
        raise Conflict(
            f"node {node.id} sells on-demand capacity at the on-demand price: "
            "its reserve_price cannot change",
            field="reserve_price",
        )
    if data.state is not None:  # the owner's word replaces what a loss remembered
        gate.set_node_state(
            session=session, node=node, to=NodeState(data.state), state_before_loss=None
        )
    if data.reserve_price is not None:
        node.reserve_price = data.reserve_price
    record_change(session=session, entity=Entity.NODE, entity_id=node.id, op="upsert")
    return node


# ---------------------------------------------------------------- bids


def create_bid(
    *,
    session: Session,
    tenant_id: int,
    data: schemas.BidCreate,
    now: datetime,
    sealer: Sealer,
    limits: credit.BidLimits,
) -> tuple[BidRow, bool]:
    """The bid, and whether it was created now (False: the idempotency key found it).

    Admission reserves its credit (``service/credit.py``: refused with a 402 naming the
    balance and the amount needed) and counts it against the tenant's cap on open bids, under
    the tenant's row lock. The job's environment is sealed (encrypted) here: the row keeps the
    names in the clear (``job.env_names``) and the values only in ``job_env_sealed``."""
    fields = bid_fields(session=session, data=data, sealer=sealer)
    if data.idempotency_key is not None:
        existing = session.scalar(
            select(BidRow).where(
                BidRow.tenant_id == tenant_id, BidRow.idempotency_key == data.idempotency_key
            )
        )
        if existing is not None:
            same_bid_or_conflict(existing, fields)
            return existing, False
    if data.node_count > 1:
        gangs.check_gang_fits(session=session, data=data)
    credit.reserve_for_bid(session=session, tenant_id=tenant_id, data=data, limits=limits)
    bid = BidRow(
        tenant_id=tenant_id,
        idempotency_key=data.idempotency_key,
        status=BidStatus.OPEN.value,
        hold_reason=None,
        created_at=now,
        updated_at=now,
        **fields,
    )
    if data.idempotency_key is None:
        session.add(bid)
        session.flush()
    else:  # a concurrent request with the same key may win the insert: return its bid
        try:
            with session.begin_nested():
                session.add(bid)
                session.flush()
        except IntegrityError:
            existing = session.scalar(
                select(BidRow).where(
                    BidRow.tenant_id == tenant_id, BidRow.idempotency_key == data.idempotency_key
                )
            )
            if existing is None:
                raise
            same_bid_or_conflict(existing, fields)
            return existing, False
    record_change(session=session, entity=Entity.BID, entity_id=bid.id, op="create")
    if bid.node_count > 1:  # a gang: its other members, after rank 0 (module gangs)
        gangs.add_members(session=session, first=bid)
    return bid, True


def bid_fields(*, session: Session, data: schemas.BidCreate, sealer: Sealer) -> dict:
    """The columns of a new bid row from its request: the job's image resolved in the
    operator's catalogue (a 422 naming ``job.image`` otherwise) and its environment sealed."""
    fields = data.model_dump(exclude={"idempotency_key"})
    job = fields.pop("job", None)
    if job is not None:
        if job.get("image") is not None:  # only the operator's images: name or reference
            job["image"] = images.job_image(session=session, image=job["image"])
        fields["job"], fields["job_env_sealed"] = seal_job(job, sealer)
    return fields


def same_bid_or_conflict(existing: BidRow, fields: dict) -> None:
    """A 409 naming ``idempotency_key`` when ``existing`` (the bid the key found) differs
    from the new request's ``fields`` in any term of the bid."""
    terms = ("gpu_model", "region", "gpu_count", "max_price", "capacity", "node_count")
    for name in (*terms, "min_node_count"):
        if getattr(existing, name) != fields[name]:
            raise Conflict(
                f"idempotency_key was used for bid {existing.id} with a different {name}",
                field="idempotency_key",
            )


def get_bid(*, session: Session, tenant_id: int, bid_id: int) -> BidRow:
    bid = session.get(BidRow, bid_id)
    if bid is None or bid.tenant_id != tenant_id:
        raise NotFound(f"bid {bid_id} not found")
    return bid


def list_bids(
    *, session: Session, tenant_id: int, status: str | None, limit: int, before_id: int | None
) -> list[BidRow]:
    """A page of the tenant's bids, newest first: those older than ``before_id`` (the cursor
    a previous page ended at; None for the newest)."""
    query = select(BidRow).where(BidRow.tenant_id == tenant_id)
    if before_id is not None:
        query = query.where(BidRow.id < before_id)
    if status is not None:
        query = query.where(BidRow.status == status)
    return list(session.scalars(query.order_by(BidRow.id.desc()).limit(limit)))


def reprice_bid(
    *, session: Session, bid: BidRow, max_price: float, now: datetime, limits: credit.BidLimits
) -> BidRow:
    """A new maximum price for the bid (every member of its gang); a raise reserves its credit
    first (``service/credit.py``)."""
    if bid.status not in LIVE_BID_STATUSES:
        raise Conflict(f"bid {bid.id} is {bid.status}: it cannot be repriced")
    on_demand = (
        DEFAULT_CATALOG.get(bid.gpu_model).on_demand_price
        if bid.capacity == Capacity.ON_DEMAND
        else None
    )
    if on_demand is not None and max_price > on_demand:
        raise Conflict(
            f"bid {bid.id} buys on-demand capacity at the on-demand price {on_demand}: it cannot "
            "be repriced above it (below it releases the GPUs: the job gets a notice and saves)",
            field="max_price",
        )
    rows = gangs.gang_rows(session=session, bid=bid)
    credit.reserve_for_reprice(
        session=session, bid=bid, rows=rows, max_price=max_price, limits=limits
    )
    for row in rows:  # a gang's members share it
        row.max_price = max_price
        row.updated_at = now
        record_change(
            session=session,
            entity=Entity.BID,
            entity_id=row.id,
            op="reprice",
            data={"max_price": max_price},
        )
    return bid


def cancel_bid(*, session: Session, bid: BidRow, now: datetime) -> BidRow:
    for row in gangs.gang_rows(session=session, bid=bid):  # a gang is cancelled whole
        if row.status in (BidStatus.CANCELLED, BidStatus.FINISHED):
            continue
        cancelled = gate.set_bid_status(
            session=session,
            bid_id=row.id,
            expected=BidStatus(row.status),
            to=BidStatus.CANCELLED,
            whole_gang=False,
            updated_at=now,
        )
        if not cancelled:
            raise Conflict(f"bid {row.id} changed as it was cancelled; cancel it again")
        record_change(
            session=session,
            entity=Entity.BID,
            entity_id=row.id,
            op="cancel",
            data={"at": now.timestamp()},
        )
    return bid


# ---------------------------------------------------------------- allocations


def get_allocation(
    *,
    session: Session,
    allocation_id: int,
    tenant_id: int | None = None,
) -> AllocationRow:
    alloc = session.get(AllocationRow, allocation_id)
    if alloc is None or (tenant_id is not None and alloc.tenant_id != tenant_id):
        raise NotFound(f"allocation {allocation_id} not found")
    return alloc


def list_allocations(
    *,
    session: Session,
    node_id: int | None = None,
    bid_id: int | None = None,
    bid_ids: list[int] | None = None,
    active_only: bool = False,
) -> list[AllocationRow]:
    """A node's or a bid's (or bids': a gang's) allocations, oldest first (a bid has one per
    attempt, a node as many active ones as it has GPUs)."""
    query = select(AllocationRow).order_by(AllocationRow.id)
    if node_id is not None:
        query = query.where(AllocationRow.node_id == node_id)
    if bid_id is not None:
        query = query.where(AllocationRow.bid_id == bid_id)
    if bid_ids is not None:
        query = query.where(AllocationRow.bid_id.in_(bid_ids))
    if active_only:
        query = query.where(AllocationRow.status.in_(ACTIVE))
    return list(session.scalars(query))


def page_allocations(
    *, session: Session, tenant_id: int, active_only: bool, limit: int, before_id: int | None
) -> list[AllocationRow]:
    """A page of the tenant's allocations, newest first, older than ``before_id``."""
    query = select(AllocationRow).where(AllocationRow.tenant_id == tenant_id)
    if before_id is not None:
        query = query.where(AllocationRow.id < before_id)
    if active_only:
        query = query.where(AllocationRow.status.in_(ACTIVE))
    return list(session.scalars(query.order_by(AllocationRow.id.desc()).limit(limit)))


# ---------------------------------------------------------------- events and prices


def events_after(
    *,
    session: Session,
    after: int,
    tenant_id: int | None = None,
    bid_id: int | None = None,
    bid_ids: list[int] | None = None,
    node_id: int | None = None,
    limit: int = 200,
) -> list[EventRow]:
    query = select(EventRow).where(EventRow.id > after).order_by(EventRow.id).limit(limit)
    if tenant_id is not None:
        query = query.where(EventRow.tenant_id == tenant_id)
    if bid_id is not None:
        query = query.where(EventRow.bid_id == bid_id)
    if bid_ids is not None:
        query = query.where(EventRow.bid_id.in_(bid_ids))
    if node_id is not None:
        query = query.where(EventRow.node_id == node_id)
    return list(session.scalars(query))


def price_bars(
    *, session: Session, gpu_model: str, region: str, since_minute: int, until_minute: int
) -> list[PriceBar]:
    return list(
        session.scalars(
            select(PriceBar)
            .where(
                PriceBar.gpu_model == gpu_model,
                PriceBar.region == region,
                PriceBar.minute >= since_minute,
                PriceBar.minute <= until_minute,
            )
            .order_by(PriceBar.minute)
        )
    )
