"""Waiting for a noticed job's acknowledgement, or its exit, without polling.

At a notice the agent makes a FIFO beside the job's acknowledgement file (``<ack>.wake``,
``protocol.ACK_WAKE_SUFFIX``); the checkpoint library writes a byte to it once the
acknowledgement is in place (``checkpoint.handshake.write_ack``). The agent also holds a pidfd
of the job's process (``os.pidfd_open``), readable once it exits. It sleeps in ``select`` on
both until one wakes it or the deadline comes. The FIFO is in a directory the job owns: it is
made fresh, opened without following a link and checked to be a FIFO; a job that plants
something else there, or pokes it without acknowledging, only makes the agent look at the
acknowledgement file sooner, and it looks every ``LOOK_SECONDS`` anyway (every
``FALLBACK_SECONDS`` where it lacks either).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import stat
import time
from collections.abc import Callable
from pathlib import Path

from prefect_spotgpu.protocol import ACK_WAKE_SUFFIX

logger = logging.getLogger("prefect_spotgpu.agent")

FALLBACK_SECONDS = 0.25
"""How often the agent looks when it has no FIFO or no pidfd to wait on."""
LOOK_SECONDS = 1.0
"""How often it looks anyway (a job that removed its FIFO acknowledges all the same)."""


class AckWait:
    """A wait on one noticed job: ``wait(timeout)`` returns when its acknowledgement pokes
    the FIFO, when its process ends, or after ``timeout``. Close it when done."""

    def __init__(self, ack_file: Path, pid: int | None) -> None:
        self.path = Path(f"{ack_file}{ACK_WAKE_SUFFIX}")
        self.fifo = self._fifo()
        self.pidfd = None
        if pid is not None:
            with contextlib.suppress(OSError, AttributeError):  # gone already; an old kernel
                self.pidfd = os.pidfd_open(pid)

    def _fifo(self) -> int | None:
        """A fresh FIFO at ``path``, opened for reading (the job may write to it)."""
        try:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # whatever the job put there (a link is not followed)
            os.mkfifo(self.path, 0o600)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as exc:
            logger.debug("no wake-up FIFO at %s: %s", self.path, exc)
            return None
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):  # swapped between mkfifo and open
            os.close(fd)
            return None
        os.fchmod(fd, 0o622)  # the job's user writes (by descriptor: no link followed)
        return fd

    def __enter__(self) -> AckWait:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def until(self, deadline: float, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` or the ``deadline`` (UNIX time), woken to look again."""
        while time.time() < deadline and not done():
            self.wait(deadline - time.time())

    def wait(self, timeout: float) -> None:
        watched = [fd for fd in (self.fifo, self.pidfd) if fd is not None]
        both = self.fifo is not None and self.pidfd is not None
        limit = LOOK_SECONDS if both else FALLBACK_SECONDS
        if not watched:
            select.select([], [], [], max(0.0, min(timeout, limit)))
            return
        ready, _, _ = select.select(watched, [], [], max(0.0, min(timeout, limit)))
        if self.pidfd is not None and self.pidfd in ready:  # it ended: the runner says so soon
            os.close(self.pidfd)
            self.pidfd = None
        if self.fifo is not None and self.fifo in ready:
            self._drain()

    def _drain(self) -> None:
        """Read what pokes the FIFO holds; once its writers closed (end of file), a fresh
        FIFO, or ``select`` would not sleep on it again."""
        while True:
            try:
                poked = os.read(self.fifo, 64)
            except BlockingIOError:  # a writer still has it open: drained
                return
            if not poked:
                os.close(self.fifo)
                self.fifo = self._fifo()
                return

    def close(self) -> None:
        for fd in (self.fifo, self.pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fifo = self.pidfd = None
        with contextlib.suppress(OSError):
            self.path.unlink()
