"""A tenant's webhook: where its events are POSTed (the reply is shared with the clients:
``prefect_spotgpu.messages``), and the log of every delivery."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, HttpUrl, UrlConstraints, field_validator

from prefect_spotgpu.messages import WebhookConfigResponse as WebhookConfigResponse
from prefect_spotgpu.service import webhooks
from prefect_spotgpu.service.schemas.fields import Strict


class WebhookConfig(Strict):
    url: Annotated[HttpUrl, UrlConstraints(max_length=2000)] | None = Field(
        description="Where events are POSTed: http(s), to a public address (private, loopback "
        "and link-local destinations are refused unless the operator allows them)."
    )
    secret: str | None = Field(
        None,
        min_length=16,
        max_length=200,
        description="The signing secret: `whsec_` and the base64 of 24 to 64 bytes (Standard "
        'Webhooks), or 16 to 200 characters of anything else, used as `"whsec_" + '
        "base64(secret)`.",
    )

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        return None if value is None else webhooks.check_secret(value)


_OUTCOME = re.compile(r"HTTP \d{3}|refused: [a-z ]+|[A-Za-z]+")


def _outcome(value: str | None) -> str | None:
    """Only a status or an error class: rows written before bodies stopped being stored
    (``HTTP 500: <body>``, ``ConnectError: <message>``) show their first words."""
    if value is None or _OUTCOME.fullmatch(value):
        return value
    match = _OUTCOME.match(value)
    return match.group(0) if match else None


class DeliveryResponse(BaseModel):
    id: int = Field(description="The delivery id, sent as `webhook-id` on every attempt.")
    event_id: int
    url: str
    status: str = Field(description="pending, delivered or failed.")
    attempts: int
    last_status_code: int | None
    last_error: Annotated[str | None, AfterValidator(_outcome)] = Field(
        description="The last failure: `HTTP <code>`, an error class such as `ConnectTimeout`, "
        "or `refused: <reason>`. Never what the destination answered."
    )
    updated_at: datetime
