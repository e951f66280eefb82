"""``torch.distributed.checkpoint`` (DCP) through this project's storage, local or S3.

:class:`SpotStorageWriter` and :class:`SpotStorageReader` are DCP's storage plug-ins: pass them
to ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` as ``storage_writer=`` /
``storage_reader=`` (``DistributedCheckpointer`` does, with the notice, the acknowledgement
and retention). DCP plans who writes what (each rank its own shards of a ``fully_shard``
model, replicated tensors once) and who reads what, so a checkpoint saved by N ranks loads on
any number of ranks (resharding); these classes only store and fetch the bytes. Layout, for a
checkpoint key ``K`` and a step (each entry a checkpoint of its own in the storage's usual
layout, checksummed, signed with a key, committed atomically)::

    K/dcp-rank-00000/<step>/{data.bin,manifest.json}   what rank 0 wrote: its items, in order
    K/dcp-rank-00001/<step>/...
    K/dcp/<step>/{data.bin,manifest.json}              the commit: DCP's metadata (where each
                                                       item lies: rank, position) and the
                                                       SHA-256 of every rank's manifest

Invariants:

- **nothing half-written is loaded**: DCP calls ``finish`` on its coordinator only after every
  rank's ``write_data`` returned, and ``finish`` writes the commit last; a step exists for
  readers only once its commit does, and the reader checks every rank's manifest against it
  and every item's checksum before a byte is used;
- a stale attempt never commits (``fencing``): ``finish`` checks the key's claim first;
- the coordinator is the single writer of commits, rank ``r`` of ``dcp-rank-r``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import threading
from dataclasses import dataclass

import numpy as np
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from prefect_spotgpu.checkpoint.fencing import Fence
from prefect_spotgpu.checkpoint.format import (
    CorruptCheckpoint,
    decode,
    encode,
    read_manifest,
    signature,
)
from prefect_spotgpu.checkpoint.storage import CheckpointStorage

logger = logging.getLogger("prefect_spotgpu.checkpoint")


def commit_name(key: str) -> str:
    """Where a key's DCP commits lie."""
    return f"{key}/dcp"


def rank_name(key: str, rank: int) -> str:
    """Where rank ``rank``'s items of a key's DCP checkpoints lie."""
    return f"{key}/dcp-rank-{rank:05d}"


@dataclass(frozen=True)
class ItemPlace:
    """Where one DCP item lies: in rank ``rank``'s blob, at ``position`` in its items."""

    rank: int
    position: int


@dataclass(frozen=True)
class RankFile:
    """A rank's part of the global save plan: which blob its items go to."""

    rank: int


class _Sealed:
    """How this storage signs and checks the manifests it writes (no key: unsigned)."""

    def __init__(self, storage: CheckpointStorage, signing_key: bytes | None) -> None:
        self.storage, self.signing_key = storage, signing_key

    def write(
        self, name: str, step: int, state: object, *, before_commit=None, extra=None
    ) -> bytes:
        """Write ``state`` as checkpoint ``name`` at ``step`` (``extra``: more for its
        manifest, readable without the blob; ``before_commit()`` is called just before the
        manifest is written, and may refuse it); the manifest written."""
        encoded = encode(state, step=step, extra=extra, signed=self.signing_key is not None)
        checksums = threading.Thread(target=encoded.fill_checksums, name="spotgpu-checksums")
        checksums.start()  # (beside the write: both release the GIL)
        written: list[bytes] = []

        def manifest() -> bytes:
            checksums.join()
            if before_commit is not None:
                before_commit()
            key = self.signing_key
            sign = None if key is None else (lambda body: signature(key, name, step, body))
            written.append(encoded.manifest_bytes(sign))
            return written[-1]

        try:
            self.storage.write(name, step, encoded.buffers, encoded.size, manifest)
        finally:
            checksums.join()
        return written[-1]

    def read(self, name: str, step: int, *, digest: bytes | None = None) -> object:
        """Checkpoint ``name`` at ``step``, verified (its manifest's SHA-256 ``digest``, when
        given, too); ``CorruptCheckpoint`` otherwise."""
        raw, blob = self.storage.read(name, step)
        if digest is not None and hashlib.sha256(raw).digest() != digest:
            raise CorruptCheckpoint(f"{name} step {step} is not the one its commit names")
        manifest = read_manifest(raw, key=self.signing_key, name=name, step=step)
        return decode(manifest, blob)


