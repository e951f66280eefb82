"""Money is exact: integer micro-units (1 unit = 1 000 000 micros) everywhere it is stored or
added up: balances, credits, charges, compensation. Prices stay rates per GPU-hour, given with
at most six decimals, so every price is a whole number of micros per GPU-hour.

A charge is ``price (micros per GPU-hour) x GPUs x milliseconds / 3 600 000``, in whole
micros; what is left below one micro (the ``carry``, in micro-milliseconds per hour) is
carried into the allocation's next charge, so per-second billing never rounds a tenant's
total away; an allocation's last charge rounds what is left up to one micro. An allocation's
charges add up to the exact integral of its price over its whole milliseconds, rounded up to
a whole micro.

    >>> to_micros(1.2), to_micros(0.000_001), from_micros(1_234_567)
    (1200000, 1, 1.234567)
    >>> amount, carry = charge(price=0.9, gpus=1, milliseconds=1000)  # one second of 0.90/h
    >>> amount, carry
    (250, 0)
    >>> charge(price=0.3, gpus=1, milliseconds=1000)  # 83.33 micros: 83, a third carried
    (83, 1200000)
    >>> total, carry = 0, 0
    >>> for _ in range(3):  # three seconds: 250 micros exactly, nothing rounded away
    ...     amount, carry = charge(price=0.3, gpus=1, milliseconds=1000, carry=carry)
    ...     total += amount
    >>> total, carry
    (250, 0)
"""

from __future__ import annotations

import math

import numpy as np

MICROS = 1_000_000
"""Micro-units in one unit of money."""
MS_PER_HOUR = 3_600_000
_EXACT_IN_INT64_MS = (2**63 - 1 - MS_PER_HOUR) // (1000 * MICROS * 16)
"""Below this many milliseconds (6.6 days) the charge of the highest price (1000 per GPU-hour)
on 16 GPUs fits in int64; longer gaps (a leader down for a week) are computed in Python ints."""


def to_micros(amount: float) -> int:
    """An amount (or a price per GPU-hour) in whole micros, rounded to the nearest."""
    if not math.isfinite(amount):
        raise ValueError(f"not a finite amount: {amount!r}")
    return round(amount * MICROS)


def from_micros(micros: int | np.integer) -> float:
    """Micros as units, for display and JSON (exact to six decimals)."""
    return round(int(micros) / MICROS, 6)


def price_micros(prices: np.ndarray) -> np.ndarray:
    """Prices per GPU-hour (floats with at most six decimals) as whole micros per GPU-hour."""
    return np.rint(np.asarray(prices, np.float64) * MICROS).astype(np.int64)


def elapsed_ms(start: np.ndarray | float, end: float) -> np.ndarray:
    """Whole milliseconds from ``start`` to ``end`` (UNIX seconds), never negative."""
    return np.maximum(0, np.floor((end - np.asarray(start, np.float64)) * 1000)).astype(np.int64)


def charges(
    price: np.ndarray, gpus: np.ndarray, milliseconds: np.ndarray, carry: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Whole micros owed for ``milliseconds`` at ``price`` per GPU-hour on ``gpus`` GPUs, and
    the new carry (below one micro, in micro-ms per hour); vectorised over allocations."""
    ms = np.asarray(milliseconds, np.int64)
    dtype = np.int64 if not len(ms) or ms.max() < _EXACT_IN_INT64_MS else object
    owed = price_micros(price).astype(dtype) * np.asarray(gpus, np.int64).astype(dtype) * ms.astype(
        dtype
    ) + np.asarray(carry, np.int64).astype(dtype)
    if dtype is object:  # (np.divmod takes no objects)
        return (owed // MS_PER_HOUR).astype(np.int64), (owed % MS_PER_HOUR).astype(np.int64)
    return np.divmod(owed, MS_PER_HOUR)


def charge(*, price: float, gpus: int, milliseconds: int, carry: int = 0) -> tuple[int, int]:
    """:func:`charges` of one allocation."""
    amount, left = charges(
        np.array([price]), np.array([gpus]), np.array([milliseconds]), np.array([carry])
    )
    return int(amount[0]), int(left[0])
