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

import tempfile
from datetime import timedelta
from pathlib import Path

from transformers import TrainerCallback

from prefect_spotgpu.checkpoint.framework import FrameworkSaves
from prefect_spotgpu.checkpoint.group import TorchGroupSync

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
        self.saves = FrameworkSaves(storage, key, every, stop, options)
        self.checkpointer = self.saves.checkpointer
        self.local_dir = Path(local_dir or tempfile.mkdtemp(prefix="spotgpu-hf-"))
        self._final = False
        self.resume_from: str | None = None
        found = self.saves.restore_into(lambda step: self.local_dir / f"{PREFIX}-{step}")
        if found is not None:  # (the Trainer's name for it: checkpoint-<step>)
            self.resume_from = str(self.local_dir / f"{PREFIX}-{found}")

    @property
    def notice_received(self) -> bool:
        """Whether the final save is done and acknowledged."""
        return self.saves.notice_received

    def on_step_end(self, args, state, control, **kwargs):
        if _any_process(self.checkpointer.notice_pending()):
            self._final = True
            control.should_save = True
            control.should_training_stop = True
        elif self.saves.due():
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        """Store the directory the Trainer just wrote (process 0), then, after a notice,
        acknowledge on every process and wait to be stopped."""
        step = state.global_step
        folder = Path(args.output_dir) / f"{PREFIX}-{step}"
        zero = state.is_world_process_zero
        self.saves.store(folder if zero else None, step, final=self._final, anywhere=_any_process)
        return control


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process of a distributed run (``group.TorchGroupSync``:
    one all-reduce, on the GPU under NCCL); ``flag`` itself without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    return bool(TorchGroupSync().max(int(flag)))
