"""The image catalogue: anyone reads it; only the operator changes it (``service/images.py``).
Who may call each route is in ``roles.ROUTE_ROLES``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from prefect_spotgpu.protocol import IMAGE_NAME_PATTERN
from prefect_spotgpu.service import images, schemas
from prefect_spotgpu.service.deps import Db
from prefect_spotgpu.service.routes.params import API, now

router = APIRouter(prefix=API, tags=["images"])

NamePath = Annotated[
    str, Path(max_length=63, pattern=IMAGE_NAME_PATTERN, description="A catalogue name.")
]


@router.get(
    "/images",
    response_model=list[schemas.ImageResponse],
    summary="The image catalogue: the named environments a job may run in",
)
def list_images(db: Db):
    with db.begin() as session:
        return [schemas.image_response(r) for r in images.list_images(session=session)]


@router.post(
    "/images",
    status_code=201,
    response_model=schemas.ImageResponse,
    summary="Add an image to the catalogue (the operator)",
)
def add_image(data: schemas.ImageCreate, db: Db):
    with db.begin() as session:
        return schemas.image_response(images.add_image(session=session, data=data, now=now()))


@router.put(
    "/images/{name}",
    response_model=schemas.ImageResponse,
    summary="Add or replace a catalogue image (the operator); 201 when added",
)
def put_image(name: NamePath, data: schemas.ImageUpdate, db: Db, response: Response):
    with db.begin() as session:
        row, created = images.put_image(session=session, name=name, data=data, now=now())
        if created:
            response.status_code = 201
        return schemas.image_response(row)


@router.delete(
    "/images/{name}",
    status_code=204,
    summary="Remove an image from the catalogue (the operator); placed bids keep theirs",
)
def remove_image(name: NamePath, db: Db):
    with db.begin() as session:
        images.remove_image(session=session, name=name)
    return Response(status_code=204)
