"""The checkpointer for a ``torch.distributed.checkpoint`` state: FSDP2, torchtitan, any DCP
state dict, on one rank or a gang (docs/users/checkpointing.md#fsdp-and-dcp).

The same promises as :class:`~prefect_spotgpu.checkpoint.Checkpointer`, whose notice,
acknowledgement and saved-file handling it inherits; DCP does the planning and the
resharding, ``dcp.SpotStorageWriter``/``SpotStorageReader`` the storage::

    ckpt = DistributedCheckpointer(storage, key="run-42")        # every rank, after init
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    step = ckpt.restore(state)                 # loaded in place (any world size); None: new
    if step is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    for step in range(0 if step is None else step + 1, steps):
        train_one_step()
        ckpt.maybe_save(lambda: dict(zip(("model", "optim"), get_state_dict(model, optimizer))),
                        step)
        if ckpt.notice_received:
            break                              # saved and acknowledged: the agent stops us

Each ``maybe_save`` is one agreement over the ranks (a maximum, ``group.py``): a notice seen
by one rank, or an interval passed on one rank's clock, is a save at the same step on every
rank. A periodic save is DCP's ``async_save`` (the state is staged in host memory, the write
goes on in a thread; at most one in flight, on a process group of its own so that its
collectives never interleave with training's); a final save waits for the one in flight,
saves synchronously, and then every rank acknowledges (each node's agent waits for its own
job). Retention is rank 0's, after a commit, counting commits that verify.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

from prefect_spotgpu.checkpoint.checkpointer import Checkpointer, SaveResult, steps_to_delete
from prefect_spotgpu.checkpoint.dcp import (
    SpotStorageReader,
    SpotStorageWriter,
    commit_name,
    committed_steps,
    delete_step,
)
from prefect_spotgpu.checkpoint.format import CorruptCheckpoint, read_manifest
from prefect_spotgpu.checkpoint.group import FINAL, NOTHING, PERIODIC, WRITING, TorchGroupSync

logger = logging.getLogger("prefect_spotgpu.checkpoint")


def _dcp(call, *args, **kwargs):
    """A DCP call whose failure raises the failing rank's own exception (``StaleAttempt``,
    ``CorruptCheckpoint``, an ``OSError`` of the storage), not DCP's ``CheckpointException``,
    which is a ``BaseException`` that no ``except Exception`` of a training loop catches."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # (one process alone is what we asked for: no_dist)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            return call(*args, **kwargs)
    except CheckpointException as exc:
        failures = sorted(exc.failures.items())
        first = failures[0][1][0] if failures else None
        if isinstance(first, Exception):
            raise first from None
        raise RuntimeError(str(exc)) from None