class SpotStorageWriter(StorageWriter):
    """DCP's ``storage_writer`` for checkpoint ``key`` at ``step`` in ``storage`` (shared by
    every rank: S3, or one filesystem mounted on every node).

    ``signing_key``: sign what is written (``Checkpointer``'s rule; None: unsigned).
    ``fence``: refuse the commit to a stale attempt (``fencing.Fence``)."""

    def __init__(
        self,
        storage: CheckpointStorage,
        key: str,
        step: int,
        *,
        signing_key: bytes | None = None,
        fence: Fence | None = None,
    ) -> None:
        super().__init__()
        self.key, self.step, self.fence = key, step, fence
        self._sealed = _Sealed(storage, signing_key)
        self.is_coordinator = False
        self.manifests: dict[int, bytes] = {}  # rank -> its manifest (this rank's only)

    def reset(self, checkpoint_id=None) -> None:
        self.manifests = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=RankFile(i)) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = plan.storage_data.rank
        items, results = [], []
        for position, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                data.seek(0)
                value = np.frombuffer(data.read(), dtype=np.uint8)
            else:
                value = data.detach().contiguous()
            items.append(value)
            size = value.nbytes
            results.append(WriteResult(item.index, size, ItemPlace(rank, position)))
        manifest = self._sealed.write(rank_name(self.key, rank), self.step, {"items": items})
        digest = hashlib.sha256(manifest).hexdigest()
        results.append(WriteResult(_ManifestIndex(rank), 0, digest))  # the commit names it
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The commit (the coordinator only, once every rank's ``write_data`` returned)."""
        places, digests = {}, {}
        for rank_results in results:
            for result in rank_results:
                if isinstance(result.index, _ManifestIndex):
                    digests[result.index.rank] = result.storage_data
                else:
                    places[result.index] = result.storage_data
        metadata.storage_data = places
        commit = {"metadata": metadata, "manifests": [digests[r] for r in sorted(digests)]}
        ranks = {"ranks": len(digests)}  # (retention reads it without the blob)
        check = None if self.fence is None else (lambda: self.fence.check(self.key))
        self._sealed.write(commit_name(self.key), self.step, commit, before_commit=check,
                           extra=ranks)  # fmt: skip

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # (a storage and a step, never a path)


@dataclass(frozen=True)
class _ManifestIndex:
    """The index of the one extra result each rank returns: its manifest's SHA-256."""

    rank: int


class SpotStorageReader(StorageReader):
    """DCP's ``storage_reader`` for checkpoint ``key`` at a committed ``step`` (any world
    size: DCP reshards). Every rank blob it reads is checked against the commit and its own
    checksums first; a step that fails raises ``CorruptCheckpoint`` (the caller tries an
    older one)."""

    def __init__(
        self,
        storage: CheckpointStorage,
        key: str,
        step: int,
        *,
        signing_key: bytes | None = None,
    ) -> None:
        super().__init__()
        self.key, self.step = key, step
        self._sealed = _Sealed(storage, signing_key)
        self._commit: dict | None = None
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._commit is None:
            commit = self._sealed.read(commit_name(self.key), self.step)
            if not isinstance(commit, dict) or not isinstance(commit.get("metadata"), Metadata):
                raise CorruptCheckpoint(f"{commit_name(self.key)} step {self.step}: no metadata")
            self._commit = commit
        return self._commit["metadata"]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **kw) -> None:
        self.metadata = metadata
        if self._commit is None:  # (another rank read the commit: read it here too)
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        places = self.metadata.storage_data
        by_rank: dict[int, list] = {}
        for request in plan.items:
            by_rank.setdefault(self._place(request).rank, []).append(request)
        for rank, requests in sorted(by_rank.items()):
            items = self._rank_items(rank)
            for request in requests:
                try:
                    value = items[places[request.storage_index].position]
                except (IndexError, TypeError) as exc:
                    raise CorruptCheckpoint(f"step {self.step}: rank {rank} lacks an item") from exc
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(value.tobytes()))
                    continue
                source = narrow_tensor_by_index(value, request.storage_offsets, request.lengths)
                target = planner.resolve_tensor(request).detach()
                if target.size() != source.size():
                    raise CorruptCheckpoint(
                        f"item {request.storage_index} is {tuple(source.size())} in step "
                        f"{self.step}, the model wants {tuple(target.size())}"
                    )
                target.copy_(source)
                planner.commit_tensor(request, target)
        future: Future = Future()
        future.set_result(None)
        return future

    def _place(self, request) -> ItemPlace:
        """Where the commit says an item lies; ``CorruptCheckpoint`` when it says nothing
        usable (a commit of another writer, say)."""
        place = self.metadata.storage_data.get(request.storage_index)
        if not isinstance(place, ItemPlace):
            raise CorruptCheckpoint(f"step {self.step}: no place for {request.storage_index}")
        return place

    def _rank_items(self, rank: int) -> list:
        """Rank ``rank``'s items, checked against the commit and their own checksums."""
        try:
            digest = bytes.fromhex(self._commit["manifests"][rank])
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpoint(f"step {self.step}: the commit names no rank {rank}") from exc
        items = self._sealed.read(rank_name(self.key, rank), self.step, digest=digest)
        if not isinstance(items, dict) or not isinstance(items.get("items"), list):
            raise CorruptCheckpoint(f"step {self.step}: rank {rank}'s blob holds no items")
        return items["items"]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def committed_steps(storage: CheckpointStorage, key: str) -> list[int]:
    """The steps of ``key`` with a DCP commit, newest first (verified when read)."""
    return storage.steps(commit_name(key))


def delete_step(storage: CheckpointStorage, key: str, step: int, ranks: int) -> None:
    """Delete a step: its commit first (readers never find a commit without its blobs), then
    every rank's blob (``ranks``: at least the world size that saved it)."""
    storage.delete(commit_name(key), step)
    for rank in range(ranks):
        try:
            storage.delete(rank_name(key, rank), step)
        except Exception as exc:  # housekeeping: left for the next save's retention
            logger.debug("could not delete %s step %s: %s", rank_name(key, rank), step, exc)
