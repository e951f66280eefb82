"""Handing jobs over to the next agent: an upgrade that stops no job.

An agent asked to hand over (SIGUSR2; ``systemctl reload`` in docs/operators/systemd.md) stops
serving without telling the market anything: it records what it runs (:func:`write_record`,
``handover.json`` in its state directory, never a job's environment), tells its guard to wait
for the next agent (``guard.Guard.keep``) and exits. Its jobs run on: a process job under its
keeper (``keeper``), a container under the engine. The next agent on that directory reads the
record once (:func:`take_record`) and *adopts* each job the market still assigns to the node:
it watches it, notices it and reports its end as if it had started it. A job the market no
longer assigns, or one without a record, is killed and, if still assigned, started again, as
after any restart.

One copy, always: the market sees nothing but a few missed heartbeats, so the hand-over must
end before its heartbeat timeout. The guard kills the jobs when no agent took over within
``--handover-seconds`` (default 20 s, under the market's default timeout of 30 s).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import TypeAdapter

from prefect_spotgpu.agent.isolation import write_job_file
from prefect_spotgpu.agent.runners.runner import GangPlace, JobHandle, JobRequest

RECORD_NAME = "handover.json"
HANDOVER_SECONDS = 20.0
"""How long a handed-over job waits for the next agent, by default (under the market's
default heartbeat timeout of 30 s)."""

logger = logging.getLogger("prefect_spotgpu.agent")


@dataclass(frozen=True)
class HandedJob:
    """One running job as its agent handed it over: what the next agent needs to watch it
    (never its command or environment)."""

    allocation_id: int
    epoch: int
    bid_id: int
    ref: str  # the runner's name for it (a keeper's pid, a container's id)
    job_ref: str  # the job's own process (process runner), else ``ref``
    gpu_indices: list[int]
    checkpoint_key: str
    image: str | None
    tenant_id: int | None
    gang: dict | None

    @classmethod
    def of(cls, handle: JobHandle) -> HandedJob:
        request = handle.request
        return cls(
            allocation_id=request.allocation_id,
            epoch=request.epoch,
            bid_id=request.bid_id,
            ref=handle.ref,
            job_ref=handle.job_ref,
            gpu_indices=list(request.gpu_indices),
            checkpoint_key=request.checkpoint_key,
            image=request.image,
            tenant_id=request.tenant_id,
            gang=None if request.gang is None else asdict(request.gang),
        )

    def request(self, state_dir: Path) -> JobRequest:
        """The job's request, as far as watching it needs (no command, no environment)."""
        return JobRequest(
            allocation_id=self.allocation_id,
            epoch=self.epoch,
            bid_id=self.bid_id,
            command=[],
            env={},
            gpu_indices=list(self.gpu_indices),
            workdir=Path(state_dir) / f"alloc-{self.allocation_id}",
            checkpoint_key=self.checkpoint_key,
            image=self.image,
            tenant_id=self.tenant_id,
            gang=None if self.gang is None else GangPlace(**self.gang),
        )


@dataclass
class _Record:
    jobs: list[HandedJob]


_RECORD = TypeAdapter(_Record)


def write_record(state_dir: Path, handles: list[JobHandle]) -> None:
    """Record ``handles`` for the next agent (readable by the agent's user only)."""
    jobs = [asdict(HandedJob.of(h)) for h in handles]
    write_job_file(Path(state_dir) / RECORD_NAME, json.dumps({"jobs": jobs}), mode=0o600)


def take_record(state_dir: Path) -> dict[int, HandedJob]:
    """The jobs the last agent handed over, by allocation (none: it did not hand over), and
    the record removed: it is read once."""
    path = Path(state_dir) / RECORD_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    finally:
        path.unlink(missing_ok=True)
    try:
        jobs = _RECORD.validate_json(text).jobs
    except ValueError as exc:  # (pydantic's errors are ValueErrors)
        logger.error("the hand-over record %s is unreadable (%s): no job is adopted", path, exc)
        return {}
    return {job.allocation_id: job for job in jobs}
