"""The runner contract: what the agent gives a runner, what it gets back, what it may ask.

The agent knows a job only as a :class:`JobRequest` (what to run, on which GPUs, in which
directory) and the :class:`JobHandle` a runner's ``start`` returns: the allocation's request,
an opaque ``ref`` only that runner reads (a pid, a container id) and when the notice was sent.
Everything else a runner needs (a ``Popen``, the job's user, a container's host pid) lives in
its own subclass of the handle; what it must find again after an agent restart it records in
the job's directory itself (``reconcile``). A new runner is one class that implements
:class:`Runner`, added to ``runners.RUNNERS``.

Every runner gives its job the same files, at the same names in its directory: the notice
(written here, :func:`write_notice`), the acknowledgement and the saved file (written by the
job's checkpointer); only where the job sees the directory differs (``job_variables``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prefect_spotgpu.agent.isolation import (
    ACK_NAME,
    NOTICE_NAME,
    PID_NAME,
    SAVED_NAME,
    is_local_url,
    tenant_checkpoint_dir,
    write_job_file,
)
from prefect_spotgpu.market.checks import MAX_GANG_NODES, MAX_GPUS_PER_NODE
from prefect_spotgpu.protocol import (
    GANG_ENV_NAMES,
    JOB_ENV,
    MAX_IMAGE_REFERENCE_CHARS,
    MAX_NODE_IMAGES,
    NODE_ADDRESS_PATTERN,
    unfit_node_address,
)

logger = logging.getLogger("prefect_spotgpu.agent")

MOST_NODE_IMAGES = MAX_NODE_IMAGES
"""The most image references a heartbeat carries (the market refuses more)."""
MOST_REFERENCE_CHARS = MAX_IMAGE_REFERENCE_CHARS
"""The longest image reference the market takes."""

Progress = Callable[[str], None]
"""Where a runner says how far a long preparation is: one plain line at a time."""


class JobFault(ValueError):
    """The job cannot start for a reason of its own, whatever the node: the program its
    command names is missing or not executable, its arguments are too long, its checkpoint
    URL or its image is not one this runner takes. A runner raises it (from the original
    error, with the same message) so that the agent does not count the failure against the
    node (``start_failures``): a tenant's broken job must not drain a healthy node."""


