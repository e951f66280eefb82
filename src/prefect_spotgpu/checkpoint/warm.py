"""Set-up that runs before the go: "build the model now, restore later".

A spot job pays its start-up (imports, building the model, CUDA initialisation) after it
starts on a node. A migration target starts its job at the notice, while the old job still
saves (docs/users/checkpointing.md#warm-replacement), so what the job does before its go is
free. Mark the expensive, state-free part of a flow with ``@warm_up``: the launcher calls
every marked function of the flow's module before it waits for its go, and the flow's own
call then returns what that call built, at once. Restore only after the go (in the flow):
the old job's final save is durable only then.

    @warm_up
    def build_model():
        import torch
        return Model().to("cuda")          # minutes of set-up, done while the old node saves

    @flow
    def pretrain(steps: int):
        model = build_model()              # the one built before the go (or built now)
        ckpt = checkpointer_for_run()
        restored = ckpt.restore()          # after the go: the final save is durable
        ...

A marked function takes no arguments and runs once per process; one that raised before the
go runs again (and raises in the flow, where the error belongs) when the flow calls it.
Invariant: nothing marked may write the run's checkpoints or outputs (it runs before the old
job's final save is durable).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger("prefect_spotgpu.checkpoint")

_MARKED: list[Callable[[], object]] = []


def warm_up(fn: Callable[[], T]) -> Callable[[], T]:
    """Mark ``fn`` as set-up the launcher runs before the go; calls return its first result."""
    done: list = []

    @functools.wraps(fn)
    def once() -> T:
        if not done:
            done.append(fn())
        return done[0]

    _MARKED.append(once)
    return once


def run_warm_ups() -> float:
    """Call every marked function (a failure is logged, and retried by the flow's own call);
    the seconds it took."""
    started = time.perf_counter()
    for fn in list(_MARKED):
        try:
            fn()
        except Exception as exc:
            logger.warning(
                "warm-up %s failed (%s: %s); the flow calls it again", fn, type(exc).__name__, exc
            )
    return time.perf_counter() - started
