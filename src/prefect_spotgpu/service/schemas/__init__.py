"""Request and response bodies, one module per resource. Validation here reuses the market's own
checks, so a bad field is a 422 that names it (never a 500, never a partial write).

Request bodies derive from ``fields.Strict`` (unknown fields refused); responses are plain
``BaseModel``s built from rows (``bid_response``, ``node_response``, ...). Every name is
importable from ``prefect_spotgpu.service.schemas`` itself.
"""

from prefect_spotgpu.service.schemas.allocations import (
    AllocationReport,
    AllocationResponse,
    Assignment,
    allocation_response,
)
from prefect_spotgpu.service.schemas.bids import (
    MAX_JOB_ENV_BYTES,
    BidBatchCreate,
    BidBatchResponse,
    BidCreate,
    BidResponse,
    BidUpdate,
    EventResponse,
    EventsPage,
    JobSpec,
    LabelKey,
    LabelValue,
    bid_response,
)
from prefect_spotgpu.service.schemas.fields import (
    CapacityKind,
    GpuCount,
    GpuModelName,
    Name,
    NodeRegion,
    Price,
    Region,
    Strict,
)
from prefect_spotgpu.service.schemas.images import (
    ImageCreate,
    ImageName,
    ImageReference,
    ImageResponse,
    ImageUpdate,
    image_response,
)
from prefect_spotgpu.service.schemas.ledger import (
    AllocationCharge,
    CreditCreate,
    LedgerCursors,
    LedgerEntryResponse,
    LedgerResponse,
)
from prefect_spotgpu.service.schemas.nodes import (
    Heartbeat,
    NodeCreate,
    NodeCreated,
    NodeDrain,
    NodeResponse,
    NodeToken,
    NodeUpdate,
    node_response,
)
from prefect_spotgpu.service.schemas.prices import (
    EstimateRequest,
    EstimateResponse,
    PriceBarResponse,
    QuoteResponse,
)
from prefect_spotgpu.service.schemas.tenants import (
    KeyIssued,
    KeysRevoked,
    ProviderUpdate,
    TenantCreate,
    TenantCreated,
    TenantResponse,
    tenant_response,
)
from prefect_spotgpu.service.schemas.webhook import (
    DeliveryResponse,
    WebhookConfig,
    WebhookConfigResponse,
)

__all__ = [
    "MAX_JOB_ENV_BYTES",
    "AllocationCharge",
    "AllocationReport",
    "AllocationResponse",
    "Assignment",
    "BidBatchCreate",
    "BidBatchResponse",
    "BidCreate",
    "BidResponse",
    "BidUpdate",
    "CapacityKind",
    "CreditCreate",
    "DeliveryResponse",
    "EstimateRequest",
    "EstimateResponse",
    "EventResponse",
    "EventsPage",
    "GpuCount",
    "GpuModelName",
    "Heartbeat",
    "ImageCreate",
    "ImageName",
    "ImageReference",
    "ImageResponse",
    "ImageUpdate",
    "JobSpec",
    "KeyIssued",
    "KeysRevoked",
    "LabelKey",
    "LabelValue",
    "LedgerCursors",
    "LedgerEntryResponse",
    "LedgerResponse",
    "Name",
    "NodeCreate",
    "NodeCreated",
    "NodeDrain",
    "NodeRegion",
    "NodeResponse",
    "NodeToken",
    "NodeUpdate",
    "Price",
    "PriceBarResponse",
    "ProviderUpdate",
    "QuoteResponse",
    "Region",
    "Strict",
    "TenantCreate",
    "TenantCreated",
    "TenantResponse",
    "WebhookConfig",
    "WebhookConfigResponse",
    "allocation_response",
    "bid_response",
    "image_response",
    "node_response",
    "tenant_response",
]
