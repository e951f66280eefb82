"""Two attempts of one run never commit to one checkpoint key.

On the market each attempt of a run is an allocation, and a later attempt's allocation has a
higher id (the market numbers them as it places them). A job's checkpointer claims its key for
its attempt (``SPOTGPU_ALLOCATION_ID``; a gang's ranks share rank 0's) before it first reads or
writes it, and checks just before each save commits (before its manifest is written) and before
retention deletes that no later attempt has claimed the key since. A stale attempt (an old copy
that outlived its node's agent, say) has its save refused with :class:`StaleAttempt`, and
deletes nothing. Outside the market (no allocation id) nothing is fenced; nor is a storage that
keeps no claims (``claim`` and ``latest_claim``: the local and S3 storages do).

The agent stops a job before its allocation ends, and its guard kills the jobs of an agent that
dies, so a stale attempt should never run; this is the storage's own word on it, should one.
"""

from __future__ import annotations

import os

from prefect_spotgpu.protocol import JOB_ENV


class StaleAttempt(RuntimeError):
    """A later attempt of the run writes this checkpoint now: this attempt's save is refused."""


def attempt_from_environment() -> int | None:
    """This job's attempt on the market: its allocation id, if it runs on a node; for a gang
    member, rank 0's allocation of the same attempt (``SPOTGPU_GANG_LEAD_ALLOCATION``), which
    every rank shares: the ranks of one attempt write one key together (a DCP checkpoint)."""
    for name in (JOB_ENV.GANG_LEAD_ALLOCATION, JOB_ENV.ALLOCATION_ID):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class Fence:
    """One attempt's claims on the checkpoint keys it writes, in ``storage``."""

    def __init__(self, storage, attempt: int | None) -> None:
        self.storage, self.attempt = storage, attempt
        self.fenced = attempt is not None and all(
            hasattr(storage, name) for name in ("claim", "latest_claim")
        )
        self._claimed: set[str] = set()

    def claim(self, key: str) -> None:
        """Claim ``key`` for this attempt (once)."""
        if self.fenced and key not in self._claimed:
            self.storage.claim(key, self.attempt)
            self._claimed.add(key)

    def check(self, key: str) -> None:
        """``StaleAttempt`` if a later attempt has claimed ``key``."""
        if not self.fenced:
            return
        self.claim(key)
        latest = self.storage.latest_claim(key)
        if latest is not None and latest > self.attempt:
            raise StaleAttempt(
                f"checkpoint {key} is written by a later attempt of this run (allocation "
                f"{latest}; this is allocation {self.attempt}): this save is refused"
            )
