"""What the trainer integrations (``huggingface``, ``lightning``) share: the run's checkpointer,
the period, storing the framework's own checkpoint (``directory``) and the notice's end.

The framework writes its checkpoint (every rank takes part, one writes); the process that
wrote it stores it through a ``Checkpointer`` (:meth:`FrameworkSaves.store`); every process
learns whether that worked (one collective the caller gives); after a notice, each process
acknowledges to its own node's agent and waits to be stopped. A periodic save that failed is
logged and training goes on (the next one retries); a final one that failed is acknowledged
as failed ("storage") and raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from prefect_spotgpu.checkpoint.checkpointer import Checkpointer, SaveResult
from prefect_spotgpu.checkpoint.directory import directory_state, write_directory
from prefect_spotgpu.checkpoint.flow import storage_and_key, wait_to_be_stopped

logger = logging.getLogger("prefect_spotgpu.checkpoint")


class FrameworkSaves:
    """A framework's checkpoints in the run's storage. ``storage`` and ``key``: as
    ``checkpointer_for_run``; ``every``: seconds (or a ``timedelta``) between periodic saves;
    ``stop``: wait to be stopped after the final save; ``options``: the ``Checkpointer``'s."""

    def __init__(self, storage, key, every: timedelta | float, stop: bool, options: dict):
        storage, key = storage_and_key(storage, key)
        self.every = every.total_seconds() if isinstance(every, timedelta) else float(every)
        self.checkpointer = Checkpointer(storage, key, every=self.every, background=False,
                                         **options)  # fmt: skip
        self.stop = stop
        self.last = time.monotonic()

    @property
    def notice_received(self) -> bool:
        """Whether the final save is done and acknowledged."""
        return self.checkpointer.notice_received

    def restore_into(self, where: Callable[[int], Path]) -> int | None:
        """Write the newest verified checkpoint's files under ``where(its step)``: its step,
        or None when there is none."""
        restored = self.checkpointer.restore()
        if restored is None:
            return None
        write_directory(restored.state, where(restored.step))
        logger.info("resuming %s from its checkpoint of step %s", self.checkpointer.key,
                    restored.step)  # fmt: skip
        return restored.step

    def due(self) -> bool:
        """Whether a periodic save is due (on this process's clock)."""
        return time.monotonic() - self.last >= self.every

    def store(
        self, folder: Path | None, step: int, *, final: bool, anywhere: Callable[[bool], bool]
    ) -> None:
        """Store the checkpoint the framework wrote in ``folder`` (given on the process that
        wrote it, None on the others); ``anywhere(flag)``: whether ``flag`` is set on any
        process (a collective: every process calls this)."""
        self.last = time.monotonic()
        result, failed = None, None
        if folder is not None:
            try:
                result = self.checkpointer.save(directory_state(folder), step, final=final)
            except Exception as exc:
                failed = exc
        if anywhere(failed is not None):
            failed = failed or RuntimeError(f"the checkpoint of step {step} failed elsewhere")
            if not final:  # a periodic save: training goes on, the next one retries
                logger.error("checkpoint of step %s failed: %s", step, failed)
                return
            self.checkpointer.notice_received = True
            self.checkpointer.acknowledge_failure(failed)
            raise failed
        if final:  # durable: each process tells its node's agent, then waits to be stopped
            self.checkpointer.read_deadline()
            self.checkpointer.acknowledge(result or SaveResult(step, 0, 0.0, True))
            self.checkpointer.notice_received = True
            if self.stop:
                wait_to_be_stopped(self.checkpointer)
