"""Sharded checkpoints of a gang: one shard per rank of a torch.distributed job, committed
together by one gang manifest (docs/operators/architecture.md#design-5, docs/users/gangs.md).

Layout, for checkpoint key ``K`` (each entry a checkpoint of its own in the storage's usual
layout, so LocalStorage and S3Storage need nothing new)::

    K/rank-00000/<step>/{data.bin,manifest.json}   rank 0's shard: its state, the usual format
    K/rank-00001/<step>/...                         rank 1's shard
    K/gang/<step>/manifest.json                     the gang manifest: world size, and per
                                                    shard the SHA-256 of its manifest and its
                                                    size (signed like any manifest, with a key)

One save, on every rank at the same step (each numbered step is one collective, ``group.py``):

1. agree what to do (nothing < periodic < final): the maximum over the ranks, once per
   ``maybe_save`` call (every ``sync_every`` steps), so a notice seen by one rank, or an
   interval passed on one rank's clock, is a save at the same step everywhere;
2. each rank writes its shard durably (temporary name, fsync, checksums, rename; S3: manifest
   last), then the verdict: every shard durable, or which rank failed and why;
3. rank 0 reads every shard's manifest back and writes the gang manifest (the commit), then
   the verdict of the commit.

Invariants:

- a gang step exists for readers only once its gang manifest does, and rank 0 writes it only
  after every rank's shard write has returned: a rank that dies mid-save leaves a torn step
  that nothing loads (its shards are deleted at the next save that commits);
- ``restore`` returns, on every rank, the same step: the newest whose gang manifest verifies,
  is of this world size, and whose every shard verifies against it on its own rank (one
  collective per step tried); rank ``r`` gets its own shard;
- no rank acknowledges a notice (``SPOTGPU_ACK_FILE``) or reports a save
  (``SPOTGPU_SAVED_FILE``) before the gang manifest is committed; a save that failed on any
  rank failed on every rank (the acknowledgement's ``cause`` is ``storage`` only when no rank's
  job failed);
- retention counts gang steps, verified on every rank; it never deletes the newest verified
  one nor the one just written. Rank 0 is the single writer of gang manifests, rank ``r`` of
  its shards.

The storage must be shared by every rank (S3, or one filesystem mounted on every node): rank 0
reads every shard back before it commits, so a storage that is not shared fails the first
save, not the restore.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass

from prefect_spotgpu.checkpoint.background import BackgroundSave
from prefect_spotgpu.checkpoint.checkpointer import (
    ERROR_CHARS,
    Checkpointer,
    Restored,
    SaveResult,
    steps_to_delete,
    write_ack,
)
from prefect_spotgpu.checkpoint.format import CorruptCheckpoint, decode, encode, signature
from prefect_spotgpu.checkpoint.group import (
    BROKEN,
    FINAL,
    JOB,
    NOTHING,
    OK,
    PERIODIC,
    SKIP,
    STORAGE,
    USABLE,
    WRITING,
    GroupSync,
    TorchGroupSync,
    failure_code,
    fingerprint,
    read_failure,
    same_everywhere,
)
from prefect_spotgpu.checkpoint.staging import stage

logger = logging.getLogger("prefect_spotgpu.checkpoint")

GANG_FIELD = "gang"


class OtherWorldSize(CorruptCheckpoint):
    """A gang step saved by another number of ranks (its shards restore only on that many)."""

    def __init__(self, saved: object, here: int) -> None:
        super().__init__(f"a gang of {saved!r} ranks; this one has {here}")
        self.saved = saved


class GangCheckpointFailed(Exception):
    """A gang save failed on another rank, or its commit did (nothing is committed); or the
    ranks could not restore together (they see different checkpoints, or another rank's
    storage does not answer)."""


def shard_name(key: str, rank: int) -> str:
    return f"{key}/rank-{rank:05d}"


def gang_name(key: str) -> str:
    return f"{key}/{GANG_FIELD}"


@dataclass(frozen=True, slots=True)
class _Failed:
    cause: str  # the acknowledgement's: "storage" or "job"
    error: BaseException  # this rank's own error, or GangCheckpointFailed naming the rank


class _JobFailed(Exception):
    """This rank could not stage its shard (its state function raised): the job's fault."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error

    def write(self, buffers):  # the background "write" of a shard that could not be staged
        raise self


