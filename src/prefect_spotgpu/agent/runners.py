"""Runners: how the agent starts, signals and stops a job (a local process or a container).

Signals (DESIGN §4): the notice is SIGUSR1 to the job's *main process only* — never its group:
SIGUSR1's default action is to terminate, so every process without a handler (DataLoader
workers, wrappers) would die. The stop at the end of a notice is SIGTERM to the whole group, a
grace period, then SIGKILL to the group and to every other process of the job (its own uid, see
``isolation``): a process that left the group with ``setsid`` is stopped too.

Jobs are hostile (DESIGN §7). A process job gets a clean environment (:func:`process_environment`)
and, under root, a user of its own. A container gets no host path a tenant chose: only the
allocation's directory (``/spotgpu``) and its tenant's checkpoint directory under the operator's
checkpoint root (``/spotgpu/checkpoints``); no new privileges, no capabilities, a non-root user,
a pids limit and optionally a memory limit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prefect_spotgpu.agent.isolation import (
    CONTAINER_CHECKPOINTS,
    NOTICE_NAME,
    JobUser,
    JobUsers,
    is_local_url,
    job_marker,
    kill_job_processes,
    open_job_log,
    prepare_job_dirs,
    retire_workdir,
    tenant_checkpoint_dir,
    uids_in_use,
    write_job_file,
)
from prefect_spotgpu.checkpoint.checkpointer import ACK_FILE_ENV, NOTICE_FILE_ENV, SAVED_FILE_ENV

logger = logging.getLogger("prefect_spotgpu.agent")

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
CHECKPOINT_URL_ENV = "SPOTGPU_CHECKPOINT_URL"


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

    @property
    def notice_file(self) -> Path:
        return self.workdir / NOTICE_NAME

    @property
    def ack_file(self) -> Path:
        return self.workdir / "notice.json.ack"

    @property
    def saved_file(self) -> Path:
        return self.workdir / "saved.json"

    def job_variables(self, *, workdir: str, checkpoint_url: str | None) -> dict[str, str]:
        """The ``SPOTGPU_*`` variables, with the paths as the job sees them."""
        env = {
            "SPOTGPU_ALLOCATION_ID": str(self.allocation_id),
            "SPOTGPU_ALLOCATION_EPOCH": str(self.epoch),
            "SPOTGPU_BID_ID": str(self.bid_id),
            NOTICE_FILE_ENV: f"{workdir}/notice.json",
            ACK_FILE_ENV: f"{workdir}/notice.json.ack",
            SAVED_FILE_ENV: f"{workdir}/saved.json",
            "SPOTGPU_CHECKPOINT_KEY": self.checkpoint_key,
        }
        if checkpoint_url:
            env[CHECKPOINT_URL_ENV] = checkpoint_url
        return env


@dataclass
class JobHandle:
    request: JobRequest
    pid: int
    started_at: float
    process: subprocess.Popen | None = None
    container_id: str | None = None
    signalled_at: float | None = None
    user: JobUser | None = None
    extra: dict = field(default_factory=dict)

    def poll(self) -> int | None:
        if self.process is not None:
            return self.process.poll()
        return None if _alive(self.pid) else -1


class Runner(Protocol):
    """What the agent needs of a runner; ``kill_stale`` is for reconciliation after a restart
    (a job of an earlier agent run, known by its allocation and recorded pid)."""

    name: str

    def start(self, request: JobRequest) -> JobHandle: ...

    def notice(self, handle: JobHandle, deadline: float) -> None: ...

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None: ...

    def kill_stale(self, allocation_id: int, pid: int, workdir: Path) -> bool: ...


def write_notice(request: JobRequest, deadline: float) -> None:
    """The notice file, written atomically, that code in any process of the job can see."""
    notice = {"deadline": deadline, "allocation_id": request.allocation_id}
    write_job_file(request.notice_file, json.dumps(notice))


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
        raise ValueError(f"checkpoint URL {url!r} refused: give a path or s3://bucket/prefix")
    host = tenant_checkpoint_dir(root, request.tenant_id, request.bid_id)
    return host, seen_at or str(host)


def process_environment(request: JobRequest, checkpoint_url: str | None) -> dict[str, str]:
    """A process job's whole environment: safe defaults, the job's own variables, then the
    GPUs and the ``SPOTGPU_*`` variables — nothing of the agent's (its token included)."""
    workdir = str(request.workdir)
    return {
        "PATH": f"{Path(sys.executable).parent}:{SAFE_PATH}",
        "HOME": workdir,
        "LANG": os.environ.get("LANG") or "C.UTF-8",
        "PREFECT_HOME": f"{workdir}/.prefect",
        **request.env,
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in request.gpu_indices),
        **request.job_variables(workdir=workdir, checkpoint_url=checkpoint_url),
    }


