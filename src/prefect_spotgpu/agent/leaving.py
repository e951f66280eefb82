"""An agent asked to stop leaves as a reclaim of its node: never a job left running.

SIGTERM, SIGINT (Ctrl-C) or ``systemctl stop`` make the agent tell the market it leaves
(``POST /nodes/{id}/leave``): the node becomes reclaimed, the market notices its allocations,
and each job gets its notice (SIGUSR1: its final save) with a deadline at most
``--grace-seconds`` away. Each is stopped and reported as after any notice, so its run resumes
elsewhere at once. The agent exits once nothing of its jobs is left, or at that deadline, when
what still runs is killed (a second signal: at once). A market that cannot be told is no reason
to leave a job running: the agent then notices its jobs itself.

Asked to hand its jobs over instead (SIGUSR2: an upgrade, ``handover``), the agent exits at
once and leaves them running for the next agent.

What stays a job's own decision is pure (:class:`Leaving`); the agent does the I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

REPORTS_AFTER_KILL_SECONDS = 5.0
"""How long the agent still waits, after killing what was left, for its last reports."""


class Turn(enum.StrEnum):
    """What a leaving agent does next."""

    WAIT = "wait"  # jobs still save and stop: go on serving events
    KILL = "kill"  # the deadline (or a second signal): kill what is left, then exit
    EXIT = "exit"  # nothing is left


@dataclass
class Leaving:
    """When the agent was asked to stop, and by when its jobs must be gone."""

    grace_seconds: float
    by: float | None = None  # the jobs' deadline (None: not asked to stop)
    urgent: bool = False  # asked twice: now
    told: bool = False  # the market was told (or the agent noticed its jobs itself)
    handing_over: bool = False  # asked to hand its jobs over to the next agent instead

    @property
    def asked(self) -> bool:
        """Whether the agent is leaving (either way): it starts no new job."""
        return self.by is not None or self.handing_over

    def hand_over(self) -> None:
        """The hand-over signal: leave the jobs running for the next agent (unless a stop
        was asked first: that one stands)."""
        if self.by is None:
            self.handing_over = True

    def ask(self, now: float) -> None:
        """A stop signal: the first starts leaving, a second makes it urgent."""
        if self.by is None:
            self.by = now + self.grace_seconds
        else:
            self.urgent = True

    def deadline(self, deadline: float) -> float:
        """A notice's deadline for a job of this agent: never past the agent's own."""
        return deadline if self.by is None else min(deadline, self.by)

    def turn(self, *, busy: bool, now: float) -> Turn:
        if not busy:
            return Turn.EXIT
        if self.urgent or now >= self.by:
            return Turn.KILL
        return Turn.WAIT
