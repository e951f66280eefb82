"""Hugging Face ``Trainer`` on spot GPUs: a notice is a save-then-stop into the run's storage,
and the next attempt resumes from it (docs/users/checkpointing.md#hugging-face-trainer).

Add the callback, and resume from what it found::

    spot = SpotTrainerCallback()                      # the run's storage and key
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[spot])
    trainer.train(resume_from_checkpoint=spot.resume_from)   # None on the first attempt

``resume_from`` is the one line more than adding the callback: ``Trainer.train`` loads a
checkpoint before any callback runs, so no callback can choose it. Everything else is the
Trainer's own: its checkpoint directory (weights, optimizer, scheduler, each process's RNG
state, the trainer state that makes it skip the batches already seen), so a resumed run's
losses are the uninterrupted run's.

- At construction the newest verified checkpoint is fetched from the storage into a local
  directory (``resume_from``: its ``checkpoint-<step>``; None when there is none).
- At each step's end: a notice (SIGUSR1 or the notice file, on any process) makes the Trainer
  save now and stop; every ``every`` seconds it saves (``save_strategy`` may stay ``"no"``).
- Each save the Trainer makes is stored when it is written (``on_save``): the whole
  ``checkpoint-<step>`` directory, one checkpoint of this project's storage. After the final
  one is durable the job acknowledges the notice and waits to be stopped: nothing after
  ``trainer.train()`` runs on a noticed attempt (it would run on a partial model).
"""

from __future__ import annotations

import logging
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from transformers import TrainerCallback

from prefect_spotgpu.checkpoint.checkpointer import Checkpointer, SaveResult
from prefect_spotgpu.checkpoint.directory import directory_state, write_directory
from prefect_spotgpu.checkpoint.flow import storage_and_key, wait_to_be_stopped

logger = logging.getLogger("prefect_spotgpu.checkpoint")

PREFIX = "checkpoint"
"""The Trainer's name for its checkpoint directories: ``checkpoint-<global step>``."""


class SpotTrainerCallback(TrainerCallback):
    """Save-then-stop on a notice, periodic saves, and the resume, for a ``Trainer``.

    ``storage`` and ``key``: as ``checkpointer_for_run`` (default: ``SPOTGPU_CHECKPOINT_URL``
    and the flow run). ``every``: seconds (or a ``timedelta``) between periodic saves.
    ``local_dir``: where checkpoints are fetched to (default: a new temporary directory).
    ``stop``: wait to be stopped after the final save (the default; False in a script that
    handles ``notice_received`` itself). Other keyword arguments go to the ``Checkpointer``
    (``keep``, ``signing_key``, ``notice_file``, ...)."""

    def __init__(
        self,
        storage=None,
        *,
        key: str | None = None,
        every: timedelta | float = timedelta(minutes=15),
        local_dir: str | Path | None = None,
        stop: bool = True,
        **options,
    ) -> None:
        storage, key = storage_and_key(storage, key)
        seconds = every.total_seconds() if isinstance(every, timedelta) else float(every)
        self.checkpointer = Checkpointer(storage, key, every=seconds, background=False,
                                         **options)  # fmt: skip
        self.every = seconds
        self.stop = stop
        self.local_dir = Path(local_dir or tempfile.mkdtemp(prefix="spotgpu-hf-"))
        self._last = time.monotonic()
        self._final = False
        restored = self.checkpointer.restore()
        self.resume_from: str | None = None
        if restored is not None:
            target = self.local_dir / f"{PREFIX}-{restored.step}"
            self.resume_from = str(write_directory(restored.state, target))
            logger.info("resuming %s from its checkpoint of step %s", key, restored.step)

    @property
    def notice_received(self) -> bool:
        """Whether the final save is done and acknowledged."""
        return self.checkpointer.notice_received

    def on_step_end(self, args, state, control, **kwargs):
        notice = _any_process(self.checkpointer.notice_pending())
        if notice:
            self._final = True
            control.should_save = True
            control.should_training_stop = True
        elif time.monotonic() - self._last >= self.every:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        """Store the directory the Trainer just wrote (process 0), then, after a notice,
        acknowledge on every process and wait to be stopped."""
        self._last = time.monotonic()
        step = state.global_step
        result, failed = None, None
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX}-{step}"
            try:
                result = self.checkpointer.save(directory_state(folder), step, final=self._final)
            except Exception as exc:
                failed = exc
        if _any_process(failed is not None):  # (every process learns it: also a barrier)
            failed = failed or RuntimeError(f"the checkpoint of step {step} failed on process 0")
            if not self._final:  # a periodic save: training goes on, the next one retries
                logger.error("checkpoint of step %s failed: %s", step, failed)
                return control
            self.checkpointer.notice_received = True
            self.checkpointer.acknowledge_failure(failed)
            raise failed
        if self._final:  # durable: each process tells its node's agent, then waits
            self.checkpointer.read_deadline()
            self.checkpointer.acknowledge(result or SaveResult(step, 0, 0.0, True))
            self.checkpointer.notice_received = True
            if self.stop:
                wait_to_be_stopped(self.checkpointer)
        return control


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process of a distributed run (one all-reduce)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