class DistributedCheckpointer(Checkpointer):
    """Periodic and final DCP saves of a state dict, with the notice and retention.

    ``process_group``: the ranks that save together (default: torch.distributed's default
    group when it is initialized; otherwise this process alone). ``sync_every``: agree every
    that many ``maybe_save`` calls only (each agreement is one tiny all-reduce; on NCCL it
    also waits for the step's queued work). The other arguments are ``Checkpointer``'s.
    """

    WHAT = "DCP checkpoint"

    def __init__(
        self,
        storage,
        key: str,
        *,
        every: timedelta | float = timedelta(minutes=15),
        keep: int = 3,
        process_group=None,
        sync_every: int = 1,
        background: bool = True,
        **options,
    ) -> None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(process_group) if distributed else 0
        world = dist.get_world_size(process_group) if distributed else 1
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every!r}")
        super().__init__(storage, key, every=every, keep=keep, background=background,
                         rank=rank, world_size=world, **options)  # fmt: skip
        self._sync = TorchGroupSync(process_group) if world > 1 else None
        # DCP's own collectives, in its thread for async saves: a gloo group of their own
        self._group = dist.new_group(backend="gloo") if distributed else None
        self.sync_every = sync_every
        self._stager = None  # async saves' staging memory, kept from one save to the next
        self._calls = 0
        self._pending = None  # (future, step, started) of the async save in flight

    # ---------------------------------------------------------------- saving

    def _agree(self, ask: int) -> int:
        return ask if self._sync is None else self._sync.max(ask)

    def maybe_save(self, state: dict | Callable[[], dict], step: int) -> SaveResult | None:
        """Save if a notice arrived on any rank (final: synchronous, then every rank
        acknowledges) or the interval passed (periodic: ``async_save`` unless
        ``background=False``); the same on every rank. Call it on every rank at every step."""
        if self.notice_received:
            return None
        self._calls += 1
        if self._calls % self.sync_every:
            return None
        ask = FINAL if self.notice_pending() else NOTHING
        if ask == NOTHING and self.clock() - self._last_save_at >= self.every:
            ask = PERIODIC
        busy = self._pending is not None and not self._pending[0].done()
        agreed = self._agree(ask | (WRITING if busy else 0))
        self._collect()
        what = agreed & ~WRITING
        if what == FINAL:
            self.read_deadline()
            return self._final_save(state() if callable(state) else state, step)
        if what == PERIODIC and not agreed & WRITING:
            snapshot = state() if callable(state) else state
            try:
                if not self.background:
                    return self.save(snapshot, step)
                self._start_async(snapshot, step)
            except Exception as exc:
                self._periodic_failed(step, exc)
        return None

    def _writer(self, step: int) -> SpotStorageWriter:
        self._fence.claim(self.key)
        return SpotStorageWriter(self.storage, self.key, step, signing_key=self._signing_key,
                                 fence=self._fence)  # fmt: skip

    def _start_async(self, state: dict, step: int) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:  # host memory (pinned beside a GPU) reused by every save:
            pinned = torch.cuda.is_available()  # the loop waits for one copy, no allocation
            self._stager = DefaultStager(StagingOptions(pinned, False, False, False))
        self._last_save_at = self.clock()
        started = time.perf_counter()
        future = _dcp(dcp.async_save, state, storage_writer=self._writer(step),
                      process_group=self._group, no_dist=self._group is None,
                      async_stager=self._stager)  # fmt: skip
        self._pending = (future, step, started)

    def _collect(self) -> None:
        """Report a finished async save (and keep what retention says), or its failure."""
        if self._pending is None or not self._pending[0].done():
            return
        future, step, started = self._pending
        self._pending = None
        try:
            _dcp(future.result)
        except Exception as exc:
            self._periodic_failed(step, exc)
            return
        self._saved(SaveResult(step, 0, time.perf_counter() - started, False), retain=True)

    def wait(self) -> SaveResult | None:
        """Wait for the async save in flight, if any (its result, or None)."""
        if self._pending is None:
            return None
        future, step, started = self._pending
        self._pending = None
        _dcp(future.result)
        result = SaveResult(step, 0, time.perf_counter() - started, False)
        self._saved(result, retain=True)
        return result

    def close(self) -> None:
        """Wait for the save in flight; the staging memory is kept for the next one (see
        :meth:`release`)."""
        if self._pending is not None:
            try:
                self.wait()
            except Exception as exc:
                logger.warning("the last periodic DCP save of %s failed: %s", self.key, exc)

    def release(self) -> None:
        """Wait for the save in flight and free the async saves' staging memory."""
        self.close()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def save(self, state: dict, step: int, *, final: bool = False, retain: bool = True):
        """Save ``state`` at ``step`` now (every rank, the same call), synchronously."""
        import torch.distributed.checkpoint as dcp

        self.close()  # at most one save at a time: the one in flight first
        started = time.perf_counter()
        _dcp(dcp.save, state, storage_writer=self._writer(step), process_group=self._group,
             no_dist=self._group is None)  # fmt: skip
        self._last_save_at = self.clock()
        result = SaveResult(step, 0, time.perf_counter() - started, final)
        self._saved(result, retain=retain)
        return result

    def _final_save(self, state: dict, step: int) -> SaveResult:
        try:
            result = self.save(state, step, final=True, retain=False)
        except Exception as exc:
            self.notice_received = True  # nothing more to save: the agent stops us
            self.acknowledge_failure(exc)
            raise
        self.acknowledge(result)  # durable on every rank: each tells its own agent
        self.notice_received = True
        logger.info("final DCP checkpoint of %s at step %s in %.2f s", self.key, step,
                    result.seconds)  # fmt: skip
        self._retain(step)
        return result

    def _saved(self, result: SaveResult, *, retain: bool) -> None:
        self.last_save = result
        self._report_saved(result)
        if retain:
            self._retain(result.step)

    # ---------------------------------------------------------------- retention

    def _commit_verified(self, step: int) -> bool:
        try:
            raw = self.storage.read_manifest(commit_name(self.key), step)
            read_manifest(raw, key=self._signing_key, name=commit_name(self.key), step=step)
        except Exception:
            return False
        return True

    def _retain(self, written: int) -> None:
        """Rank 0 deletes what ``steps_to_delete`` says (commits that verify count), each
        step's commit first."""
        if self.rank != 0:
            return
        try:
            self._fence.check(self.key)
            steps = committed_steps(self.storage, self.key)
            doomed = steps_to_delete(steps, self._commit_verified, keep=self.keep,
                                     written=written)  # fmt: skip
            for old in doomed:
                delete_step(self.storage, self.key, old, ranks=self._ranks_of(old))
        except Exception as exc:  # housekeeping: never fail a save over it
            logger.warning("could not delete old DCP checkpoints of %s: %s", self.key, exc)

    def _ranks_of(self, step: int) -> int:
        """How many ranks wrote ``step`` (its commit says), at least this world's size."""
        try:
            raw = self.storage.read_manifest(commit_name(self.key), step)
            ranks = read_manifest(raw)["extra"].get("ranks", 0)
        except Exception:
            ranks = 0
        return max(int(ranks), self.world_size)

    # ---------------------------------------------------------------- restoring

    def restore(self, state: dict) -> int | None:  # type: ignore[override]
        """Load the newest committed, verified step into ``state`` (in place, whatever the
        world size that saved it: DCP reshards) and return its step; None when there is
        none. A step that fails to verify or load on any rank is skipped, on every rank, with
        a warning, and an older one tried."""
        import torch.distributed.checkpoint as dcp

        self._fence.claim(self.key)  # from now on, no earlier attempt commits to this key
        for step in committed_steps(self.storage, self.key):
            reader = SpotStorageReader(self.storage, self.key, step,
                                       signing_key=self._signing_key)  # fmt: skip
            why = None
            try:
                reader.read_metadata()  # the commit verified here first, on every rank
            except (CorruptCheckpoint, OSError) as exc:
                why = exc
            if self._agree(int(why is not None)):  # one rank's failure is every rank's skip
                logger.warning("DCP checkpoint %s step %s is not usable (%s); trying an "
                               "older one", self.key, step, why or "another rank")  # fmt: skip
                continue
            try:
                _dcp(dcp.load, state, storage_reader=reader, process_group=self._group,
                     no_dist=self._group is None)  # fmt: skip
            except (CorruptCheckpoint, OSError) as exc:  # (raised on every rank alike)
                logger.warning("DCP checkpoint %s step %s is not usable (%s); trying an "
                               "older one", self.key, step, exc)  # fmt: skip
                continue
            return step
        return None
