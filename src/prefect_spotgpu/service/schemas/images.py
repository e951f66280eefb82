"""Images: the operator's catalogue of named environments (``GET /images``; its entries are
shared with the clients: ``prefect_spotgpu.messages``), and the image fields of jobs and
heartbeats."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from prefect_spotgpu.messages import ImageResponse as ImageResponse
from prefect_spotgpu.protocol import (
    IMAGE_NAME_PATTERN,
    IMAGE_REFERENCE_PATTERN,
    MAX_IMAGE_REFERENCE_CHARS,
    PROCESS_IMAGE,
)
from prefect_spotgpu.service.schemas.fields import Strict

ImageName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=63,
        pattern=IMAGE_NAME_PATTERN,
        description="A catalogue name: lower case letters, digits, '.', '_' and '-'.",
        examples=["pytorch"],
    ),
]
ImageReference = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_IMAGE_REFERENCE_CHARS,
        pattern=IMAGE_REFERENCE_PATTERN,
        description="A container image reference: [registry[:port]/]repo/name[:tag][@digest].",
        examples=["pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"],
    ),
]
PlainLine = Annotated[str, Field(pattern=r"^[^\x00-\x1f\x7f-\x9f]*$")]
"""One line of plain text: no control characters (it is shown on the dashboard and in logs)."""


Framework = Annotated[PlainLine, Field(min_length=1, max_length=100, examples=["PyTorch 2.5.1"])]
CudaVersion = Annotated[
    str, Field(pattern=r"^[0-9]+(\.[0-9]+){0,2}$", max_length=20, examples=["12.4"])
]
Description = Annotated[PlainLine, Field(max_length=500)]


class ImageUpdate(Strict):
    """A catalogue entry under its name (``PUT /images/{name}`` creates or replaces it)."""

    reference: ImageReference
    framework: Framework
    cuda_version: CudaVersion | None = Field(
        None, description="The CUDA version the image is built on."
    )
    description: Description = ""
    runs_flows: bool = Field(
        False,
        description="The image holds prefect-spotgpu (spotgpu admin image build makes one from "
        "a base), so a flow run may pick it. False: it runs only a job's own command.",
    )


class ImageCreate(ImageUpdate):
    """A new catalogue entry (``POST /images``: 409 if the name is taken)."""

    name: ImageName

    @field_validator("name")
    @classmethod
    def _not_process(cls, name: str) -> str:
        if name == PROCESS_IMAGE:
            raise ValueError(f"{PROCESS_IMAGE!r} means no container, not an image")
        return name


def image_response(row) -> ImageResponse:
    """An image row as its ``ImageResponse``."""
    return ImageResponse.model_validate(row, from_attributes=True)
