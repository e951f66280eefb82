"""Who a job runs as, where its files live, and how all of its processes are found again.

Jobs are hostile (docs/operators/architecture.md#design-7). When the agent runs as root, every job
of the process runner runs as an unprivileged user of its own (``--job-user auto``): uid ``uid_base
+ allocation id mod UID_RANGE``, and a group per tenant, gid ``uid_base + tenant id``, so a
tenant's later jobs can read and write the checkpoints of its earlier ones while no other tenant
can. The container runner runs its containers as the same uid:gid. Its own uid is what lets the
agent stop *every* process of a job (``setsid`` leaves the process group, never the uid) and what
keeps one job out of another's ``/proc/<pid>/environ``.

Layout on the host (the agent, as root, creates every directory here)::

    <state dir>/                 0711  root; node.json 0600 (the node token)
        alloc-<id>/              0700  the job's uid while it runs (its HOME, notice, ack and
                                       saved files, job.log), root's again after it stopped
    <checkpoint root>/           0711  root; --checkpoint-root (default <state dir>/checkpoints)
        tenant-<id>/             2770  root:<tenant gid>; checkpoints keyed by flow run inside

The agent reads and writes files in a directory the job owns, so it never follows a link
there and never reads more than a small, regular file (:func:`read_job_file`,
:func:`write_job_file`): a job may plant a symlink to ``/etc/shadow`` or a FIFO.

Not isolated by the process runner (the single-tenant choice; the container runner is the
multi-tenant one): the network, the GPUs (``CUDA_VISIBLE_DEVICES`` chooses, ``/dev/nvidia*``
does not refuse), and the host's memory and process table (no limits).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pwd
import signal
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from prefect_spotgpu.checkpoint.objects import tenant_dir_name
from prefect_spotgpu.protocol import JOB_ENV

logger = logging.getLogger("prefect_spotgpu.agent")

UID_BASE = 200_000
"""Default first uid (and gid) of ``--job-user auto``; nothing else on the host may use
``[UID_BASE, UID_BASE + UID_RANGE)`` as uids or ``UID_BASE + tenant id`` as gids."""
UID_BASE_ENV = "SPOTGPU_JOB_UID_BASE"
"""The agent's setting for ``--job-uid-base`` (the option's environment variable): two agents
on one host (each its own market) need disjoint ranges, since an agent kills a stopped job's
processes by its uid."""
UID_RANGE = 100_000
"""A job's uid is ``uid_base + allocation id % UID_RANGE``: two jobs on one node share a
uid only if their allocation ids differ by a multiple of this."""
CONTAINER_CHECKPOINTS = "/spotgpu/checkpoints"
"""Where a container sees its tenant's checkpoint directory."""
JOB_FILE_LIMIT = 64 << 10

NOTICE_NAME = "notice.json"
"""The notice file in a job's directory (its path is in the job's environment)."""
ACK_NAME = "notice.json.ack"
"""The job's acknowledgement of the notice: its final save is durable (or failed)."""
SAVED_NAME = "saved.json"
"""The job's record of its latest durable save (the agent reports each new one)."""
PID_NAME = "pid"
"""Where a runner records its job's host pid: an agent restart finds the job again by it."""


@dataclass(frozen=True, slots=True)
class JobUser:
    """Who one job runs as. ``dedicated``: this uid runs nothing but this job, so stopping the
    job may kill every process of the uid."""

    uid: int
    gid: int
    dedicated: bool

    @property
    def root(self) -> bool:
        return self.uid == 0


