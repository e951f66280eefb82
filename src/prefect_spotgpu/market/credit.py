"""Credit is reserved, not chased (docs/operators/architecture.md#design-7): the rules, as
functions of plain data (pure).

A bid's *exposure* is what it may cost before the market can stop it: its maximum price x its
GPUs (every member's, for a gang) x a horizon, in whole micros rounded up. Two horizons:

- **admission** (``credit_horizon_seconds``, set by the operator: the notice plus a few
  ticks): a new bid is accepted only when the tenant's balance covers the exposure of every
  bid it has open *and* of the new one (:func:`admission_refusal`); the check and the insert
  are one transaction under the tenant's row lock, so parallel bids cannot overspend it;
- **holding** (the notice plus two ticks, shorter than admission's, so a bid just admitted is
  not held at once): at every tick, a tenant whose available balance (credits less charges,
  written or not) no longer covers its bids' exposures has bids held (:func:`credit_holds`).
  Waiting bids go first, newest first; when the balance no longer covers even the bids that
  hold GPUs, every bid is held and the running ones get a notice (``out_of_credit``): they
  save, and pay for that notice out of the credit that was kept for it.

So no balance falls below minus about one tick's charges: a notice costs at most its bid's
maximum for the notice's seconds, which the holding horizon kept.

    >>> exposure_micros(max_price=1.2, gpus=8, seconds=300)  # 8 GPUs at 1.20/h for 5 min
    800000
    >>> print(admission_refusal(balance=10_000, reserved=0, needed=800_000)[:59])
    balance 0.010000 does not cover this bid: it needs 0.800000
    >>> admission_refusal(balance=2_000_000, reserved=800_000, needed=800_000) is None
    True
    >>> bids = [BidExposure(1, 600_000, running=True), BidExposure(2, 600_000, running=False)]
    >>> credit_holds(available=1_000_000, bids=bids)  # the running one stays covered
    CreditHolds(held=(2,), notice_running=False)
    >>> credit_holds(available=500_000, bids=bids)  # not even that: all held, noticed
    CreditHolds(held=(1, 2), notice_running=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefect_spotgpu.market.money import MICROS, MS_PER_HOUR


def exposure_micros(*, max_price: float, gpus: int, seconds: float) -> int:
    """What ``gpus`` GPUs at ``max_price`` per GPU-hour cost for ``seconds``, in whole micros
    rounded up (a reservation never covers less than the charge it stands for)."""
    owed = round(max_price * MICROS) * int(gpus) * max(0, round(seconds * 1000))
    return -(-owed // MS_PER_HOUR)


def admission_refusal(
    *, balance: int, reserved: int, needed: int, what: str = "this bid"
) -> str | None:
    """Why a new bid (or a raise of one: ``what``) needing ``needed`` micros reserved is
    refused, or None to accept it: ``balance`` micros must cover it beside the ``reserved``
    micros of the tenant's open bids."""
    if balance >= reserved + needed:
        return None
    others = f", beside {reserved / MICROS:.6f} reserved by your open bids" if reserved else ""
    return (
        f"balance {balance / MICROS:.6f} does not cover {what}: it needs "
        f"{needed / MICROS:.6f} reserved (its maximum price x GPUs x the notice and a few "
        f"ticks){others}"
    )


@dataclass(frozen=True, slots=True)
class BidExposure:
    """One of a tenant's open bids (a gang as one: its first member's id, every member's
    GPUs): its exposure over the holding horizon, and whether it holds GPUs now."""

    bid_id: int
    micros: int
    running: bool


@dataclass(frozen=True, slots=True)
class CreditHolds:
    """The bids to hold, and whether the running ones among them get a notice."""

    held: tuple[int, ...]
    notice_running: bool


def credit_holds(*, available: int, bids: Sequence[BidExposure]) -> CreditHolds:
    """Which of a tenant's open bids ``available`` micros no longer cover (module doc)."""
    running = sum(b.micros for b in bids if b.running)
    if available <= running:
        return CreditHolds(tuple(sorted(b.bid_id for b in bids)), notice_running=True)
    spare = available - running
    held = []
    for b in sorted((b for b in bids if not b.running), key=lambda b: b.bid_id):
        if b.micros < spare:  # the oldest waiting bids keep their turn while they fit
            spare -= b.micros
        else:
            held.append(b.bid_id)
            spare = 0  # a newer bid never jumps an older one that did not fit
    return CreditHolds(tuple(held), notice_running=False)
