"""What a job tells its node's agent through files (``write_ack``: the final save's
acknowledgement, a durable save), and what it does first: the run's logs are whole, as what
Prefect's log and event workers hold is sent before the job acknowledges its final save
(``flush_run_logs``), since the agent stops the job the moment it reads that (with SIGKILL,
within milliseconds), before Prefect's batched log handler would send the last lines (the
final save's among them)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import threading
import time
from pathlib import Path

from prefect_spotgpu.protocol import ACK_WAKE_SUFFIX

FLUSH_SECONDS = 5.0
"""The longest a flush holds the acknowledgement (Prefect's own bound at exit)."""


def flush_run_logs(timeout: float = FLUSH_SECONDS) -> None:
    """Send what Prefect's log and event workers hold, waiting at most ``timeout``. Nothing to
    do in a job that never imported Prefect. The drain runs on a thread of its own, where no
    event loop runs, so it blocks even when called from an async flow's."""
    if "prefect.logging.handlers" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    def drain() -> None:
        for service in (APILogWorker, EventsWorker):
            with contextlib.suppress(Exception):  # a flush never fails the save it follows
                service.drain_all(timeout=timeout, at_exit=False)

    flusher = threading.Thread(target=drain, name="spotgpu-flush-logs", daemon=True)
    flusher.start()
    flusher.join(2 * timeout)


def write_ack(path: os.PathLike | str, **fields) -> None:
    """The acknowledgement the node's agent waits for (``saved_at`` added), written
    atomically and durably: temporary file, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**fields, "saved_at": time.time()}))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _wake(path)


def _wake(ack: Path) -> None:
    """Poke the agent waiting on ``<ack>.wake`` (a FIFO), if one is: it stops the job sooner.
    Nothing when there is none, or nobody reads it."""
    try:
        fd = os.open(f"{ack}{ACK_WAKE_SUFFIX}", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO (off the market, an older agent), or no reader (ENXIO)
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, b"!")
    except OSError:
        pass
    finally:
        os.close(fd)