class GangCheckpointer(Checkpointer):
    """A ``Checkpointer`` for rank ``rank`` of ``world_size`` ranks (``world_size >= 2``).

    Every rank makes the same calls with the same steps: ``restore()`` once, then
    ``maybe_save(this_rank_state, step)`` every step (``save`` is collective too). ``sync``:
    how the ranks agree (``group.GroupSync``); by default torch.distributed's default group,
    which must be initialized first and have this rank and world size. ``sync_every``: agree
    (and so save, or answer a notice) only at steps divisible by it; each agreement is one
    all-reduce of one integer: 0.3 to 1 ms with gloo on this repository's 2-core test machine,
    so a job whose steps take less than ~100 ms should agree every few steps. Other options
    are the ``Checkpointer``'s. A ``SaveResult``'s ``bytes`` are this rank's shard's.

    Example (each rank of ``torchrun`` or one process per node)::

        dist.init_process_group("nccl")  # or gloo
        ckpt = Checkpointer(storage, "run-42", rank=dist.get_rank(),
                            world_size=dist.get_world_size(), every=timedelta(minutes=15))
        restored = ckpt.restore()  # this rank's shard of the newest complete gang step
        for step in range(restored.step + 1 if restored else 0, steps):
            train_one_step()
            ckpt.maybe_save(lambda: {"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                                     "rng": rng_state(), "data": sampler.state()}, step)
            if ckpt.notice_received:
                break  # every rank saved, the gang manifest is committed, every rank acked
    """

    WHAT = "gang checkpoint"

    def __init__(
        self,
        storage,
        key: str,
        *,
        rank: int | None = None,
        world_size: int,
        sync: GroupSync | None = None,
        sync_every: int = 1,
        **options,
    ) -> None:
        for name, value, least in (("world_size", world_size, 2), ("sync_every", sync_every, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            # no default: two ranks that both took one would write the same shard
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        sync = sync if sync is not None else TorchGroupSync()
        found = (getattr(sync, "rank", rank), getattr(sync, "world_size", world_size))
        if found != (rank, world_size):
            raise ValueError(
                f"rank={rank}, world_size={world_size} but the process group has rank "
                f"{found[0]} of {found[1]}"
            )
        super().__init__(storage, key, rank=rank, world_size=world_size, **options)
        self.sync = sync
        self.sync_every = sync_every
        self.shard = shard_name(key, rank)
        self.gang = gang_name(key)

    # ---------------------------------------------------------------- saving

    def maybe_save(self, state, step: int) -> SaveResult | None:
        """Agree with every rank whether to save now, and save if any asks (see the module).

        A periodic save is asynchronous by default (``background``): every rank stages its
        shard and writes it in a thread; the agreement that finds every rank's write ended
        commits the gang step (or logs its failure), in the caller's thread, at the same
        step on every rank. A periodic save due while one is in flight follows ``if_busy``
        (every rank must pass the same). A final save abandons one in flight (nothing of it
        is committed), then saves synchronously.

        A periodic save that failed on any rank is logged on every rank, and every rank
        retries at the next agreement. A final save that failed acknowledges the failure on
        every rank, then raises (this rank's error, or ``GangCheckpointFailed``). A broken
        gang (a rank that died) raises from the collective.
        """
        if self.notice_received or (self.sync_every > 1 and step % self.sync_every):
            return None
        if self.notice_pending():
            mine = FINAL
        elif self.clock() - self._last_save_at >= self.every:
            mine = PERIODIC
        else:
            mine = NOTHING
        writing = self._in_flight is not None and not self._in_flight.done()
        agreed = self.sync.max(mine + (WRITING if writing else 0))
        anyone_writing, agreed = agreed >= WRITING, agreed % WRITING
        if self._in_flight is not None and not anyone_writing:
            self._finish_in_background_save()  # collective, like every branch here
        if agreed == NOTHING:
            return None
        if agreed == FINAL:
            self._settle_in_flight(abandon=True)  # on every rank: the final save wins
            return self._final_save(state, step)
        if self._skipped_while_busy(step):  # alike on every rank: WRITING is agreed
            return None
        if self.background:
            self._start_in_background(state, step)
            return None
        return self._periodic_outcome(self._save_gang(state, step, final=False), step)

    def _periodic_outcome(self, outcome: SaveResult | _Failed, step: int) -> SaveResult | None:
        if isinstance(outcome, _Failed):  # logged on every rank; the next agreement retries
            self._periodic_failed(step, outcome.error)
            return None
        self._saved(outcome, retain=True)
        return outcome

    def _start_in_background(self, state, step: int) -> None:
        """Stage this rank's shard and write it in a thread; a staging failure is kept as
        the save's outcome (every rank has a save in flight, so the collectives match)."""
        started = time.perf_counter()
        try:
            snapshot = state() if callable(state) else state
            encoded = stage(self._layout(snapshot, step, final=False), self._staging)
        except Exception as exc:
            write, buffers = _JobFailed(exc).write, []
        else:

            def write(buffers) -> int:
                self._write(self.shard, encoded, step, buffers)
                return encoded.size

            buffers = encoded.buffers
        self._last_save_at = self.clock()
        self._in_flight = BackgroundSave(step, write, buffers, started)

    def _finish_in_background_save(self) -> None:
        """Every rank's shard write has ended: the verdict and the commit (collectives)."""
        pending, self._in_flight = self._in_flight, None
        error = pending.error
        if isinstance(error, _JobFailed):
            mine, error = JOB, error.error
        else:
            mine = OK if error is None else STORAGE
        size = pending.result or 0
        outcome = self._agree_and_commit(pending.step, False, mine, error, size, pending.started)
        self._periodic_outcome(outcome, pending.step)

    def _settle_in_flight(self, *, abandon: bool) -> None:
        """Collective: the save in flight abandoned, or finished and committed (so are
        ``wait``, ``save`` and ``close``, which call it)."""
        if self._in_flight is not None:
            if abandon:
                self._in_flight.abandon()
                self._in_flight = None
            else:
                self._in_flight.join()
                self._finish_in_background_save()

    def wait(self) -> SaveResult | None:
        """Collective: the save in flight written on every rank and committed; the newest
        committed save (a failure is logged, as at the next agreement)."""
        self._settle_in_flight(abandon=False)
        return self.last_save

    def save(self, state, step: int, *, final: bool = False, retain: bool = True) -> SaveResult:
        """Write one gang checkpoint now (every rank calls this), then (with ``retain``)
        delete old ones; raises if any rank's part failed."""
        self._settle_in_flight(abandon=False)
        outcome = self._save_gang(state, step, final=final)
        if isinstance(outcome, _Failed):
            raise outcome.error
        self._saved(outcome, retain=retain)
        return outcome

    def _final_save(self, state, step: int) -> SaveResult:
        self.read_deadline()
        try:
            outcome = self._save_gang(state, step, final=True)
        except Exception as exc:  # the gang broke mid-save: nothing is committed
            self.notice_received = True
            self._acknowledge_gang_failure("job", exc)
            raise
        self.notice_received = True  # nothing more to save: the agents stop us
        if isinstance(outcome, _Failed):
            self._acknowledge_gang_failure(outcome.cause, outcome.error)
            raise outcome.error
        # No retention: it is collective, and each rank's agent stops it at its ack. The next
        # attempt's first save tidies up (at most one gang checkpoint more than ``keep``).
        self._saved(outcome, retain=False)
        self.acknowledge(outcome)
        return outcome

    def _save_gang(self, state, step: int, *, final: bool) -> SaveResult | _Failed:
        """This rank's shard, the verdict, rank 0's commit, its verdict: the same collectives
        on every rank whatever fails where (two; one when a shard failed), and a failure is
        returned, not raised."""
        started = time.perf_counter()
        mine, own_error, size = OK, None, 0
        try:
            snapshot = state() if callable(state) else state
            encoded = self._encode(snapshot, step, final=final)
        except Exception as exc:
            mine, own_error = JOB, exc
        else:
            size = encoded.size
            try:
                self._write(self.shard, encoded, step)
            except Exception as exc:
                mine, own_error = STORAGE, exc
        return self._agree_and_commit(step, final, mine, own_error, size, started)

    def _agree_and_commit(
        self, step: int, final: bool, mine: int, own_error, size: int, started: float
    ) -> SaveResult | _Failed:
        """After this rank's shard write: the verdict, rank 0's commit, its verdict."""
        verdict = self.sync.max(failure_code(mine, self.rank, self.world_size))
        if verdict == OK:  # every shard is durable
            if self.rank == 0:
                try:
                    self._commit_gang(step, final)
                except Exception as exc:
                    mine, own_error = STORAGE, exc
            verdict = self.sync.max(failure_code(mine, self.rank, self.world_size))
        if verdict == OK:
            return SaveResult(step, size, time.perf_counter() - started, final)
        status, failed_rank = read_failure(verdict, self.world_size)
        cause = "storage" if status == STORAGE else "job"
        if own_error is not None:
            logger.error(
                "rank %s's part of the gang checkpoint of %s at step %s failed: %s: %s",
                self.rank,
                self.key,
                step,
                type(own_error).__name__,
                own_error,
            )
        if failed_rank == self.rank and own_error is not None:
            return _Failed(cause, own_error)
        error = GangCheckpointFailed(
            f"rank {failed_rank}'s part of the gang checkpoint of {self.key} at step {step} "
            f"failed ({cause}); nothing is committed"
        )
        return _Failed(cause, error)

    def _commit_gang(self, step: int, final: bool) -> None:
        """Rank 0: read every shard's manifest back, then write the gang manifest naming them."""
        shards = []
        for rank in range(self.world_size):
            name = shard_name(self.key, rank)
            try:
                raw = self.storage.read_manifest(name, step)
                size = self._manifest(raw, step, name)["size"]
            except Exception as exc:
                raise GangCheckpointFailed(
                    f"rank 0 cannot read rank {rank}'s shard of step {step} back "
                    f"({type(exc).__name__}: {exc}); every rank must save to storage that "
                    "every rank can read"
                ) from exc
            shards.append({"manifest_sha256": hashlib.sha256(raw).hexdigest(), "size": size})
        record = {"world_size": self.world_size, "shards": shards}
        extra = {GANG_FIELD: record, "final": final, "saved_at": time.time()}
        encoded = encode(None, step=step, extra=extra, signed=self.signed)
        key = self._signing_key
        sign = None if key is None else (lambda body: signature(key, self.gang, step, body))
        self.storage.write(self.gang, step, [], 0, lambda: encoded.manifest_bytes(sign))

    def _saved(self, result: SaveResult, *, retain: bool) -> None:
        self.last_save = result
        self._last_save_at = self.clock()
        self._report_saved(result)
        if retain:
            self._retain(result.step)
        logger.info(
            "%s gang checkpoint of %s at step %s: rank %s of %s, %.1f MB in %.2f s",
            "final" if result.final else "periodic",
            self.key,
            result.step,
            self.rank,
            self.world_size,
            result.bytes / 1e6,
            result.seconds,
        )

    def _acknowledge_gang_failure(self, cause: str, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        logger.error("final gang checkpoint of %s failed: %s", self.key, error)
        if self.ack_file is not None:
            with contextlib.suppress(OSError):
                write_ack(self.ack_file, failed=True, cause=cause, error=error)

    # ---------------------------------------------------------------- verifying

    def _expected_shard(self, step: int) -> dict:
        """What ``step``'s gang manifest says of this rank's shard; ``CorruptCheckpoint``
        when it is unreadable, mis-signed, malformed or of another world size."""
        raw = self.storage.read_manifest(self.gang, step)
        manifest = self._manifest(raw, step, self.gang)
        extra = manifest.get("extra")
        record = extra.get(GANG_FIELD) if isinstance(extra, dict) else None
        if not isinstance(record, dict) or not isinstance(record.get("shards"), list):
            raise CorruptCheckpoint("not a gang manifest")
        if record.get("world_size") != self.world_size or len(record["shards"]) != self.world_size:
            raise OtherWorldSize(record.get("world_size"), self.world_size)
        shard = record["shards"][self.rank]
        if not isinstance(shard, dict) or not isinstance(shard.get("manifest_sha256"), str):
            raise CorruptCheckpoint(f"malformed entry for rank {self.rank}")
        return shard

    def _shard_usable(self, step: int) -> bool:
        """Whether this rank's shard of ``step`` is the one its gang manifest names, complete
        and verified (local: never raises, never a collective)."""
        try:
            expected = self._expected_shard(step)["manifest_sha256"]
            raw = self.storage.read_manifest(self.shard, step)
        except Exception as exc:
            logger.debug("gang checkpoint %s step %s cannot be used now: %s", self.key, step, exc)
            return False
        if hashlib.sha256(raw).hexdigest() != expected:
            logger.warning(
                "gang checkpoint %s step %s: rank %s's shard is not the one its gang manifest "
                "names",
                self.key,
                step,
                self.rank,
            )
            return False
        return self._verified(step, self.shard)

    def _gang_verified(self, step: int) -> bool:
        """Whether ``step`` is usable on every rank (one collective)."""
        return self.sync.max(0 if self._shard_usable(step) else 1) == 0

    def _listing(self, name: str) -> tuple[list[int], int]:
        """``name``'s steps and their fingerprint (-1: the listing failed)."""
        try:
            steps = self.storage.steps(name)
        except Exception as exc:
            logger.warning("could not list the checkpoints of %s: %s", name, exc)
            return [], -1
        return steps, fingerprint(steps)

    def _retain(self, written: int) -> None:
        """Delete what ``steps_to_delete`` says of gang steps (verified on every rank), then
        every shard of this rank whose step no gang manifest names (torn saves). Collective:
        every rank makes the same calls, failures here are logged, never the save's."""
        steps, seen = self._listing(self.gang)
        if not same_everywhere(self.sync, seen) or seen < 0:
            logger.warning("the ranks list different checkpoints of %s: not tidying", self.key)
            return
        doomed = steps_to_delete(steps, self._gang_verified, keep=self.keep, written=written)
        if self.rank == 0:
            try:
                for old in doomed:  # its gang manifest first: the step vanishes at once
                    self.storage.delete(self.gang, old)
            except Exception as exc:
                logger.warning("could not delete old gang checkpoints of %s: %s", self.key, exc)
        self.sync.max(0)  # barrier: the doomed gang manifests are gone before their shards
        committed, seen = self._listing(self.gang)
        shards, mine = self._listing(self.shard)
        if seen < 0 or mine < 0:
            return
        try:
            for old in set(shards) - set(committed):
                self.storage.delete(self.shard, old)
                self._checked.pop(old, None)
        except Exception as exc:
            logger.warning("could not delete old shards of %s: %s", self.shard, exc)

    # ---------------------------------------------------------------- restoring

    def restore(self) -> Restored | None:
        """This rank's shard of the newest gang step usable on every rank, or None.

        Every rank tries the same steps, newest first: a step whose gang manifest or any
        rank's shard is missing, torn, corrupt, mis-signed or not the one named is skipped
        with a warning (naming the step) on every rank. A storage that does not answer on any
        rank raises on every rank; so does a key whose only usable steps are of another world
        size (``GangCheckpointFailed``, naming the fixes), rather than start over.
        """
        steps, seen = self._listing(self.gang)
        if not same_everywhere(self.sync, seen) or seen < 0:
            raise GangCheckpointFailed(
                f"the ranks do not see the same gang checkpoints of {self.key}: "
                "is the storage shared by every rank, and does it answer?"
            )
        other = None  # the newest step of another world size, and that size
        for step in steps:
            state, raw, mine, error = None, None, USABLE, None
            try:
                expected = self._expected_shard(step)["manifest_sha256"]
                raw, blob = self.storage.read(self.shard, step)
                if hashlib.sha256(raw).hexdigest() != expected:
                    raise CorruptCheckpoint("this rank's shard is not the one its gang names")
                state = decode(self._manifest(raw, step, self.shard), blob)
            except (CorruptCheckpoint, OSError) as exc:
                mine, other = SKIP, other or (isinstance(exc, OtherWorldSize) and (step, exc.saved))
                logger.warning(
                    "gang checkpoint %s step %s is not usable on rank %s (%s: %s); trying an "
                    "older one",
                    self.key,
                    step,
                    self.rank,
                    type(exc).__name__,
                    exc,
                )
            except Exception as exc:
                mine, error = BROKEN, exc
            agreed = self.sync.max(mine)
            if agreed == BROKEN:
                raise error or GangCheckpointFailed(f"another rank could not read step {step}")
            if agreed == SKIP:
                if mine == USABLE:
                    logger.warning(
                        "gang checkpoint %s step %s is not usable on another rank; trying an "
                        "older one",
                        self.key,
                        step,
                    )
                continue
            self._checked[step] = (hashlib.sha256(raw).digest(), True)
            return Restored(state, step)
        if self.sync.max(int(bool(other))):  # never a silent start over: progress is there
            step, saved = other or (None, "another number of")
            raise GangCheckpointFailed(
                f"gang checkpoint {self.key} step {step} was saved by {saved} ranks and this "
                f"gang has {self.world_size}: a gang's shards restore only on the world size "
                f"that saved them. Run with node_count={saved} (and no min_node_count: a gang "
                "that may go on smaller changes its world size), or checkpoint with "
                "DistributedCheckpointer (torch.distributed.checkpoint reshards), or start over "
                "under another key"
            )
        return None
