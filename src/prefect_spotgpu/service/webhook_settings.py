"""A tenant's webhook as data: where it goes (public destinations only, unless the operator
allows private ones), its signing secret (sealed at rest, ``service/sealing.py``) and its
deliveries. Data functions ``verb_noun(*, session, ...)`` that never commit; the routes call
them as ``crud.<name>``. The one writer of ``tenants.webhook_url`` and ``webhook_secret``.
"""

from __future__ import annotations

import httpcore
from sqlalchemy import select
from sqlalchemy.orm import Session

from prefect_spotgpu.service import webhooks
from prefect_spotgpu.service.errors import Invalid
from prefect_spotgpu.service.models import Tenant, WebhookDelivery
from prefect_spotgpu.service.sealing import Sealer, seal_secret


def set_webhook(
    *,
    session: Session,
    tenant: Tenant,
    url: str | None,
    secret: str | None,
    sealer: Sealer,
    allow_private: bool = False,
) -> Tenant:
    """Set a tenant's webhook. The URL must resolve to public addresses only, unless
    ``allow_private`` (the ``webhook_allow_private`` setting); every delivery checks again.
    The secret is kept sealed (``sealing.seal_secret``), never in the clear."""
    if url is not None and not (secret or tenant.webhook_secret):
        raise Invalid("a webhook needs a secret to sign its deliveries", field="secret")
    if url is not None:
        check_webhook_destination(url=url, allow_private=allow_private)
    tenant.webhook_url = url
    if secret is not None:
        tenant.webhook_secret = seal_secret(secret, sealer)
    return tenant


def list_deliveries(*, session: Session, tenant_id: int, limit: int = 200) -> list[WebhookDelivery]:
    return list(
        session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.tenant_id == tenant_id)
            .order_by(WebhookDelivery.id.desc())
            .limit(limit)
        )
    )


# ---------------------------------------------------------------- webhook helpers


def check_webhook_destination(*, url: str, allow_private: bool) -> None:
    """A 422 naming ``url`` unless it resolves to public addresses only (or ``allow_private``)."""
    try:
        webhooks.check_destination(url, allow_private=allow_private)
    except webhooks.DestinationRefused as exc:
        raise Invalid(f"webhook destinations must be public: {exc.reason}", field="url") from None
    except httpcore.TimeoutException:
        raise Invalid("the webhook's host did not resolve in time", field="url") from None
    except httpcore.ConnectError:
        raise Invalid("the webhook's host does not resolve", field="url") from None
