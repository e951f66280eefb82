"""Runners: how the agent starts, signals and stops a job (a local process or a container).

Signals (DESIGN §4): the notice is SIGUSR1 to the job's *main process only* — never its group:
SIGUSR1's default action is to terminate, so every process without a handler (DataLoader
workers, wrappers) would die. The stop at the end of a notice is SIGTERM to the whole group, a
grace period, then SIGKILL to the group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


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

    @property
    def notice_file(self) -> Path:
        return self.workdir / "notice.json"

    @property
    def ack_file(self) -> Path:
        return self.workdir / "notice.json.ack"

    def environment(self) -> dict[str, str]:
        env = {
            **self.env,
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in self.gpu_indices),
            "SPOTGPU_ALLOCATION_ID": str(self.allocation_id),
            "SPOTGPU_ALLOCATION_EPOCH": str(self.epoch),
            "SPOTGPU_BID_ID": str(self.bid_id),
            "SPOTGPU_NOTICE_FILE": str(self.notice_file),
            "SPOTGPU_ACK_FILE": str(self.ack_file),
            "SPOTGPU_CHECKPOINT_KEY": self.checkpoint_key,
        }
        if self.checkpoint_url:
            env["SPOTGPU_CHECKPOINT_URL"] = self.checkpoint_url
        return env


@dataclass
class JobHandle:
    request: JobRequest
    pid: int
    started_at: float
    process: subprocess.Popen | None = None
    container_id: str | None = None
    signalled_at: float | None = None
    extra: dict = field(default_factory=dict)

    def poll(self) -> int | None:
        if self.process is not None:
            return self.process.poll()
        return None if _alive(self.pid) else -1


def write_notice(request: JobRequest, deadline: float) -> None:
    """The notice file, written atomically, that code in any process of the job can see."""
    tmp = request.notice_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"deadline": deadline, "allocation_id": request.allocation_id}))
    os.replace(tmp, request.notice_file)


def _resolve_python(command: list[str]) -> list[str]:
    """A process job's ``python`` is the agent's own interpreter (its environment has the
    packages the agent was installed with); any other program is taken as given."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command


class ProcessRunner:
    """Jobs as local processes, each the leader of its own process group (the default)."""

    name = "process"

    def start(self, request: JobRequest) -> JobHandle:
        request.workdir.mkdir(parents=True, exist_ok=True)
        for stale in (request.notice_file, request.ack_file):
            stale.unlink(missing_ok=True)
        log = open(request.workdir / "job.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            process = subprocess.Popen(
                _resolve_python(request.command),
                env={**os.environ, **request.environment()},
                cwd=request.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        return JobHandle(request, process.pid, time.time(), process=process)

    def notice(self, handle: JobHandle, deadline: float) -> None:
        write_notice(handle.request, deadline)
        with contextlib.suppress(ProcessLookupError):
            os.kill(handle.pid, signal.SIGUSR1)  # the main process only
        handle.signalled_at = time.time()

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None:
        """SIGTERM to the job's group, then SIGKILL after ``grace`` seconds."""
        _signal_group(handle.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and handle.poll() is None:
            time.sleep(0.02)
        _signal_group(handle.pid, signal.SIGKILL)
        if handle.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                handle.process.wait(timeout=5)


class DockerRunner:
    """Jobs as containers, built the way prefect-docker builds them (docker SDK)."""

    name = "docker"

    def __init__(self, client=None) -> None:
        self._client = client

    @property
    def client(self):
        if self._client is None:
            import docker

            self._client = docker.from_env()
        return self._client

    def container_spec(self, request: JobRequest) -> dict:
        """The keyword arguments of ``client.containers.run`` for this job."""
        import docker

        if not request.image:
            raise ValueError("the Docker runner needs a job image")
        env = request.environment()
        env["SPOTGPU_NOTICE_FILE"] = "/spotgpu/notice.json"
        env["SPOTGPU_ACK_FILE"] = "/spotgpu/notice.json.ack"
        env.pop("CUDA_VISIBLE_DEVICES")  # the device request exposes exactly these GPUs
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
            "volumes": {str(request.workdir): {"bind": "/spotgpu", "mode": "rw"}},
            "device_requests": [
                docker.types.DeviceRequest(
                    device_ids=[str(i) for i in request.gpu_indices], capabilities=[["gpu"]]
                )
            ],
            "stop_signal": "SIGTERM",
        }
        if request.checkpoint_url and request.checkpoint_url.startswith(("/", "file://")):
            path = request.checkpoint_url.removeprefix("file://")
            spec["volumes"][path] = {"bind": path, "mode": "rw"}
        return spec

    def start(self, request: JobRequest) -> JobHandle:
        request.workdir.mkdir(parents=True, exist_ok=True)
        container = self.client.containers.run(**self.container_spec(request))
        container.reload()
        return JobHandle(
            request, int(container.attrs["State"]["Pid"]), time.time(), container_id=container.id
        )

    def notice(self, handle: JobHandle, deadline: float) -> None:
        write_notice(handle.request, deadline)
        self.client.containers.get(handle.container_id).kill(signal="SIGUSR1")  # PID 1 only
        handle.signalled_at = time.time()

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None:
        container = self.client.containers.get(handle.container_id)
        container.stop(timeout=int(grace))
        container.remove(force=True)


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


def get_runner(name: str):
    try:
        return RUNNERS[name]()
    except KeyError:
        raise ValueError(
            f"runner {name!r} is not known; valid runners: {', '.join(sorted(RUNNERS))}"
        ) from None