def _resolve_python(command: list[str]) -> list[str]:
    """A process job's ``python`` is the agent's own interpreter (its environment has the
    packages the agent was installed with); any other program is taken as given."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command


class ProcessRunner:
    """Jobs as local processes, each the leader of its own process group (the default, and
    the single-tenant choice: see ``isolation`` for what it isolates under root).

    ``checkpoint_root``: when given, local checkpoint URLs become the tenant's directory
    under it (the agent gives one under root isolation); otherwise they are kept.
    """

    name = "process"

    def __init__(
        self, *, users: JobUsers | None = None, checkpoint_root: Path | None = None
    ) -> None:
        self.users = users or JobUsers()
        self.checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        if not self.users.isolated:
            logger.warning("process runner: jobs are not isolated (%s)", self.users.describe())

    def start(self, request: JobRequest) -> JobHandle:
        user = self.users.for_job(allocation_id=request.allocation_id, tenant_id=request.tenant_id)
        if user.dedicated and user.uid in uids_in_use():
            # a live job of an allocation id equal modulo the range: never share a uid (the
            # agent reports this allocation failed; the market places the bid again)
            raise ValueError(f"job uid {user.uid} is in use by another process")
        host_dir, url = checkpoint_location(request, self.checkpoint_root)
        prepare_job_dirs(request.workdir, host_dir, user, chown=self.users.isolated)
        for stale in (request.notice_file, request.ack_file, request.saved_file):
            stale.unlink(missing_ok=True)
        switch = {}
        if self.users.isolated:
            switch = {"user": user.uid, "group": user.gid, "extra_groups": [], "umask": 0o007}
        log = open_job_log(request.workdir / "job.log")
        try:
            process = subprocess.Popen(
                _resolve_python(request.command),
                env=process_environment(request, url),
                cwd=request.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **switch,
            )
        finally:
            os.close(log)
        return JobHandle(request, process.pid, time.time(), process=process, user=user)

    def notice(self, handle: JobHandle, deadline: float) -> None:
        try:
            write_notice(handle.request, deadline)  # (fails if the job put a directory there)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGUSR1)  # the main process only
            handle.signalled_at = time.time()

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None:
        """SIGTERM to the job's group, SIGKILL after ``grace`` seconds to the group and to
        every other process of the job."""
        _signal_group(handle.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and handle.poll() is None:
            time.sleep(0.02)
        _signal_group(handle.pid, signal.SIGKILL)
        if handle.user is not None:
            kill_job_processes(handle.user, handle.request.workdir)
        if handle.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                handle.process.wait(timeout=5)
        if self.users.isolated:
            retire_workdir(handle.request.workdir)

    def kill_stale(self, allocation_id: int, pid: int, workdir: Path) -> bool:
        """SIGKILL what is left of an earlier run's job in ``workdir``: its group (if ``pid``
        still is that job) and every other process of it (the uid depends on the allocation
        only)."""
        killed = _kill_group_if_job(pid, workdir)
        user = self.users.for_job(allocation_id=allocation_id, tenant_id=None)
        return kill_job_processes(user, workdir) > 0 or killed


class DockerRunner:
    """Jobs as containers, built the way prefect-docker builds them (docker SDK): the
    multi-tenant runner.

    ``checkpoint_root``: the operator's directory for local checkpoints (one directory per
    tenant is mounted at ``/spotgpu/checkpoints``); without one, local checkpoint URLs are
    refused. ``pids_limit`` and ``memory`` (Docker's ``mem_limit``: ``"64g"``; None: no limit)
    bound each container.
    """

    name = "docker"

    def __init__(
        self,
        client=None,
        *,
        users: JobUsers | None = None,
        checkpoint_root: Path | None = None,
        pids_limit: int = 4096,
        memory: str | None = None,
    ) -> None:
        self._client = client
        self.users = users or JobUsers()
        self.checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        self.pids_limit = pids_limit
        self.memory = memory

    @property
    def client(self):
        if self._client is None:
            import docker

            self._client = docker.from_env()
        return self._client

    def container_spec(self, request: JobRequest) -> dict:
        """The keyword arguments of ``client.containers.run`` for this job: mounts only the
        allocation's directory and the tenant's checkpoint directory, whatever the job says."""
        import docker

        if not request.image:
            raise ValueError("the Docker runner needs a job image")
        user = self.users.for_job(allocation_id=request.allocation_id, tenant_id=request.tenant_id)
        if user.root:
            raise ValueError("a container never runs as root: use --job-user auto or a user")
        if (
            request.checkpoint_url
            and is_local_url(request.checkpoint_url)
            and self.checkpoint_root is None
        ):
            raise ValueError("local checkpoints need the agent's --checkpoint-root")
        host_dir, url = checkpoint_location(
            request, self.checkpoint_root, seen_at=CONTAINER_CHECKPOINTS
        )
        env = {
            "HOME": "/spotgpu",
            "PREFECT_HOME": "/spotgpu/.prefect",
            **request.env,
            **request.job_variables(workdir="/spotgpu", checkpoint_url=url),
            # last: neither the bid nor the image's ENV widens the GPUs the device request
            # gives (the NVIDIA toolkit may honour this variable in unprivileged containers)
            "NVIDIA_VISIBLE_DEVICES": ",".join(str(i) for i in request.gpu_indices),
        }
        if not url:  # no checkpoint storage: none the job's own variables may name either
            env.pop(CHECKPOINT_URL_ENV, None)
        volumes = {str(request.workdir): {"bind": "/spotgpu", "mode": "rw"}}
        if host_dir is not None:
            volumes[str(host_dir)] = {"bind": CONTAINER_CHECKPOINTS, "mode": "rw"}
        spec = {
            "image": request.image,
            "command": request.command,
            "environment": env,
            "detach": True,
            "init": False,  # the job is PID 1: SIGUSR1 reaches it, not a wrapper
            "name": f"spotgpu-alloc-{request.allocation_id}",
            "labels": {
                "io.spotgpu.allocation-id": str(request.allocation_id),
                "io.spotgpu.bid-id": str(request.bid_id),
                "io.spotgpu.epoch": str(request.epoch),
            },
            "volumes": volumes,
            "device_requests": [
                docker.types.DeviceRequest(
                    device_ids=[str(i) for i in request.gpu_indices], capabilities=[["gpu"]]
                )
            ],
            "stop_signal": "SIGTERM",
            "user": f"{user.uid}:{user.gid}",
            "privileged": False,
            "security_opt": ["no-new-privileges"],
            "cap_drop": ["ALL"],
            "pids_limit": self.pids_limit,
        }
        if self.memory:
            spec["mem_limit"] = self.memory
        return spec

    def start(self, request: JobRequest) -> JobHandle:
        spec = self.container_spec(request)
        user = self.users.for_job(allocation_id=request.allocation_id, tenant_id=request.tenant_id)
        host_dir, _ = checkpoint_location(request, self.checkpoint_root)
        prepare_job_dirs(request.workdir, host_dir, user, chown=self.users.euid == 0)
        for stale in (request.notice_file, request.ack_file, request.saved_file):
            stale.unlink(missing_ok=True)
        container = self.client.containers.run(**spec)
        container.reload()
        return JobHandle(
            request,
            int(container.attrs["State"]["Pid"]),
            time.time(),
            container_id=container.id,
            user=user,
        )

    def notice(self, handle: JobHandle, deadline: float) -> None:
        write_notice(handle.request, deadline)
        self.client.containers.get(handle.container_id).kill(signal="SIGUSR1")  # PID 1 only
        handle.signalled_at = time.time()

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None:
        container = self.client.containers.get(handle.container_id)
        container.stop(timeout=int(grace))
        container.remove(force=True)
        if self.users.euid == 0:
            retire_workdir(handle.request.workdir)

    def kill_stale(self, allocation_id: int, pid: int, workdir: Path) -> bool:
        """Remove an earlier run's container of this allocation, if there is one."""
        import docker

        try:
            container = self.client.containers.get(f"spotgpu-alloc-{allocation_id}")
        except docker.errors.NotFound:
            return False
        container.remove(force=True)
        return True


def _kill_group_if_job(pid: int, workdir: Path) -> bool:
    """SIGKILL the process group of ``pid`` if it still is the job of ``workdir``.

    A recorded pid may have been reused by an unrelated process after a reboot or a long
    outage: the job's environment (:func:`job_marker`) must match before we kill.
    """
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone (or not ours to read)
    if job_marker(workdir) not in environ:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
        return True
    return False


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


RUNNERS = {"process": ProcessRunner, "docker": DockerRunner}


def get_runner(name: str, **options) -> Runner:
    """The runner called ``name``, made with ``options`` (its keyword arguments)."""
    try:
        runner = RUNNERS[name]
    except KeyError:
        raise ValueError(
            f"runner {name!r} is not known; valid runners: {', '.join(sorted(RUNNERS))}"
        ) from None
    return runner(**options)
