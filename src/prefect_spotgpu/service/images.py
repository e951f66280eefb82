"""The operator's image catalogue: named container images tenants choose from.

Only the operator changes it (``POST``/``PUT``/``DELETE /images``, ``spotgpu admin image``);
anyone reads it (``GET /images``). A bid's job may name only a catalogue image, by its name
or its reference (:func:`job_image`, which stores the reference): so a tenant cannot make a
node's Docker engine pull from a registry the operator did not choose (an internal address,
an image that mounts a host path by its entrypoint's expectations). Removing an entry refuses
new bids for it; bids already placed keep the reference they were accepted with.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from prefect_spotgpu.protocol import PROCESS_IMAGE
from prefect_spotgpu.service import schemas
from prefect_spotgpu.service.errors import Conflict, Invalid, NotFound
from prefect_spotgpu.service.models import ImageRow


def list_images(*, session: Session) -> list[ImageRow]:
    return list(session.scalars(select(ImageRow).order_by(ImageRow.name)))


def add_image(*, session: Session, data: schemas.ImageCreate, now: datetime) -> ImageRow:
    """A new entry; 409 naming ``name`` when the name is taken."""
    if session.get(ImageRow, data.name) is not None:
        raise Conflict(
            f"image {data.name!r} is in the catalogue already (replace it with PUT)",
            field="name",
        )
    row = ImageRow(**data.model_dump(), created_at=now, updated_at=now)
    session.add(row)
    session.flush()
    return row


def put_image(
    *, session: Session, name: str, data: schemas.ImageUpdate, now: datetime
) -> tuple[ImageRow, bool]:
    """The entry ``name`` created or replaced; and whether it was created."""
    if name == PROCESS_IMAGE:
        raise Invalid(
            f"{PROCESS_IMAGE!r} means no container; it cannot name an image", field="name"
        )
    row = session.get(ImageRow, name, with_for_update=True)
    if row is None:
        entry = schemas.ImageCreate(name=name, **data.model_dump())
        return add_image(session=session, data=entry, now=now), True
    for key, value in data.model_dump().items():
        setattr(row, key, value)
    row.updated_at = now
    return row, False


def remove_image(*, session: Session, name: str) -> None:
    row = session.get(ImageRow, name, with_for_update=True)
    if row is None:
        raise NotFound(f"image {name!r} is not in the catalogue")
    session.delete(row)


def job_image(*, session: Session, image: str) -> str:
    """The reference a bid's job runs: ``image`` is a catalogue name or reference. Anything
    else is refused (422 naming ``job.image``) with the catalogue's names."""
    row = session.get(ImageRow, image)
    if row is not None:
        return row.reference
    if session.scalar(select(ImageRow.name).where(ImageRow.reference == image).limit(1)):
        return image
    names = ", ".join(r.name for r in list_images(session=session)) or "none"
    raise Invalid(
        f"image {image!r} is not in the market's catalogue (GET /api/v1/images); "
        f"known images: {names}",
        field="job.image",
    )