@dataclass(frozen=True, slots=True)
class GangPlace:
    """Where a gang member stands in its gang, as the market's assignment says."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    gpus_per_node: int
    lead_allocation: int  # rank 0's allocation in the same attempt
    peers: tuple[str, ...] = ()  # its members' job addresses (on job networks: job_network.py)

    @classmethod
    def from_assignment(cls, gang: object) -> GangPlace | None:
        """The assignment's ``gang`` checked (None: a one-node job); a ``ValueError`` saying
        what is wrong with it, in words fit for the allocation's failure report.

        >>> GangPlace.from_assignment({"rank": 2, "world_size": 2, "master_addr": "10.0.0.7",
        ...                            "master_port": 20010, "gpus_per_node": 1,
        ...                            "lead_allocation": 41})
        Traceback (most recent call last):
        ValueError: the market's gang is malformed: gang.rank must be an integer in [0, 1]
        """
        if gang is None:
            return None

        def malformed(why: str) -> ValueError:
            return ValueError(f"the market's gang is malformed: {why}")

        if not isinstance(gang, dict):
            raise malformed(f"gang must be an object, got {type(gang).__name__}")

        def whole(name: str, low: int, high: int) -> int:
            value = gang.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise malformed(f"gang.{name} must be an integer in [{low}, {high}]")
            return value

        world = whole("world_size", 1, MAX_GANG_NODES)  # 1: a gang gone on smaller, alone
        rank = whole("rank", 0, world - 1)
        address = gang.get("master_addr")
        if not isinstance(address, str) or not re.fullmatch(NODE_ADDRESS_PATTERN, address):
            raise malformed("gang.master_addr must be an IP address or a host name")
        if why := unfit_node_address(address):
            raise malformed(f"gang.master_addr {address!r} is {why}")
        port = whole("master_port", 1, 65535)
        gpus = whole("gpus_per_node", 1, MAX_GPUS_PER_NODE)
        lead = whole("lead_allocation", 1, 2**63 - 1)
        peers = gang.get("peers", [])
        if (
            not isinstance(peers, list)
            or len(peers) > world
            or not all(isinstance(p, str) and _is_ipv4(p) for p in peers)
        ):
            raise malformed(f"gang.peers must be at most {world} IPv4 addresses")
        return cls(rank, world, address, port, gpus, lead, tuple(peers))

    def variables(self) -> dict[str, str]:
        values = (
            self.master_addr,
            self.master_port,
            self.world_size,
            self.rank,
            self.rank,
            self.world_size,
            0,
            1,
            self.gpus_per_node,
            self.lead_allocation,
        )
        return {name: str(v) for name, v in zip(GANG_ENV_NAMES, values, strict=True)}


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One allocation's job, as the agent starts it."""

    allocation_id: int
    epoch: int
    bid_id: int
    command: list[str]
    env: dict[str, str]
    gpu_indices: list[int]
    workdir: Path  # the allocation's directory on this host (notice and ack files)
    checkpoint_url: str | None = None
    checkpoint_key: str = ""
    image: str | None = None
    tenant_id: int | None = None  # whose job: its checkpoint directory and group
    gang: GangPlace | None = None  # a gang member: its torch.distributed rendezvous
    job_address: str | None = None  # its address on the node's job network (job_network.py)
    cpu_threads: int | None = None  # its share of the host's cores: OMP_NUM_THREADS by default

    def thread_default(self) -> dict[str, str]:
        """``OMP_NUM_THREADS`` at the job's share of the host's cores, where the agent gave
        one: a default the bid's own variables override."""
        return {"OMP_NUM_THREADS": str(self.cpu_threads)} if self.cpu_threads else {}

    @property
    def notice_file(self) -> Path:
        return self.workdir / NOTICE_NAME

    @property
    def ack_file(self) -> Path:
        return self.workdir / ACK_NAME

    @property
    def saved_file(self) -> Path:
        return self.workdir / SAVED_NAME

    def job_variables(self, *, workdir: str, checkpoint_url: str | None) -> dict[str, str]:
        """The ``SPOTGPU_*`` variables, with the paths as the job sees them."""
        env = {
            JOB_ENV.ALLOCATION_ID: str(self.allocation_id),
            JOB_ENV.ALLOCATION_EPOCH: str(self.epoch),
            JOB_ENV.BID_ID: str(self.bid_id),
            JOB_ENV.NOTICE_FILE: f"{workdir}/{NOTICE_NAME}",
            JOB_ENV.ACK_FILE: f"{workdir}/{ACK_NAME}",
            JOB_ENV.SAVED_FILE: f"{workdir}/{SAVED_NAME}",
            JOB_ENV.CHECKPOINT_KEY: self.checkpoint_key,
        }
        if checkpoint_url:
            env[JOB_ENV.CHECKPOINT_URL] = checkpoint_url
        if self.gang is not None:
            env.update(self.gang.variables())
        return env


@dataclass(eq=False)
class JobHandle:
    """A started job, as the agent holds it: what every runner has. One handle is one job
    (equal only to itself). ``ref`` is the runner's own name for the job (the process runner's
    pid, the Docker runner's container id); only the runner that made it reads it."""

    request: JobRequest
    ref: str
    started_at: float
    signalled_at: float | None = None
    """When the notice was sent (set by ``Runner.notice``): the job is then the notice's."""

    @property
    def job_ref(self) -> str:
        """The job's own process or container, where the runner has one apart from ``ref``
        (a process job's keeper leads its group; the job is its child): ``adopt``'s second
        name for it."""
        return self.ref


