"""The guard: a job never outlives its agent.

An agent that stops kills what its jobs left (``leaving``); one that dies (a crash, SIGKILL,
the OOM killer) cannot. So the agent's command forks a guard first, before any thread starts:
a process that holds the read end of a pipe whose write end only the agent holds. When the
agent is gone, however it went, the kernel closes that end and the guard reads end-of-file at
once; it then kills every job recorded in the agent's state directory (``Runner.reconcile``:
a process job's group and its user's processes, a container) and exits. The market would only
place the run elsewhere after its heartbeat timeout: by then the old copy is long gone.

The guard runs in a session of its own (a Ctrl-C on the agent's terminal is the agent's), and
after a normal exit finds nothing left to kill.

One agent at a time serves a state directory (:func:`hold_state_dir`): an agent started while
another still stops there (a quick restart) waits until that one and its guard are gone, so it
never finds, and restarts, a job the other is still saving.

An agent that hands its jobs over (``handover``: an upgrade) tells its guard so before it
exits (:meth:`Guard.keep`). The guard then lets go of the state directory and waits for the
next agent to take it, at most the hand-over's seconds (less than the market's heartbeat
timeout); if none comes, it takes the directory itself and kills the jobs as above, so a job
still never outlives its agents by more than that.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from prefect_spotgpu.agent.runners import Runner

LOCK_NAME = "agent.lock"
logger = logging.getLogger("prefect_spotgpu.agent")


def hold_state_dir(state_dir: Path) -> int:
    """Lock ``state_dir`` for this agent (and its guard, which inherits the lock) until both
    are gone, waiting for an agent that still holds it; the lock's descriptor."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.warning("another agent still stops on %s: waiting for it", state_dir)
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@dataclass(frozen=True)
class Guard:
    """The agent's side of its guard: its pid and the pipe's write end."""

    pid: int
    pipe: int

    def keep(self, seconds: float) -> None:
        """The agent hands its jobs over: when it is gone, wait ``seconds`` for the next
        agent before killing them."""
        os.write(self.pipe, f"keep {seconds:.3f}\n".encode())


def start_guard(runner: Runner, state_dir: Path, lock: int) -> Guard:
    """Fork the guard of the jobs under ``state_dir`` (call it before any thread starts),
    sharing the agent's ``lock`` on it (``hold_state_dir``). The agent keeps the pipe's write
    end open for as long as it lives (it is not inherited by the jobs it starts)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(read_end)
        return Guard(pid, write_end)
    try:  # the guard: nothing here may take a lock another thread held at the fork
        os.close(write_end)
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        said = b""
        while chunk := os.read(read_end, 64):
            said = (said + chunk)[-64:]
        keep = said.split(b"keep ")[-1].split(b"\n")[0] if b"keep " in said else None
        if keep is None or not _handed_over(state_dir, lock, float(keep)):
            kill_jobs(runner, Path(state_dir))
    finally:
        os._exit(0)


def _handed_over(state_dir: Path, lock: int, seconds: float) -> bool:
    """Let go of the state directory and wait up to ``seconds`` for the next agent to hold
    it: True once one does. If none came, the directory is held again (an agent that comes
    now waits) and False: the jobs are to be killed."""
    os.close(lock)
    path = Path(state_dir) / LOCK_NAME
    until = time.monotonic() + seconds
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return True  # the next agent holds it: the jobs are its own now
        if time.monotonic() >= until:
            os.write(2, f"spotgpu guard: no agent took over {state_dir} within "
                        f"{seconds:.0f} s\n".encode())  # fmt: skip
            return False  # (the lock is kept until this process exits)
        os.close(fd)
        time.sleep(0.1)


def kill_jobs(runner: Runner, state_dir: Path) -> list[int]:
    """Kill every job recorded under ``state_dir`` that still runs: their allocations."""
    killed = []
    for workdir in sorted(state_dir.glob("alloc-*")):
        alloc_id = int(workdir.name.removeprefix("alloc-"))
        with contextlib.suppress(Exception):
            if runner.reconcile(alloc_id, workdir):
                killed.append(alloc_id)
                os.write(2, f"spotgpu guard: the agent is gone; killed the job of "
                            f"allocation {alloc_id}\n".encode())  # fmt: skip
    return killed
