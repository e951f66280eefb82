"""Named packing policies: which node a winning bid lands on.

A policy is chosen by name in ``MarketConfig(packing=...)``; an unknown name fails listing the
valid ones. Example, three 8-GPU nodes A, B, C with 8, 3 and 5 GPUs free, a bid for 2 GPUs:

- ``best-fit`` puts it on B (tightest fit, 1 GPU left), keeping A whole for an 8-GPU bid later;
  pools where every bid size divides every node size are packed perfectly (no fragments).
- ``first-fit`` puts it on A (lowest node id that fits): the naive rule, kept for comparison.

Ties break on the lower reserve price, then the lower node id, so packing is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PackingPolicy:
    name: str
    description: str
    perfect_packing: bool
    """Whether pools whose bid sizes divide every node size are packed in bulk, largest first."""


PACKING_POLICIES: dict[str, PackingPolicy] = {
    p.name: p
    for p in (
        PackingPolicy(
            "best-fit", "tightest node that fits; perfect packing when sizes divide", True
        ),
        PackingPolicy("first-fit", "lowest node id that fits (naive baseline)", False),
    )
}


def get_packing_policy(name: str) -> PackingPolicy:
    try:
        return PACKING_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"packing policy {name!r} is not known; valid policies: "
            f"{', '.join(sorted(PACKING_POLICIES))}"
        ) from None
