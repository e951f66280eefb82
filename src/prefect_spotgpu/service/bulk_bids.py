"""Many bids in one request (``POST /bids/batch``): all of them or none.

A fan-out places hundreds of bids at once; one request each would spend most of its time on
HTTP and transactions. A batch is one transaction that writes every bid or nothing:

- every item is checked as a single bid would be (its schema, its job's image, a gang's fit);
  the first item that fails refuses the whole batch, with its index in the error's field
  (``bids[3].job.image``) and message;
- idempotency keys work per item: an item whose key found an earlier bid returns that bid (a
  409 when its terms differ), so a retried batch, whole or partly applied by an earlier try,
  writes only what is missing; two items of one batch may not share a key;
- the new bids reserve their credit together (``credit.reserve_for_bids``): the balance must
  cover all of them beside the tenant's open bids, under the tenant's row lock, so parallel
  batches cannot overspend it, and the cap on open bids counts every new row.

The tenant's row is locked before the keys are looked up, so a concurrent request with the
same keys waits and then finds the bids this one wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from prefect_spotgpu.protocol import BidStatus
from prefect_spotgpu.service import credit, gangs, schemas
from prefect_spotgpu.service.crud import bid_fields, same_bid_or_conflict
from prefect_spotgpu.service.errors import Conflict, Invalid, ServiceError
from prefect_spotgpu.service.models import BidRow
from prefect_spotgpu.service.outbox import Entity, record_change
from prefect_spotgpu.service.sealing import Sealer


def create_bids(
    *,
    session: Session,
    tenant_id: int,
    items: list[schemas.BidCreate],
    now: datetime,
    sealer: Sealer,
    limits: credit.BidLimits,
) -> list[tuple[BidRow, bool]]:
    """Each item's bid, in order, and whether it was created now (False: its idempotency key
    found it); or raise for the whole batch (module doc). Never commits."""
    _keys_are_distinct(items)
    credit.lock_tenant(session=session, tenant_id=tenant_id)
    existing = _bids_by_key(session, tenant_id, [d.idempotency_key for d in items])
    fields: list[dict] = []
    for index, data in enumerate(items):
        with _item(index):
            fields.append(bid_fields(session=session, data=data, sealer=sealer))
            found = existing.get(data.idempotency_key)
            if found is not None:
                same_bid_or_conflict(found, fields[-1])
            elif data.node_count > 1:
                gangs.check_gang_fits(session=session, data=data)
    new = [i for i, data in enumerate(items) if data.idempotency_key not in existing]
    if new:
        credit.reserve_for_bids(
            session=session, tenant_id=tenant_id, items=[items[i] for i in new], limits=limits
        )
    rows = {
        i: BidRow(
            tenant_id=tenant_id,
            idempotency_key=items[i].idempotency_key,
            status=BidStatus.OPEN.value,
            hold_reason=None,
            created_at=now,
            updated_at=now,
            **fields[i],
        )
        for i in new
    }
    try:
        with session.begin_nested():
            session.add_all(rows.values())
            session.flush()
    except IntegrityError:  # only a writer that skipped the tenant's lock can get here
        raise Conflict(
            "a concurrent request placed bids with some of these idempotency keys: send the "
            "batch again (it is idempotent)",
            field="bids",
        ) from None
    for row in rows.values():
        record_change(session=session, entity=Entity.BID, entity_id=row.id, op="create")
        if row.node_count > 1:  # a gang: its other members, after rank 0 (module gangs)
            gangs.add_members(session=session, first=row)
    return [
        (rows[i], True) if i in rows else (existing[data.idempotency_key], False)
        for i, data in enumerate(items)
    ]


def _keys_are_distinct(items: list[schemas.BidCreate]) -> None:
    first: dict[str, int] = {}
    for index, data in enumerate(items):
        key = data.idempotency_key
        if key is None:
            continue
        if key in first:
            raise Invalid(
                f"bids[{index}]: idempotency_key repeats bids[{first[key]}]'s: each bid of "
                "a batch needs its own key",
                field=f"bids[{index}].idempotency_key",
                item=index,
            )
        first[key] = index


def _bids_by_key(session: Session, tenant_id: int, keys: list[str | None]) -> dict[str, BidRow]:
    wanted = [k for k in keys if k is not None]
    if not wanted:
        return {}
    rows = session.scalars(
        select(BidRow).where(BidRow.tenant_id == tenant_id, BidRow.idempotency_key.in_(wanted))
    )
    return {row.idempotency_key: row for row in rows}


@contextmanager
def _item(index: int) -> Iterator[None]:
    """Name the batch item in any error its checks raise."""
    try:
        yield
    except ServiceError as exc:
        exc.field = f"bids[{index}].{exc.field}" if exc.field else f"bids[{index}]"
        exc.message = f"bids[{index}]: {exc.message}"
        exc.item = index
        exc.args = (exc.message,)
        raise
