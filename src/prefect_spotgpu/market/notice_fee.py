"""The notice fee: a bid that causes a notice pays for it (pure;
docs/operators/security.md#no-free-preemption).

A challenger that outbids running allocations reserves their GPUs (a *takeover*) and gives them
a notice. Without a fee, it could go before its takeover starts (a cancel, a hold, a price
lowered below the reserve) or just after (a cancel, a job that ends at once) and pay nothing, or
one tick: the victims were preempted for free. So the rule, as functions of plain data:

- **the fee** of a takeover that noticed someone is what its GPUs would cost for the notice's
  seconds at the highest maximum price among the bids it outbid (the price it would pay in
  their place, with them waiting: the second price), at least its node's reserve, never above
  its own maximum, in whole micros rounded up (:func:`notice_fee`). A takeover that noticed
  nobody (it claimed GPUs someone else's notice frees; a gang survivor's own GPUs) owes none;
- it is **a floor**, whatever order things happen in: every charge of the allocation (while it
  runs, after its takeover started) counts towards it, and what is still owed when the
  allocation ends is charged then (:func:`fee_due`). A takeover that runs longer than the
  notice pays exactly what it ran; one that goes before it starts, or ends soon after, pays
  the fee in all;
- **waived only when the node ends it**: a node lost, drained or reclaimed by its owner (its
  notice reason ``reclaimed``) ends the allocation through no doing of the bid's. Everything
  else is the bid's own or is priced elsewhere — a cancel, a hold for credit, a price lowered
  under the reserve, an expired reservation, a job that ended, a gang member's end; being
  outbid in turn does not waive it (the next challenger pays its own fee).

Why a floor and not a withdrawn notice: the agent gives the noticed job its SIGUSR1 at once and
stops it after the final save, so a notice cannot be taken back; and a fee only for a takeover
that never started would leave "wait for the start, then cancel" free.

    >>> notice_fee(outbid_prices=[1.0, 0.8], reserve=0.9, max_price=2.0, gpus=4,
    ...            notice_seconds=300)  # 4 GPUs x 5 min at 1.00/h
    333334
    >>> notice_fee(outbid_prices=[], reserve=0.9, max_price=2.0, gpus=4, notice_seconds=300)
    0
    >>> fee_due(333_334, EndReason.BID_CANCELLED, None)
    333334
    >>> fee_due(333_334, EndReason.NOTICE_DEADLINE_PASSED, NoticeReason.OUTBID)
    333334
    >>> fee_due(333_334, EndReason.NODE_RECLAIMED, None)
    0
    >>> fee_due(333_334, EndReason.ENDED_PREEMPTED, NoticeReason.RECLAIMED)
    0
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect_spotgpu.market.money import charge
from prefect_spotgpu.market.types import EndReason, NoticeReason

WAIVED_BY = frozenset({EndReason.NODE_LOST, EndReason.NODE_DRAINING, EndReason.NODE_RECLAIMED})
"""Endings of the allocation's own node, which its bid did not cause: they waive the fee."""


def notice_fee(
    *,
    outbid_prices: Sequence[float],
    reserve: float,
    max_price: float,
    gpus: int,
    notice_seconds: float,
) -> int:
    """Micros a takeover that outbid bids at ``outbid_prices`` (their maximums) owes at least:
    ``gpus`` GPUs for ``notice_seconds`` at the highest of them, at least ``reserve``, at most
    ``max_price``, rounded up to a whole micro; 0 when it outbid nobody."""
    if not outbid_prices:
        return 0
    price = min(max(max(outbid_prices), reserve), max_price)
    amount, left = charge(price=price, gpus=gpus, milliseconds=round(notice_seconds * 1000))
    return amount + (left > 0)


def fee_due(owed: int, reason: EndReason, noticed_for: NoticeReason | None) -> int:
    """What is charged when an allocation that still owes ``owed`` micros of its notice fee
    ends for ``reason`` (``noticed_for``: its own notice's reason, if it was noticed)."""
    if reason in WAIVED_BY or noticed_for is NoticeReason.RECLAIMED:
        return 0
    return max(0, int(owed))
