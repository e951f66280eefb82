"""Checks of the market's plain values (prices, counts, regions, ids, times): each returns the
value or raises a ``ValueError`` naming the field and the value, so the service can turn it into
a 4xx without guessing. ``types.py`` builds its frozen values on them.
"""

from __future__ import annotations

import math
import re

MAX_GPUS_PER_NODE = 16
"""The largest node the market accepts; a bid for more GPUs can never fit on one node."""

MAX_GANG_NODES = 64
"""The most nodes one gang bid may ask for."""

_REGION = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
ANY_REGION = "any"


def check_price(field_name: str, value: object) -> float:
    """A finite, positive price, or ``ValueError`` naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field_name} must be a number, got {value!r}")
    price = float(value)
    if not math.isfinite(price) or price <= 0:
        raise ValueError(f"{field_name} must be a positive finite price, got {value!r}")
    return price


def check_images(value: object) -> frozenset[str]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"images must be a set of non-empty strings, got {value!r}")
    return frozenset(value)


def check_gpu_count(field_name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field_name} must be an integer, got {value!r}")
    if not 1 <= value <= MAX_GPUS_PER_NODE:
        raise ValueError(
            f"{field_name} must be between 1 and {MAX_GPUS_PER_NODE} (GPUs of one node), "
            f"got {value!r}"
        )
    return value


def check_node_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"node_count must be an integer, got {value!r}")
    if not 1 <= value <= MAX_GANG_NODES:
        raise ValueError(f"node_count must be between 1 and {MAX_GANG_NODES}, got {value!r}")
    return value


def check_time(field_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field_name} must be a finite UNIX time in seconds, got {value!r}")
    return float(value)


def check_region(field_name: str, value: object, *, allow_any: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field_name} must be a string, got {value!r}")
    region = value.strip().lower()
    if region == ANY_REGION and allow_any:
        return ANY_REGION
    if not _REGION.match(region) or region == ANY_REGION:
        raise ValueError(
            f"{field_name} must be a region name like 'eu-west' (lowercase letters, digits, '-')"
            + (" or 'any'" if allow_any else "")
            + f", got {value!r}"
        )
    return region


MAX_ID = 2**62
"""Ids are stored as 64-bit integers; anything from here up is refused."""


def check_id(field_name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_ID:
        raise ValueError(f"{field_name} must be an integer in [0, 2**62), got {value!r}")
    return value


def check_min_node_count(value: object, node_count: int) -> int | None:
    """A gang's fewest nodes to go on with (None: all ``node_count``, the default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"min_node_count must be an integer or null, got {value!r}")
    if not 1 <= value <= node_count:
        raise ValueError(
            f"min_node_count must be between 1 and node_count ({node_count}), got {value!r}"
        )
    return value