class JobUsers:
    """The node's policy for job users (``--job-user``).

    - ``auto`` (default): as root, a dedicated uid per job and a gid per tenant (see the module
      docstring); not as root, the agent's own user — jobs are then not isolated (a warning).
    - a user name or uid (``nobody``): every job runs as that user. Weaker: jobs of different
      tenants share a uid, so one could read another's ``/proc/<pid>/environ`` and a job that
      leaves its process group is found again only by its environment.

    Example::

        >>> users = JobUsers("auto", uid_base=200_000, euid=0)
        >>> users.for_job(allocation_id=7, tenant_id=3)
        JobUser(uid=200007, gid=200003, dedicated=True)
        >>> JobUsers("auto", euid=1000, egid=1000).for_job(allocation_id=7, tenant_id=3)
        JobUser(uid=1000, gid=1000, dedicated=False)
    """

    def __init__(
        self,
        spec: str = "auto",
        *,
        uid_base: int | None = None,
        euid: int | None = None,
        egid: int | None = None,
    ) -> None:
        if uid_base is None:  # the agent's environment, else the default
            value = os.environ.get(UID_BASE_ENV) or str(UID_BASE)
            if not value.isdigit():
                raise ValueError(f"{UID_BASE_ENV} must be a whole number, got {value!r}")
            uid_base = int(value)
        if not 1000 <= uid_base <= 2**31 - UID_RANGE:
            raise ValueError(f"the job uid base must be in [1000, 2^31 - {UID_RANGE}]")
        self.spec = spec
        self.uid_base = uid_base
        self.euid = os.geteuid() if euid is None else euid
        self.egid = os.getegid() if egid is None else egid
        self._named: JobUser | None = None
        if spec != "auto":
            self._named = _named_user(spec)
            if self.euid != 0 and self._named.uid != self.euid:
                raise ValueError(
                    f"--job-user {spec}: only an agent running as root can run jobs as another user"
                )

    @property
    def isolated(self) -> bool:
        """Whether jobs run as a user other than the agent's (and other than root)."""
        if self.euid != 0:
            return False
        return self._named is None or not self._named.root

    def for_job(self, *, allocation_id: int, tenant_id: int | None) -> JobUser:
        if self._named is not None:
            return self._named
        if self.euid != 0:
            return JobUser(self.euid, self.egid, dedicated=False)
        uid = self.uid_base + allocation_id % UID_RANGE
        # an assignment without its tenant (an older market): the job's own group
        gid = uid if tenant_id is None else self.uid_base + tenant_id
        return JobUser(uid, gid, dedicated=True)

    def describe(self) -> str:
        if not self.isolated:
            return "every job runs as the agent's user" + (" (root)" if self.euid == 0 else "")
        if self._named is not None:
            return f"every job runs as uid {self._named.uid} (shared by all jobs)"
        return f"each job runs as its own uid from {self.uid_base}, one gid per tenant"


def _named_user(spec: str) -> JobUser:
    try:
        entry = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except KeyError:
        if spec.isdigit():  # a uid with no passwd entry: its own group
            return JobUser(int(spec), int(spec), dedicated=False)
        raise ValueError(f"--job-user {spec!r}: no such user (or 'auto')") from None
    return JobUser(entry.pw_uid, entry.pw_gid, dedicated=False)


# ---------------------------------------------------------------- checkpoint locations


def is_local_url(url: str) -> bool:
    """A checkpoint URL the checkpoint library reads as a local path
    (docs/operators/architecture.md#design-5)."""
    return urlparse(url).scheme in ("", "file")


def tenant_checkpoint_dir(root: Path, tenant_id: int | None, bid_id: int) -> Path:
    """The host directory of a tenant's local checkpoints under the operator's root (one per
    tenant: a run resumed on an on-demand bid must find its spot bid's checkpoints)."""
    return Path(root) / (tenant_dir_name(tenant_id) if tenant_id is not None else f"bid-{bid_id}")


def prepare_job_dirs(workdir: Path, checkpoints: Path | None, user: JobUser, chown: bool) -> None:
    """Create the allocation's directory (the job's, 0700) and its tenant's checkpoint
    directory (root:tenant gid, 2770). Without ``chown`` (no isolation) both are plain."""
    workdir.mkdir(parents=True, exist_ok=True)
    if checkpoints is not None:
        with contextlib.suppress(FileExistsError):  # the root: traverse, not list
            checkpoints.parent.mkdir(mode=0o711, parents=True)
        with contextlib.suppress(FileExistsError):
            checkpoints.mkdir(mode=0o700)
    if not chown:
        return
    _not_a_link(workdir)
    os.chown(workdir, user.uid, user.gid)
    os.chmod(workdir, 0o700)
    if checkpoints is not None:
        _not_a_link(checkpoints)
        os.chown(checkpoints, 0, user.gid)
        os.chmod(checkpoints, 0o2770)


