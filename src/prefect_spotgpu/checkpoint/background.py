"""The background writer of asynchronous saves: one thread per save, at most one in flight.

The checkpointer stages a snapshot (``staging.py``), then hands its write to a
``BackgroundSave``: the thread writes, fsyncs, checksums, signs and commits it, then reports
it (``SPOTGPU_SAVED_FILE``) and applies retention, while training goes on. The thread runs in
a copy of the caller's context, so its log lines reach the flow run's logs.

``abandon()`` asks the write to stop at its next chunk boundary (``CHUNK_BYTES``): the
storage then fails the write as it fails any write (a local temporary directory removed, an
S3 multipart upload aborted), so nothing is committed and the previous checkpoint stays the
newest. A write that is past its last chunk (its manifest, fsyncs, rename) finishes: that is
sooner than starting over. Either way ``join`` returns only once the thread has stopped
writing, so the final save is never a second writer on the key.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence

CHUNK_BYTES = 64 << 20
"""How often (in bytes written) a background write checks whether it was abandoned."""


class SaveAbandoned(Exception):
    """A background save was abandoned (for the final save) before its blob was written."""


class AbandonableBuffers:
    """``buffers`` re-cut into chunks of at most ``CHUNK_BYTES``; iterating raises
    ``SaveAbandoned`` before the next chunk once ``abandoned`` is set (the storages write
    ``buffers`` by iterating over them)."""

    def __init__(self, buffers: Sequence[memoryview], abandoned: threading.Event) -> None:
        self.buffers = buffers
        self.abandoned = abandoned

    def __len__(self) -> int:
        return len(self.buffers)

    def __iter__(self) -> Iterator[memoryview]:
        for buffer in self.buffers:
            view = buffer if buffer.format == "B" else buffer.cast("B")
            for start in range(0, max(view.nbytes, 1), CHUNK_BYTES):
                if self.abandoned.is_set():
                    raise SaveAbandoned("abandoned for the final save")
                yield view[start : start + CHUNK_BYTES]


class BackgroundSave:
    """One save's write, in a thread: ``write(buffers)`` is called with the abandonable
    buffers and returns the ``SaveResult``; ``done``, ``result`` and ``error`` tell how it
    went."""

    def __init__(
        self,
        step: int,
        write: Callable[[AbandonableBuffers], object],
        buffers,
        started: float | None = None,
    ) -> None:
        self.step = step
        self.started = time.perf_counter() if started is None else started  # (its snapshot)
        self.abandoned = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self._buffers = AbandonableBuffers(buffers, self.abandoned)
        self._write = write
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name=f"spotgpu-save-{step}"
        )
        self._thread.start()  # not a daemon: a flow that returns still finishes its save

    def _run(self) -> None:
        try:
            self.result = self._write(self._buffers)
        except BaseException as exc:  # handed to the checkpointer's next call
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.done()

    def abandon(self) -> None:
        """Stop at the next chunk (or finish, if past the last one), then return."""
        self.abandoned.set()
        self.join()
