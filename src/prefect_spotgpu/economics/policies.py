"""The registry of bidding policies: a name to a pure function of a ``JobView``.

The policies live beside the views they read (``deadline.py``: always-on-demand, greedy-spot,
uniform-progress; ``steering.py``: deadline-aware); this module only names them, so every
module imports alone and none imports another to register itself
(docs/development/code-style.md#style-8).

    >>> get_policy("greedy-spot").__name__
    'greedy_spot'
    >>> sorted(POLICIES)
    ['always-on-demand', 'deadline-aware', 'greedy-spot', 'uniform-progress']
"""

from __future__ import annotations

from prefect_spotgpu.economics.deadline import (
    Policy,
    always_on_demand,
    greedy_spot,
    uniform_progress,
)
from prefect_spotgpu.economics.steering import deadline_aware

POLICIES: dict[str, Policy] = {
    "always-on-demand": always_on_demand,
    "greedy-spot": greedy_spot,
    "uniform-progress": uniform_progress,
    "deadline-aware": deadline_aware,
}
"""Every bidding policy, by the name a job variable or a benchmark gives."""


def get_policy(name: str) -> Policy:
    """The bidding policy called ``name``; unknown names fail listing the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown bidding policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
