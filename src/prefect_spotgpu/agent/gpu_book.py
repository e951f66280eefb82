"""Which of the node's GPUs each allocation holds: the agent's GPU bookkeeping, pure.

Invariants (``tests/test_gpu_book.py`` checks them on random sequences): a GPU is held by at
most one allocation; the free GPUs and the held ones are the node's GPUs, exactly; giving back
an allocation's GPUs frees only what *that* allocation holds, so a late or repeated release
(a stop racing a job's exit) can never free GPUs another job holds meanwhile.

An allocation that finds too few GPUs free waits for a stopping job to give them back, for at
most ``patience`` seconds from its first try (``take`` says ``WAIT``), then is given up on
(``GIVE_UP``). No clock is read here: ``now`` is passed in. The agent holds its lock around
every call; this object is not thread-safe by itself.

    >>> book = GpuBook(gpu_count=2, patience=10.0)
    >>> book.take(7, count=2, now=0.0)
    Take(verdict=<Verdict.TAKEN: 'taken'>, indices=(0, 1))
    >>> book.take(8, count=1, now=1.0).verdict, book.waiting()
    (<Verdict.WAIT: 'wait'>, [8])
    >>> book.give_back(7), book.take(8, count=1, now=2.0).indices
    ((0, 1), (0,))
    >>> book.give_back(7)  # again: nothing, and allocation 8 keeps GPU 0
    ()
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    TAKEN = "taken"  # the GPUs are the allocation's now
    WAIT = "wait"  # too few free; a stopping job may give them back: try again later
    GIVE_UP = "give_up"  # too few free for longer than the patience: report it failed


@dataclass(frozen=True)
class Take:
    verdict: Verdict
    indices: tuple[int, ...] = ()  # the GPUs taken (TAKEN only), lowest first
    free: int = 0  # how many were free (WAIT and GIVE_UP: what the log says)


class GpuBook:
    def __init__(self, gpu_count: int, patience: float) -> None:
        self.gpu_count = gpu_count
        self.patience = patience
        self._free = set(range(gpu_count))
        self._held: dict[int, tuple[int, ...]] = {}  # allocation -> its GPUs
        self._waiting: dict[int, float] = {}  # allocation -> its first try (seconds)

    def take(self, alloc_id: int, count: int, now: float) -> Take:
        """Give ``count`` free GPUs to ``alloc_id`` (the lowest indices), or say to wait or to
        give up. An allocation that already holds GPUs gets the same ones again."""
        if alloc_id in self._held:
            self._waiting.pop(alloc_id, None)
            return Take(Verdict.TAKEN, self._held[alloc_id])
        if len(self._free) < count:
            first = self._waiting.setdefault(alloc_id, now)
            if now - first < self.patience:
                return Take(Verdict.WAIT, free=len(self._free))
            del self._waiting[alloc_id]
            return Take(Verdict.GIVE_UP, free=len(self._free))
        self._waiting.pop(alloc_id, None)
        indices = tuple(sorted(self._free)[:count])
        self._free -= set(indices)
        self._held[alloc_id] = indices
        return Take(Verdict.TAKEN, indices)

    def hold(self, alloc_id: int, indices: tuple[int, ...]) -> bool:
        """Give ``alloc_id`` exactly the GPUs ``indices`` (a job adopted from an earlier
        agent, already running on them); False, taking none, if any is not free or not the
        node's.

        >>> book = GpuBook(gpu_count=2, patience=1.0)
        >>> book.hold(3, (1,)), book.hold(4, (1,)), book.hold(5, (2,)), book.held()
        (True, False, False, {3: (1,)})
        """
        wanted = set(indices)
        if alloc_id in self._held or not wanted <= self._free:
            return False
        self._free -= wanted
        self._held[alloc_id] = tuple(sorted(wanted))
        return True

    def give_back(self, alloc_id: int) -> tuple[int, ...]:
        """Free the GPUs ``alloc_id`` holds (none, if it holds none now): what was freed."""
        indices = self._held.pop(alloc_id, ())
        self._free |= set(indices)
        return indices

    def stop_waiting(self, alloc_id: int) -> None:
        """``alloc_id`` no longer needs GPUs (it ended before they were free)."""
        self._waiting.pop(alloc_id, None)

    def waiting(self) -> list[int]:
        """The allocations waiting for GPUs, oldest id first: the agent retries them."""
        return sorted(self._waiting)

    def free_count(self) -> int:
        return len(self._free)

    def held(self) -> dict[int, tuple[int, ...]]:
        """Each allocation's GPUs (a copy)."""
        return dict(self._held)