class Runner(Protocol):
    """What the agent needs of a runner (``ProcessRunner``, ``DockerRunner``)."""

    name: str
    """How the market knows it (``market.Runner``): what bids it serves."""
    default_image: str | None
    """The image a bid without one runs in (a Docker node's operator's choice); None."""

    def ready(self, request: JobRequest) -> bool:
        """Whether ``start`` can run the job at once; False: ``prepare`` it first."""
        ...

    def prepare(self, request: JobRequest, progress: Progress) -> None:
        """Make ready what the job needs (the Docker runner pulls its image), saying how far
        through ``progress`` (at most every ``PULL_REPORT_SECONDS``, and a last line when
        done). May take minutes: the agent calls it on a thread of its own, outside its lock.
        Raise (the agent reports the allocation failed, with the message) if it cannot."""
        ...

    def start(self, request: JobRequest) -> JobHandle:
        """Start the job; raise (the agent reports the allocation failed) if it cannot."""
        ...

    def notice(self, handle: JobHandle, deadline: float) -> None:
        """Write the notice file and send SIGUSR1 to the job's main process only; set
        ``handle.signalled_at``."""
        ...

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None:
        """Stop every process of the job: SIGTERM, then after ``grace`` seconds SIGKILL;
        ``grace`` 0: SIGKILL only (the end of a notice: the engine must not write a Crashed
        state of its own, see ``Agent._await_final_save``)."""
        ...

    def poll(self, handle: JobHandle) -> int | None:
        """The job's exit code, or None while it runs."""
        ...

    def last_line(self, handle: JobHandle) -> str | None:
        """The last non-empty line the job printed, if any (read before ``stop``; a container:
        on its error output, if any): a failed job's report says it."""
        ...

    def local_images(self) -> list[str]:
        """The image references this node holds (sorted, at most ``MOST_NODE_IMAGES``), for
        the heartbeat; a runner without images has none."""
        ...

    def adopt(self, request: JobRequest, ref: str, job_ref: str) -> JobHandle | None:
        """After a hand-over (``agent.handover``): the job an earlier agent started as
        ``ref`` (``job_ref``: its own process, where the runner has one), running or ended
        with its exit status kept, as a handle this agent watches; None if it is gone."""
        ...

    def reconcile(self, allocation_id: int, workdir: Path) -> bool:
        """After an agent restart: kill what is left of an earlier run's job of this
        allocation in ``workdir`` (as recorded by ``start``) and forget it; True if something
        was killed."""
        ...


def last_line_of(output: bytes) -> str | None:
    """The last non-empty line of ``output`` (a job's, as bytes), stripped.

    >>> last_line_of(b"Traceback ...\\nModuleNotFoundError: No module named 'x'\\n\\n")
    "ModuleNotFoundError: No module named 'x'"
    """
    for line in reversed(output.decode(errors="replace").splitlines()):
        if line.strip():
            return line.strip()
    return None


def write_notice(request: JobRequest, deadline: float) -> None:
    """The notice file, written atomically, that code in any process of the job can see."""
    notice = {"deadline": deadline, "allocation_id": request.allocation_id}
    write_job_file(request.notice_file, json.dumps(notice))


def clear_job_files(request: JobRequest) -> None:
    """Remove an earlier attempt's notice, acknowledgement and saved file before a start."""
    for stale in (request.notice_file, request.ack_file, request.saved_file):
        stale.unlink(missing_ok=True)


def record_pid(request: JobRequest, pid: int) -> None:
    """Record the job's host pid in its directory for ``reconcile``. The job runs already: a
    failure to record is logged, never the start's."""
    try:
        write_job_file(request.workdir / PID_NAME, str(pid))
    except OSError:
        logger.exception("allocation %s: its pid could not be recorded", request.allocation_id)


def checkpoint_location(
    request: JobRequest, root: Path | None, *, seen_at: str | None = None
) -> tuple[Path | None, str | None]:
    """Where a job's checkpoints go: (host directory to prepare, URL the job is given).

    With a checkpoint ``root``, a local URL (a path, ``file://``, relative or not: whatever
    it names) becomes the tenant's directory under the root, seen by the job at ``seen_at``
    (a container's mount point) or at its host path; ``s3://`` is passed through untouched;
    anything else is refused. Without a root (the single-tenant process runner) the tenant's
    URL is kept as given.
    """
    url = request.checkpoint_url
    if not url or root is None:
        return None, url
    if url.startswith("s3://"):
        return None, url
    if not is_local_url(url):
        raise JobFault(f"checkpoint URL {url!r} refused: give a path or s3://bucket/prefix")
    host = tenant_checkpoint_dir(root, request.tenant_id, request.bid_id)
    return host, seen_at or str(host)


def last_line(runner: Runner, handle: JobHandle) -> str | None:
    """The job's last line of output, or None when it cannot be read (what the job did to its
    output: logged; its exit code is reported all the same)."""
    try:
        return runner.last_line(handle)
    except Exception:
        logger.exception(
            "allocation %s: its output could not be read", handle.request.allocation_id
        )
        return None


def _is_ipv4(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True
