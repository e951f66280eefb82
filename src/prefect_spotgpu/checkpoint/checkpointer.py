"""The checkpointer a spot flow calls in its loop (docs/operators/architecture.md#design-5).

Cooperative and explicit: the flow calls ``ckpt.maybe_save(state, step)`` every step. It saves
when the interval has passed (periodic: by default asynchronous, a snapshot written in the
background, docs/users/checkpointing.md#asynchronous-saves) or when a notice arrived (final:
synchronous, after any periodic save in flight has stopped). A notice is a SIGUSR1
(whose handler only sets a flag) or the appearance of the file named by ``SPOTGPU_NOTICE_FILE``
(checked with one ``stat`` per call, so code in any process of the job sees it). After the final
save the checkpointer writes the acknowledgement the node agent waits for (``SPOTGPU_ACK_FILE``,
default ``<notice file>.ack``) and sets ``notice_received``; the flow should then stop. When the
final save's storage fails, the acknowledgement says so (``{"failed": true, "cause":
"storage", "error": ...}``) and the error is raised: the agent reports a failed save the
platform caused, not a job that crashed.

After every durable save, periodic or final, it rewrites the file named by
``SPOTGPU_SAVED_FILE`` (``{"step", "saved_at", "final"}``); the agent reports each new one to
the market, which compensates lost work only back to the last reported checkpoint.

Invariants: ``restore`` returns only a complete, verified checkpoint (with a signing key:
signed with that key, ``SPOTGPU_CHECKPOINT_SIGNING_KEY`` by default); any checkpoint it
cannot read, verify or rebuild is skipped with a warning naming its step, and an older one is
tried. Retention counts only verified checkpoints: it never deletes the newest verified one
nor the one just written, and never an unverified one newer than those it keeps. This
checkpointer is the single writer of its key's checkpoints: at most one save is written at a
time, in the caller's thread or in one background thread.

``Checkpointer(..., rank=r, world_size=n)`` with ``n > 1`` is a ``GangCheckpointer``
(``checkpoint/gang.py``): one shard per rank of a torch.distributed job, committed together;
``world_size=1`` (the default) is this class, its behaviour and its format.

Example::

    ckpt = Checkpointer(LocalStorage("/ckpt"), key="run-42", every=timedelta(minutes=15))
    restored = ckpt.restore()
    start = restored.step + 1 if restored else 0
    for step in range(start, steps):
        train_one_step()
        ckpt.maybe_save(lambda: {"model": model.state_dict(), "opt": opt.state_dict(),
                                 "rng": rng_state(), "data": sampler.state()}, step)
        if ckpt.notice_received:
            break  # saved and acknowledged: the agent stops us
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from prefect_spotgpu.checkpoint.background import BackgroundSave, SaveAbandoned
from prefect_spotgpu.checkpoint.fencing import Fence, attempt_from_environment
from prefect_spotgpu.checkpoint.format import (
    CorruptCheckpoint,
    decode,
    layout,
    read_manifest,
    signature,
    verify,
)
from prefect_spotgpu.checkpoint.handshake import flush_run_logs, write_ack
from prefect_spotgpu.checkpoint.staging import Staging, stage
from prefect_spotgpu.checkpoint.storage import CheckpointStorage
from prefect_spotgpu.protocol import JOB_ENV

logger = logging.getLogger("prefect_spotgpu.checkpoint")

ERROR_CHARS = 200
IF_BUSY = ("skip", "wait")
"""What a periodic save due while the previous one is still being written does: ``skip``
(logged; the interval starts again) or ``wait`` for it (training stalls meanwhile)."""


@dataclass(frozen=True, slots=True)
class Restored:
    state: object
    step: int


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    bytes: int
    seconds: float
    final: bool


class Checkpointer:
    """Periodic and final saves of one run's state, and its restore.

    ``keep``: how many verified checkpoints to keep (older ones are deleted after a save).
    ``clock``: a monotonic clock in seconds (a seam for tests).
    ``signing_key``: the run's secret for signing manifests (HMAC-SHA256); by default the
    environment's ``SPOTGPU_CHECKPOINT_SIGNING_KEY`` (the spot-gpu worker gives each flow run
    one, the same across its resumes); ``""`` means none. With a key, every checkpoint is
    written signed (format 2, SHA-256 per leaf) and restore refuses, with a warning, any
    checkpoint that is unsigned or signed with another key, for another key name or step.
    Without a key, checkpoints are written unsigned and every checkpoint is accepted, as
    before signing existed: non-tensor state is pickled, so whoever can write the storage
    can then run code in the job when it restores.

    ``background`` (default on): periodic saves stage a snapshot of the state into reused
    host memory (``staging.py``: pinned for CUDA tensors; one copy of the state, kept from
    save to save) and return; a thread writes it (``background.py``). ``if_busy``: what a
    periodic save due while the previous one is still being written does (``IF_BUSY``).
    ``close()`` waits for it and frees the staging memory.

    ``rank``, ``world_size``, ``sync``, ``sync_every``: with ``world_size > 1`` the
    constructor returns a ``GangCheckpointer`` (see there); ``world_size=1`` ignores the last
    two.
    """

    WHAT = "checkpoint"
    """What this checkpointer saves, as its log lines name it."""

    def __new__(cls, *args, world_size: int = 1, **kwargs):
        if cls is Checkpointer and world_size != 1:
            from prefect_spotgpu.checkpoint.gang import GangCheckpointer

            cls = GangCheckpointer
        return super().__new__(cls)

    def __init__(
        self,
        storage: CheckpointStorage,
        key: str,
        *,
        every: timedelta | float = timedelta(minutes=15),
        keep: int = 3,
        notice_file: str | os.PathLike | None = None,
        ack_file: str | os.PathLike | None = None,
        saved_file: str | os.PathLike | None = None,
        handle_sigusr1: bool = True,
        clock: Callable[[], float] = time.monotonic,
        signing_key: str | bytes | None = None,
        rank: int = 0,
        world_size: int = 1,
        sync=None,
        sync_every: int = 1,
        background: bool = True,
        if_busy: str = "skip",
    ) -> None:
        if if_busy not in IF_BUSY:
            raise ValueError(f"if_busy must be one of {', '.join(IF_BUSY)}, got {if_busy!r}")
        if world_size == 1 and rank != 0:
            raise ValueError(f"rank must be 0 when world_size is 1, got rank={rank!r}")
        seconds = every.total_seconds() if isinstance(every, timedelta) else float(every)
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"every must be a positive interval, got {every!r}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep!r}")
        self.storage = storage
        self._fence = Fence(storage, attempt_from_environment())  # one attempt writes a key
        self.key = key
        self.rank = rank
        self.world_size = world_size
        self.every = seconds
        self.keep = keep
        self.clock = clock
        notice = notice_file or os.environ.get(JOB_ENV.NOTICE_FILE)
        self.notice_file = Path(notice) if notice else None
        ack = ack_file or os.environ.get(JOB_ENV.ACK_FILE)
        if ack is None and self.notice_file is not None:
            ack = str(self.notice_file) + ".ack"
        self.ack_file = Path(ack) if ack else None
        saved = saved_file or os.environ.get(JOB_ENV.SAVED_FILE)
        self.saved_file = Path(saved) if saved else None
        self._signalled = threading.Event()
        self.notice_received = False
        self.notice_deadline: float | None = None
        self.last_save: SaveResult | None = None
        self._last_save_at = clock()
        self.failures = 0
        self.background = background
        self.if_busy = if_busy
        self.skipped = 0
        self._staging = Staging()
        self._in_flight: BackgroundSave | None = None
        if signing_key is None:
            signing_key = os.environ.get(JOB_ENV.CHECKPOINT_SIGNING_KEY, "")
        if isinstance(signing_key, str):
            signing_key = signing_key.encode()
        self._signing_key = signing_key or None
        self._checked: dict[int, tuple[bytes, bool]] = {}  # step -> (manifest sha256, verified)
        if handle_sigusr1 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_sigusr1)

    @property
    def signed(self) -> bool:
        """Whether this checkpointer signs its checkpoints and restores only signed ones."""
        return self._signing_key is not None

    def _on_sigusr1(self, signum, frame) -> None:  # only sets a flag: no I/O in handlers
        self._signalled.set()

    # ---------------------------------------------------------------- notice

    def notice_pending(self) -> bool:
        """Whether a notice arrived that the next ``maybe_save`` will answer."""
        if self._signalled.is_set():
            return True
        return self.notice_file is not None and self.notice_file.exists()

    def read_deadline(self) -> None:
        if self.notice_file is None or not self.notice_file.exists():
            return
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            self.notice_deadline = float(json.loads(self.notice_file.read_text())["deadline"])

    # ---------------------------------------------------------------- saving

    def maybe_save(self, state: object | Callable[[], object], step: int) -> SaveResult | None:
        """Save if a notice arrived (final save, then acknowledge) or the interval passed.

        ``state`` may be a callable, called only when a save happens. A periodic save is by
        default asynchronous: the state is copied into reused host memory, this returns
        (``None``), and a background thread writes it (at most one in flight: see
        ``if_busy``); ``background=False`` writes it before returning its ``SaveResult``. A
        periodic save that fails is logged and retried at the next call; training goes on. A
        final save is synchronous and wins over a periodic one in flight (abandoned at its
        next chunk, or finished if it is past its last); when it fails it raises: the flow
        should know it could not save before the deadline (when its storage failed, the
        acknowledgement tells the agent so first).
        """
        if self.notice_received:
            return None
        self._collect()
        if self.notice_pending():
            self.read_deadline()
            self._settle_in_flight(abandon=True)
            snapshot = state() if callable(state) else state
            started = time.perf_counter()
            encoded = self._encode(snapshot, step, final=True)
            try:
                result = self._commit(encoded, started, step, final=True, retain=False)
            except Exception as exc:
                self.notice_received = True  # nothing more to save: the agent stops us
                self.acknowledge_failure(exc)
                raise
            self.acknowledge(result)  # durable: tell the agent first, tidy up after
            self.notice_received = True
            self._retain(result.step)
            return result
        if self.clock() - self._last_save_at < self.every:
            return None
        try:
            if self.background:
                return self._save_in_background(state, step)
            return self.save(state() if callable(state) else state, step)
        except Exception as exc:
            self._periodic_failed(step, exc)
            return None

    def _periodic_failed(self, step: int, exc: BaseException) -> None:
        self.failures += 1
        self._last_save_at = -math.inf  # the next call retries
        logger.error(
            "periodic %s of %s at step %s failed (%s: %s); training goes on and the next "
            "call retries",
            self.WHAT,
            self.key,
            step,
            type(exc).__name__,
            exc,
        )

    def _skipped_while_busy(self, step: int) -> bool:
        """A periodic save due while one is in flight: skipped (``if_busy="skip"``: logged,
        the interval starts again; True), or after the one in flight (``"wait"``; False)."""
        if self._in_flight is None:
            return False
        if self.if_busy == "skip":
            self.skipped += 1
            self._last_save_at = self.clock()
            logger.warning(
                "periodic %s of %s at step %s skipped: the one of step %s is still being "
                "written (if_busy='skip'; the interval starts again)",
                self.WHAT,
                self.key,
                step,
                self._in_flight.step,
            )
            return True
        self._settle_in_flight(abandon=False)
        return False

    def _save_in_background(self, state, step: int) -> None:
        """Stage a snapshot (the only part that blocks), then write it in a thread."""
        if self._skipped_while_busy(step):
            return None
        started = time.perf_counter()
        snapshot = state() if callable(state) else state
        encoded = stage(self._layout(snapshot, step, final=False), self._staging)
        self._last_save_at = self.clock()

        def write(buffers) -> SaveResult:
            return self._commit(encoded, started, step, final=False, retain=True, buffers=buffers)

        self._in_flight = BackgroundSave(step, write, encoded.buffers)
        return None

    def _collect(self) -> None:
        """The outcome of a background save that has finished (a failure is logged and the
        next call retries; a success was reported by its thread)."""
        pending = self._in_flight
        if pending is None or not pending.done():
            return
        self._in_flight = None
        if isinstance(pending.error, SaveAbandoned):
            logger.info(
                "periodic checkpoint of %s at step %s abandoned for the final save",
                self.key,
                pending.step,
            )
        elif pending.error is not None:
            self._periodic_failed(pending.step, pending.error)

    def _settle_in_flight(self, *, abandon: bool) -> None:
        """Return once no background save is being written: finished, or (``abandon``)
        stopped at its next chunk: this checkpointer stays the single writer of its key."""
        if self._in_flight is not None:
            self._in_flight.abandon() if abandon else self._in_flight.join()
            self._collect()

    def wait(self) -> SaveResult | None:
        """Wait for the background save in flight: its result once durable (``None`` when
        there was none); its error, if it failed."""
        pending = self._in_flight
        if pending is None:
            return None
        pending.join()
        self._in_flight = None
        if pending.error is not None:
            raise pending.error
        return pending.result

    def close(self) -> None:
        """Wait for the save in flight (its failure is logged), and free the staging memory."""
        self._settle_in_flight(abandon=False)
        self._staging.release()

    def save(
        self, state: object, step: int, *, final: bool = False, retain: bool = True
    ) -> SaveResult:
        """Write one checkpoint now, durably, then (with ``retain``) delete old ones (after
        the background save in flight, if any: one writer at a time)."""
        self._settle_in_flight(abandon=False)
        started = time.perf_counter()
        encoded = self._encode(state, step, final=final)
        result = self._commit(encoded, started, step, final, retain)
        self._last_save_at = self.clock()
        return result

    def _layout(self, state: object, step: int, *, final: bool):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        extra = {"final": final, "saved_at": time.time()}
        return layout(state, step=step, extra=extra, signed=self.signed)

    def _encode(self, state: object, step: int, *, final: bool):
        """The state's layout over its own memory (a synchronous save's)."""
        return self._layout(state, step, final=final).materialize()

    def _commit(
        self, encoded, started: float, step: int, final: bool, retain: bool, buffers=None
    ) -> SaveResult:
        """Write what ``_encode`` made (or ``buffers`` of it) to the storage (the part that
        fails for the storage's reasons, not the job's), then tell the agent."""
        self._write(self.key, encoded, step, buffers)
        result = SaveResult(step, encoded.size, time.perf_counter() - started, final)
        self.last_save = result
        self._report_saved(result)
        if retain:
            self._retain(step)
        logger.info(
            "%s checkpoint of %s at step %s: %.1f MB in %.2f s",
            "final" if final else "periodic",
            self.key,
            step,
            encoded.size / 1e6,
            result.seconds,
        )
        return result

    def _write(self, name: str, encoded, step: int, buffers=None) -> bytes:
        """Write ``encoded`` as checkpoint ``name`` at ``step`` (checksums in a second thread,
        the manifest signed for ``name`` when we have a key) and return the manifest written;
        the step is then known verified."""
        checksums = threading.Thread(target=encoded.fill_checksums, name="spotgpu-checksums")
        checksums.start()

        written: list[bytes] = []

        def manifest() -> bytes:  # the commit: refused to a stale attempt (``fencing``)
            checksums.join()
            self._fence.check(name)
            key = self._signing_key
            sign = None if key is None else (lambda body: signature(key, name, step, body))
            written.append(encoded.manifest_bytes(sign))
            return written[-1]

        try:
            self.storage.write(
                name, step, encoded.buffers if buffers is None else buffers, encoded.size, manifest
            )
        finally:
            checksums.join()
        self._checked[step] = (hashlib.sha256(written[-1]).digest(), True)
        return written[-1]

    def _retain(self, written: int) -> None:
        """Delete what :func:`steps_to_delete` says, verifying checkpoints only as far as
        it looks (each at most once: a verdict is kept for as long as its manifest stays)."""
        try:
            self._fence.check(self.key)
            doomed = steps_to_delete(
                self.storage.steps(self.key), self._verified, keep=self.keep, written=written
            )
            for old in doomed:
                self.storage.delete(self.key, old)
                self._checked.pop(old, None)
        except Exception as exc:  # retention is housekeeping: never fail a save over it
            logger.warning("could not delete old checkpoints of %s: %s", self.key, exc)

    def _manifest(self, raw: bytes, step: int, name: str | None = None) -> dict:
        name = self.key if name is None else name
        return read_manifest(raw, key=self._signing_key, name=name, step=step)

    def _verified(self, step: int, name: str | None = None) -> bool:
        """Whether ``step`` of checkpoint ``name`` (ours by default) is complete and verified
        (signed with our key, when we have one) without unpickling it; a failure to read it
        now counts as not verified."""
        name = self.key if name is None else name
        try:
            read_manifest_only = getattr(self.storage, "read_manifest", None)
            if read_manifest_only is not None:
                digest = hashlib.sha256(read_manifest_only(name, step)).digest()
                known = self._checked.get(step)
                if known is not None and known[0] == digest:
                    return known[1]
            raw, blob = self.storage.read(name, step)
        except Exception as exc:
            logger.debug("checkpoint %s step %s cannot be read now: %s", name, step, exc)
            return False
        try:
            verify(self._manifest(raw, step, name), blob)
            ok = True
        except CorruptCheckpoint as exc:
            logger.warning("checkpoint %s step %s is not usable (%s)", name, step, exc)
            ok = False
        self._checked[step] = (hashlib.sha256(raw).digest(), ok)
        return ok

    def acknowledge(self, result: SaveResult) -> None:
        if self.ack_file is not None:  # the agent stops the job at once: its logs go first
            flush_run_logs()
            write_ack(self.ack_file, step=result.step, durable=True, seconds=result.seconds)

    def acknowledge_failure(self, exc: Exception) -> None:
        """The final save's storage failed: say so (and why) before the error propagates."""
        error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        logger.error("final checkpoint of %s failed: %s", self.key, error)
        if self.ack_file is not None:
            flush_run_logs()
            with contextlib.suppress(OSError):
                write_ack(self.ack_file, failed=True, cause="storage", error=error)

    def _report_saved(self, result: SaveResult) -> None:
        """Tell the node's agent (``SPOTGPU_SAVED_FILE``) that a save is durable; a failure
        to tell is logged, never the save's failure."""
        if self.saved_file is None:
            return
        try:
            write_ack(self.saved_file, step=result.step, final=result.final)
        except OSError as exc:
            logger.warning("could not write %s: %s", self.saved_file, exc)

    # ---------------------------------------------------------------- restoring

    def restore(self) -> Restored | None:
        """The newest complete, verified checkpoint, or None.

        A checkpoint that is missing a part, torn, corrupt, unsigned or mis-signed (with a
        signing key), or whose state cannot be rebuilt, is skipped with a warning and an
        older one tried (so is a local ``OSError``). Nothing is unpickled before the whole
        checkpoint is verified. Any other storage error (S3 that does not answer) raises:
        starting the run over is no fallback for a store that is down.
        """
        self._fence.claim(self.key)  # from now on, no earlier attempt commits to this key
        for step in self.storage.steps(self.key):
            raw = None
            try:
                raw, blob = self.storage.read(self.key, step)
                state = decode(self._manifest(raw, step), blob)
            except (CorruptCheckpoint, OSError) as exc:
                logger.warning(
                    "checkpoint %s step %s is not usable (%s: %s); trying an older one",
                    self.key,
                    step,
                    type(exc).__name__,
                    exc,
                )
                if raw is not None and isinstance(exc, CorruptCheckpoint):
                    self._checked[step] = (hashlib.sha256(raw).digest(), False)
                continue
            self._checked[step] = (hashlib.sha256(raw).digest(), True)
            return Restored(state, step)
        from prefect_spotgpu.checkpoint.gang import gang_name  # (it imports this module)

        if self.storage.steps(gang_name(self.key)):  # never start over silently
            raise ValueError(
                f"checkpoint {self.key} holds a gang's shards (saved by several ranks) and this "
                "run has one: run it with its node_count, or checkpoint with "
                "DistributedCheckpointer (torch.distributed.checkpoint reshards)"
            )
        return None


def steps_to_delete(
    steps: list[int], verified: Callable[[int], bool], *, keep: int, written: int | None = None
) -> list[int]:
    """Retention's rule, on plain data: the steps to delete, given all steps newest first.

    Walking from the newest, the first ``keep`` verified steps are kept; unverified steps
    among them are left alone (one may be unreadable only for now, and none is ever loaded);
    everything older than the ``keep``-th verified step is deleted, except ``written`` (the
    checkpoint just saved). ``verified`` is asked only about steps above that point.

    >>> steps_to_delete([9, 5, 4, 3], lambda s: s != 9, keep=1, written=5)
    [4, 3]
    >>> steps_to_delete([9, 5], lambda s: False, keep=1, written=5)
    []
    """
    doomed, kept = [], 0
    for step in steps:
        if kept < keep:
            kept += verified(step)
        elif step != written:
            doomed.append(step)
    return doomed
