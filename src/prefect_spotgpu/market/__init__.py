"""The spot auction, as pure logic: data in, decisions out
(docs/operators/architecture.md#design-3).

Nothing in this package does I/O, reads a clock, or imports a database, web, Prefect or NVML
library (``tests/test_architecture.py`` fails if it does). The service, the agent and the worker
use it; it uses nothing of theirs.
"""

from prefect_spotgpu.market.checks import ANY_REGION, MAX_GPUS_PER_NODE
from prefect_spotgpu.market.decision import (
    Charge,
    Charges,
    Decision,
    Ending,
    Notice,
    NoticeFee,
    Placement,
    PlacementKind,
    Placements,
    PoolQuote,
)
from prefect_spotgpu.market.engine import Market, Settlement, clear
from prefect_spotgpu.market.gpus import (
    DEFAULT_CATALOG,
    GpuCatalog,
    GpuModel,
    normalize_gpu_model,
)
from prefect_spotgpu.market.policies import PACKING_POLICIES, get_packing_policy
from prefect_spotgpu.market.types import (
    Allocation,
    AllocationStatus,
    Bid,
    Capacity,
    EndReason,
    Interval,
    MarketConfig,
    MarketState,
    Node,
    NodeState,
    NoticeReason,
    Runner,
)

__all__ = [
    "ANY_REGION",
    "DEFAULT_CATALOG",
    "MAX_GPUS_PER_NODE",
    "PACKING_POLICIES",
    "Allocation",
    "AllocationStatus",
    "Bid",
    "Capacity",
    "Charge",
    "Charges",
    "Decision",
    "EndReason",
    "Ending",
    "GpuCatalog",
    "GpuModel",
    "Interval",
    "Market",
    "MarketConfig",
    "MarketState",
    "Node",
    "NodeState",
    "Notice",
    "NoticeFee",
    "NoticeReason",
    "Placement",
    "PlacementKind",
    "Placements",
    "PoolQuote",
    "Runner",
    "Settlement",
    "clear",
    "get_packing_policy",
    "normalize_gpu_model",
]