def retire_workdir(workdir: Path) -> None:
    """After the job: the directory back to root, so a later job that happens to get the same
    uid cannot read what this one left."""
    with contextlib.suppress(OSError):
        _not_a_link(workdir)
        os.chown(workdir, 0, 0)
        os.chmod(workdir, 0o700)


def _not_a_link(path: Path) -> None:
    if path.is_symlink():
        raise PermissionError(f"{path} is a symbolic link; refusing to use it")


def unreachable(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that users other than its owner cannot
    traverse (no ``o+x``), or None: a job's uid must reach its files by absolute path."""
    path = Path(path).absolute()
    for directory in [*reversed(path.parents), path]:
        try:
            mode = directory.stat().st_mode
        except FileNotFoundError:
            return None  # created later, by the agent, traversable
        if not mode & stat.S_IXOTH:
            return directory
    return None


# ---------------------------------------------------------------- files in the job's directory


def _read_small(path: Path) -> bytes | None:
    """At most ``JOB_FILE_LIMIT + 1`` bytes of a regular file; None if there is none. Never
    follows a link, never blocks on a FIFO; b"" for anything that is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return b""
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, JOB_FILE_LIMIT + 1)
    finally:
        os.close(fd)


def read_job_file(path: Path) -> dict | None:
    """A small JSON object the job wrote, or None if there is none (yet); anything else (a
    link, a FIFO, a huge file, not an object) reads as ``{"invalid": True}``."""
    data = _read_small(path)
    if data is None:
        return None
    try:
        value = json.loads(data) if len(data) <= JOB_FILE_LIMIT else None
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"invalid": True}


def read_pid(path: Path) -> int | None:
    """The pid the agent recorded in a job's directory, or None."""
    data = _read_small(path)
    try:
        return int(data) if data else None
    except ValueError:
        return None


def write_job_file(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` in a directory the job may own: a fresh temporary file
    (``O_EXCL``, no link followed), then a rename over whatever ``path`` is."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), mode)  # by descriptor: the job may swap ``tmp`` for a link
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_job_log(path: Path) -> int:
    """The job's log for appending, as a descriptor the child inherits; a link or a file with
    other names planted in its place is replaced by a fresh file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        path.unlink()
        fd = os.open(path, flags, 0o640)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        path.unlink()
        fd = os.open(path, flags | os.O_EXCL, 0o640)
    os.set_blocking(fd, True)
    return fd


# ---------------------------------------------------------------- finding a job's processes


def uids_in_use() -> set[int]:
    """The real uids of every live process on the host. A zombie is not live: it runs
    nothing, holds nothing, and under a PID 1 that never reaps (a container without an init)
    it would block its uid for good."""
    uids = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = dict(
                line.split(":", 1)
                for line in Path(entry.path, "status").read_text().splitlines()
                if ":" in line
            )
            if fields["State"].split()[0] != "Z":
                uids.add(int(fields["Uid"].split()[0]))
    return uids


def job_marker(workdir: Path) -> bytes:
    """What names one job in its processes' environments: its notice file's path, which is
    under this agent's own state directory. Not the allocation id: every market counts from
    1, and another agent on the host (another market's, a test's) may run an allocation 1."""
    return f"{JOB_ENV.NOTICE_FILE}={workdir / NOTICE_NAME}".encode()


def job_processes(user: JobUser, marker: bytes) -> list[int]:
    """Live processes of a job: every process of its uid when the uid is the job's own,
    otherwise those of its uid whose environment holds the job's ``marker`` (a process that
    left the group keeps its environment unless it replaced it)."""
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            status = Path(entry.path, "status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("State", "").split()[:1] == ["Z"]:
                continue  # a zombie: dead already, waits for its parent
            if user.uid not in {int(u) for u in fields.get("Uid", "").split()}:
                continue
            if not user.dedicated:
                environ = Path(entry.path, "environ").read_bytes().split(b"\0")
                if marker not in environ:
                    continue
        except (OSError, ValueError):
            continue  # gone meanwhile
        found.append(int(entry.name))
    return found


def kill_job_processes(user: JobUser, workdir: Path, rounds: int = 50) -> int:
    """SIGKILL every process of the job of ``workdir``, again until none is left (one forking
    as we go is found in the next round); returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        pids = job_processes(user, job_marker(workdir))
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
    else:
        logger.error("%s: processes of uid %s survive", workdir.name, user.uid)
    return killed
