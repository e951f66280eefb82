"""Lightning on spot GPUs: a notice is a save-then-stop into the run's storage, and the next
attempt's ``fit`` resumes from it (docs/users/checkpointing.md#lightning).

Adding the callback is the whole change::

    trainer = Trainer(max_steps=10_000, callbacks=[SpotLightningCheckpoint()])
    trainer.fit(model, datamodule)             # resumes by itself on the next attempt

The callback is one of Lightning's fault-tolerance checkpoints (``OnExceptionCheckpoint``):
``fit`` without a ``ckpt_path`` loads such a callback's file when it exists, and the callback
fetches the newest verified checkpoint from the storage to that file when it is made. The
checkpoint is Lightning's own ``.ckpt`` (model, optimizers, schedulers, loops, and the
dataloaders' state when they are resumable), stored as one checkpoint of this project's
storage.

- After each training batch: a notice (SIGUSR1 or the notice file, on any rank) makes the
  trainer save now and stop; every ``every`` seconds it saves.
- Rank 0 stores the file; after the final save is durable every rank acknowledges and waits to
  be stopped (nothing after ``fit`` runs on a noticed attempt).
- An exception saves nothing (the parent class would): a crash resumes from the last durable
  save.
- The random number generators' states go into the checkpoint (the callback's own state) and
  come back with it.

Resuming in the middle of an epoch is exact when the dataloader is resumable (it has
``state_dict``/``load_state_dict``: torchdata's ``StatefulDataLoader``, given a ``generator``
of its own so that making its iterator draws nothing from the global one); otherwise
Lightning replays the epoch's batches from its start, and says so.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

from lightning.pytorch.callbacks import OnExceptionCheckpoint

from prefect_spotgpu.checkpoint.framework import FrameworkSaves
from prefect_spotgpu.checkpoint.rng import rng_state, set_rng_state

FILENAME = "spot"
"""The checkpoint file's name (``spot.ckpt``) in the callback's directory."""


class SpotLightningCheckpoint(OnExceptionCheckpoint):
    """Save-then-stop on a notice, periodic saves and the resume, for a Lightning ``Trainer``.

    ``storage`` and ``key``: as ``checkpointer_for_run`` (default: ``SPOTGPU_CHECKPOINT_URL``
    and the flow run). ``every``: seconds (or a ``timedelta``) between periodic saves.
    ``local_dir``: where the file lives (default: a new temporary directory). ``stop``: wait
    to be stopped after the final save. Other keyword arguments go to the ``Checkpointer``."""

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
        local = Path(local_dir or tempfile.mkdtemp(prefix="spotgpu-lightning-"))
        super().__init__(dirpath=str(local), filename=FILENAME)
        self.saves = FrameworkSaves(storage, key, every, stop, options)
        self.checkpointer = self.saves.checkpointer
        self.resumed_step: int | None = self.saves.restore_into(lambda step: local)

    @property
    def notice_received(self) -> bool:
        return self.saves.notice_received

    def state_dict(self) -> dict:
        """Saved in Lightning's checkpoint: the random number generators' states (Lightning
        keeps none), so dropout and the like resume as if never stopped."""
        state = rng_state()
        name, keys, position, has_gauss, cached = state["numpy"]  # plain types: Lightning
        state["numpy"] = (name, keys.tolist(), int(position), int(has_gauss), float(cached))
        return {"rng": state}

    def load_state_dict(self, state_dict: dict) -> None:
        if "rng" in state_dict:
            set_rng_state(state_dict["rng"])

    def on_exception(self, trainer, *args, **kwargs) -> None:
        """Nothing: a crash resumes from the last durable save, never a half-made state."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        final = strategy.reduce_boolean_decision(self.checkpointer.notice_pending(), all=False)
        if not (final or strategy.broadcast(self.saves.due())):
            return
        trainer.save_checkpoint(self.ckpt_path)  # (every rank takes part, rank 0 writes)
        if final:
            trainer.should_stop = True
        folder = Path(self.dirpath) if trainer.is_global_zero else None
        self.saves.store(
            folder,
            trainer.global_step,
            final=final,
            anywhere=lambda flag: strategy.reduce_boolean_decision(flag, all=False),
        )
