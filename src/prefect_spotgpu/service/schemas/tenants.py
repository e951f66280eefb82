"""Tenants and their keys: who buys (and, once the operator allows it, sells) on the market."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from prefect_spotgpu.service.schemas.fields import Name, Strict


class TenantCreate(Strict):
    name: Name
    starting_credit: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, strict=True)


class TenantResponse(BaseModel):
    id: int
    name: str
    balance: float
    provider: bool = Field(False, description="Whether the operator lets it register nodes.")
    created_at: datetime


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


class KeyIssued(BaseModel):
    api_key: str = Field(description="Shown once; store it. Every older key is revoked.")


class KeysRevoked(BaseModel):
    revoked: int = Field(description="How many live keys were revoked.")


class TenantCreated(TenantResponse):
    api_key: str = Field(description="Shown once; store it.")
