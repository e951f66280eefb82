"""Tenants and their keys: who buys (and, once the operator allows it, sells) on the market (the
replies are shared with the clients: ``prefect_spotgpu.messages``)."""

from __future__ import annotations

from pydantic import Field

from prefect_spotgpu.messages import KeyIssued as KeyIssued
from prefect_spotgpu.messages import KeysRevoked as KeysRevoked
from prefect_spotgpu.messages import TenantCreated as TenantCreated
from prefect_spotgpu.messages import TenantResponse as TenantResponse
from prefect_spotgpu.service.schemas.fields import Name, Strict


class TenantCreate(Strict):
    name: Name
    starting_credit: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, strict=True)


def tenant_response(tenant) -> dict:
    """A tenant row as ``TenantResponse``'s fields (its balance computed)."""
    return {
        "id": tenant.id,
        "name": tenant.name,
        "balance": tenant.balance,
        "provider": tenant.provider,
        "created_at": tenant.created_at,
    }


class ProviderUpdate(Strict):
    provider: bool = Field(description="true: the tenant may register nodes; false: no more.")
