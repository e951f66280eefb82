"""Snapshots for asynchronous saves: the state copied into host memory that is reused.

A periodic save must not stall training for the whole write, only for a consistent copy of
the state (docs/users/checkpointing.md#asynchronous-saves). ``stage`` copies every part of an
``Encoded`` layout into one blob-sized host buffer, at the part's offset in the blob, so the
copy is the blob the storage writes: host memory with ``memcpy``, CUDA tensors with a
non-blocking copy into pinned host memory and one synchronisation for all of them. The
buffer is kept for the next save (grown when the state grows), so the peak extra host memory
is one copy of the state, and a save after the first pays no allocation nor page faults.

Invariant: a ``Staging`` holds one snapshot at a time; its owner (the checkpointer) stages
into it only when no write of the previous snapshot is in flight.
"""

from __future__ import annotations

import numpy as np

from prefect_spotgpu.checkpoint.format import Encoded, _torch, _torch_if_imported

PARALLEL_COPY_BYTES = 1 << 20
"""Parts this large are copied by torch (in parallel) when torch is loaded."""


class Staging:
    """Reused host memory for snapshots: pinned (page-locked) when the state has CUDA
    tensors, so their device-to-host copies run at full speed and asynchronously."""

    def __init__(self) -> None:
        self._array: np.ndarray | None = None
        self._tensor = None  # the pinned torch tensor under ``_array``, when pinned

    @property
    def nbytes(self) -> int:
        """The host memory held (one copy of the largest state staged so far)."""
        return 0 if self._array is None else self._array.nbytes

    def blob(self, size: int, *, pinned: bool) -> np.ndarray:
        """A ``size``-byte ``uint8`` array, reused when the buffer is large enough."""
        if self._array is None or self._array.nbytes < size or (pinned and self._tensor is None):
            self.release()
            if pinned:
                torch = _torch()
                self._tensor = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
                self._array = self._tensor.numpy()
            else:
                self._array = np.empty(max(size, 1), dtype=np.uint8)
        return self._array[:size]

    def release(self) -> None:
        """Give the host memory back (the next snapshot allocates it again)."""
        self._array = self._tensor = None


def stage(encoded: Encoded, staging: Staging) -> Encoded:
    """Copy ``encoded``'s parts into ``staging``: its buffers are then the one staged blob,
    independent of the state, which training may change at once; returns ``encoded``."""
    gpus = {p.source.device for p in encoded.parts if not isinstance(p.source, memoryview)}
    host = staging.blob(encoded.size, pinned=bool(gpus))
    view = memoryview(host)
    pinned = staging._tensor
    torch = _torch_if_imported()  # its copy uses every intra-op thread; memcpy uses one
    into = torch.from_numpy(host) if torch is not None else None
    at = 0
    for part in encoded.parts:
        if part.offset > at:
            host[at : part.offset] = 0  # padding: the same bytes every time
        end = part.offset + part.nbytes
        if isinstance(part.source, memoryview):
            source = part.source if part.source.format == "B" else part.source.cast("B")
            if into is not None and part.nbytes >= PARALLEL_COPY_BYTES and not source.readonly:
                into[part.offset : end].copy_(torch.frombuffer(source, dtype=torch.uint8))
            else:
                view[part.offset : end] = source
        else:
            pinned[part.offset : end].copy_(part.source, non_blocking=True)
        encoded.pending.append((part.node, view[part.offset : end]))
        at = end
    for device in gpus:
        _torch().cuda.synchronize(device)  # one wait per GPU for all of its copies
    encoded.buffers = [view]
    encoded.parts = []  # nothing of the state is referenced any more
    return encoded
