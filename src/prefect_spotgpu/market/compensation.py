"""Compensation: what the market credits a tenant whose work a reclaim destroyed (pure).

The rule (docs/operators/architecture.md#design-1 and #design-7), as a function of plain data:

- only a loss the **platform** caused is compensated: a node lost without notice, or a final
  save that failed for a reason the job reports as the storage's, under a notice the node's
  owner caused by reclaiming it. A job that crashed, ignored its notice or ran past the
  deadline is its own loss; so is a failed save under any other notice (outbid, below reserve,
  window closing), because the tenant can cause those itself — a second, higher bid of its
  own, a lowered price, a window — and the job writes its own storage report;
- the amount is what the tenant **actually paid** for that allocation since its last durable
  checkpoint (``paid_total - paid_at_checkpoint``), never more — so no price move, reserve
  change or missing checkpoint report can turn a reclaim into a profit;
- never for a bid on a node the tenant owns (a provider cannot reclaim its own node to be paid
  back what it paid itself);
- once per allocation.

Amounts are whole micros (:mod:`prefect_spotgpu.market.money`). Example: an allocation that
paid 0.50 in all, 0.25 of it before its last checkpoint, on a node lost without notice, is
credited 0.25; the same loss on the tenant's own node, or after the job crashed, is credited
nothing::

    >>> lost = Loss(LossCause.NODE_LOST, paid_total=500_000, paid_at_checkpoint=250_000)
    >>> compensation(lost).amount
    250000
    >>> compensation(lost).reason
    'node lost without notice: 0.250000 paid since the last durable checkpoint'
    >>> compensation(Loss(LossCause.NODE_LOST, paid_total=500_000, own_node=True)) is None
    True
    >>> compensation(Loss(LossCause.JOB, paid_total=500_000)) is None
    True
    >>> compensation(Loss(LossCause.DEADLINE, paid_total=500_000, reclaimed=True)) is None
    True

A failed save in storage is compensated under an owner's reclaim only::

    >>> compensation(Loss(LossCause.STORAGE, paid_total=500_000, reclaimed=True)).amount
    500000
    >>> compensation(Loss(LossCause.STORAGE, paid_total=500_000, reclaimed=False)) is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prefect_spotgpu.market.money import MICROS


class LossCause(StrEnum):
    NODE_LOST = "node_lost"  # heartbeats stopped: no notice, no final save (the platform's)
    STORAGE = "storage"  # the final save failed writing to storage (the platform's, if reclaimed)
    JOB = "job"  # the job exited during its notice without saving (the tenant's)
    DEADLINE = "deadline"  # the job was still running, unsaved, at the deadline (the tenant's)

    def platforms_fault(self) -> bool:
        return self in (LossCause.NODE_LOST, LossCause.STORAGE)


REASONS = {
    LossCause.NODE_LOST: "node lost without notice",
    LossCause.STORAGE: "final save failed in storage before the notice deadline",
}


@dataclass(frozen=True, slots=True)
class Loss:
    cause: LossCause
    paid_total: int  # micros the allocation has paid in all, up to its end
    paid_at_checkpoint: int = 0  # micros it had paid at its last durable checkpoint
    own_node: bool = False  # the bid's tenant owns the node
    already_compensated: bool = False
    reclaimed: bool = False  # the notice (if any) was the owner's reclaim


@dataclass(frozen=True, slots=True)
class Compensation:
    amount: int  # micros
    reason: str


def compensation(loss: Loss) -> Compensation | None:
    """The credit this loss earns, or None."""
    if loss.already_compensated or loss.own_node or not loss.cause.platforms_fault():
        return None
    if loss.cause is LossCause.STORAGE and not loss.reclaimed:
        return None  # a notice the tenant may have caused itself
    paid = int(loss.paid_total)
    amount = paid - max(0, min(int(loss.paid_at_checkpoint), paid))
    if amount <= 0:
        return None
    return Compensation(
        amount,
        f"{REASONS[loss.cause]}: {amount / MICROS:.6f} paid since the last durable checkpoint",
    )
