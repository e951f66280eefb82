"""The Docker runner: each job a container, built the way prefect-docker builds them (docker
SDK); the multi-tenant runner.

Jobs are hostile (docs/operators/architecture.md#design-7). A container gets no host path a tenant
chose: only the allocation's directory (``/spotgpu``) and its tenant's checkpoint directory under
the operator's checkpoint root (``/spotgpu/checkpoints``); no new privileges, no capabilities, a
non-root user, a pids limit and optionally a memory limit. The job is the container's PID 1 (no
init), so the notice's SIGUSR1 reaches it and no other process of the container. A container is
named after its allocation (:func:`container_name`) and labelled with it: ``reconcile`` finds an
earlier run's container by its label. The node's GPUs are given as a device request (``--gpus``)
when the host has the NVIDIA container toolkit; its output goes to the agent's log, line by line.

Its network: Docker's default bridge, or with ``job_subnet`` (``--job-subnet``) the node's job
network (``job_network``), at the address the market gave its allocation, reached only by its
gang's peers and reaching nothing of this host. A gang member runs only there: its peers on
other hosts reach it at that address.

A missing image is pulled by ``prepare`` (the agent calls it on a thread of its own: a pull may
take minutes), its progress told every ``PULL_REPORT_SECONDS`` (``pull``); ``start`` pulls one
still missing too, without progress. An image neither here nor pullable is
:class:`ImageUnavailable`, naming it; one its registry answers it does not have (404) is
:class:`ImageNotInRegistry`, the image's fault and not the node's (``start_failures``).
``local_images`` lists what the engine holds, for the heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prefect_spotgpu.agent.isolation import (
    CONTAINER_CHECKPOINTS,
    PID_NAME,
    JobUsers,
    is_local_url,
    prepare_job_dirs,
    retire_workdir,
)
from prefect_spotgpu.agent.runners.job_network import JobNetwork
from prefect_spotgpu.agent.runners.pull import PullProgress
from prefect_spotgpu.agent.runners.runner import (
    MOST_NODE_IMAGES,
    MOST_REFERENCE_CHARS,
    JobFault,
    JobHandle,
    JobRequest,
    Progress,
    checkpoint_location,
    clear_job_files,
    last_line_of,
    record_pid,
    write_notice,
)
from prefect_spotgpu.protocol import IMAGE_REFERENCE_PATTERN, JOB_ENV, PULL_REPORT_SECONDS, Runner

WORKDIR = "/spotgpu"
"""Where a container sees its allocation's directory (its HOME)."""
ALLOCATION_LABEL = "io.spotgpu.allocation-id"
TAIL_LINES = 20
"""How many of a container's last log lines are read for its last non-empty one."""

logger = logging.getLogger("prefect_spotgpu.agent.jobs")


class ImageUnavailable(RuntimeError):
    """The job's image is neither on this node nor pullable: the message names it."""


class ImageNotInRegistry(ImageUnavailable, JobFault):
    """The image's registry answered that it has no such image (the engine's 404: "manifest
    unknown", "repository does not exist"). Every node gets that answer, so the failure is
    the image's (a catalogue entry gone from its registry), not this node's: it must not
    drain the node, nor, one node after another, the fleet. A registry out of reach (DNS, a
    refused connection, a 5xx) stays :class:`ImageUnavailable`, the node's: its network may
    be the cause. (A private registry that refuses this node's credentials also answers 404;
    the run fails naming the image and the registry's answer, and the node keeps its work.)"""


@dataclass(eq=False, kw_only=True)
class ContainerJob(JobHandle):
    """A container job: its ``ref`` is the container's id; ``pid`` is its PID 1 on the host
    (the job runs while that process lives)."""

    pid: int


def container_name(allocation_id: int) -> str:
    return f"spotgpu-alloc-{allocation_id}"


class DockerRunner:
    """Jobs as containers.

    ``checkpoint_root``: the operator's directory for local checkpoints (one directory per
    tenant is mounted at ``/spotgpu/checkpoints``); without one, local checkpoint URLs are
    refused. ``pids_limit`` and ``memory`` (Docker's ``mem_limit``: ``"64g"``; None: no limit)
    bound each container. ``gpu_devices``: give the node's GPUs as a device request (None:
    when the NVIDIA container toolkit is installed; without it Docker refuses the request).
    ``default_image``: the image a bid without one (``image: process``, "the node's own
    environment") runs in; None: such bids fail here, naming the option. ``job_subnet``: the
    subnet of the node's job network (None: Docker's default bridge, and no gang member).
    """

    name = Runner.DOCKER.value

    def __init__(
        self,
        client=None,
        *,
        users: JobUsers | None = None,
        checkpoint_root: Path | None = None,
        pids_limit: int = 4096,
        memory: str | None = None,
        gpu_devices: bool | None = None,
        default_image: str | None = None,
        job_subnet: str | None = None,
    ) -> None:
        self._client = client
        self.default_image = default_image
        self.job_network = None if job_subnet is None else JobNetwork(job_subnet)
        self.users = users or JobUsers()
        self.checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        self.pids_limit = pids_limit
        self.memory = memory
        if gpu_devices is None:
            gpu_devices = shutil.which("nvidia-container-cli") is not None
            if not gpu_devices:  # (docs/operators/gpu-hosts.md)
                logger.warning(
                    "docker runner: nvidia-container-cli is not on PATH, so containers get no "
                    "GPUs: install the NVIDIA Container Toolkit on this host"
                )
        self.gpu_devices = gpu_devices

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

        image = self.image_for(request)
        if not image:
            raise JobFault(
                "the Docker runner needs a job image: the bid asks for none (image 'process') "
                "and this node has no default (spotgpu agent start --default-image)"
            )
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
        gang_defaults = {}
        if request.gang is not None and self.job_network is not None:  # (its one interface)
            gang_defaults = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
        env = {
            "HOME": WORKDIR,
            "PREFECT_HOME": f"{WORKDIR}/.prefect",
            **gang_defaults,
            **request.thread_default(),
            **request.env,
            **request.job_variables(workdir=WORKDIR, checkpoint_url=url),
            # last: neither the bid nor the image's ENV widens the GPUs the device request
            # gives (the NVIDIA toolkit may honour this variable in unprivileged containers)
            "NVIDIA_VISIBLE_DEVICES": ",".join(str(i) for i in request.gpu_indices),
        }
        if not url:  # no checkpoint storage: none the job's own variables may name either
            env.pop(JOB_ENV.CHECKPOINT_URL, None)
        volumes = {str(request.workdir): {"bind": WORKDIR, "mode": "rw"}}
        if host_dir is not None:
            volumes[str(host_dir)] = {"bind": CONTAINER_CHECKPOINTS, "mode": "rw"}
        spec = {
            "image": image,
            "command": request.command,
            "environment": env,
            "detach": True,
            "init": False,  # the job is PID 1: SIGUSR1 reaches it, not a wrapper
            "name": container_name(request.allocation_id),
            "labels": {
                ALLOCATION_LABEL: str(request.allocation_id),
                "io.spotgpu.bid-id": str(request.bid_id),
                "io.spotgpu.epoch": str(request.epoch),
            },
            "volumes": volumes,
            "stop_signal": "SIGTERM",
            "user": f"{user.uid}:{user.gid}",
            "privileged": False,
            "security_opt": ["no-new-privileges"],
            "cap_drop": ["ALL"],
            "pids_limit": self.pids_limit,
        }
        if self.job_network is not None:
            if request.job_address is None:
                raise ValueError(
                    "the market gave this job no address on the node's job network (was the "
                    "agent restarted with --job-subnet while it held the allocation?)"
                )
            spec["network"] = self.job_network.name
            spec["networking_config"] = self.job_network.endpoint(self.client, request.job_address)
        if self.memory:
            spec["mem_limit"] = self.memory
        if self.gpu_devices and request.gpu_indices:
            spec["device_requests"] = [
                docker.types.DeviceRequest(
                    device_ids=[str(i) for i in request.gpu_indices], capabilities=[["gpu"]]
                )
            ]
        return spec

    def start(self, request: JobRequest) -> ContainerJob:
        if request.gang is not None and self.job_network is None:  # (the market places none)
            raise ValueError(
                "a gang member runs in a container only on a job network, where its peers on "
                "other hosts reach it: start this agent with --job-subnet "
                "(docs/operators/gpu-hosts.md#job-networks)"
            )
        spec = self.container_spec(request)
        if self.job_network is not None:
            self.job_network.ensure(self.client)
            peers = list(request.gang.peers) if request.gang is not None else []
            self.job_network.admit(request.allocation_id, request.job_address, peers)
        user = self.users.for_job(allocation_id=request.allocation_id, tenant_id=request.tenant_id)
        host_dir, _ = checkpoint_location(request, self.checkpoint_root)
        prepare_job_dirs(request.workdir, host_dir, user, chown=self.users.euid == 0)
        clear_job_files(request)
        self._remove(request.allocation_id)  # an earlier try's container holds the name
        try:
            container = self._run(spec)
        except Exception as exc:  # the job's own command, not there in its image: its fault
            if command_refused(str(getattr(exc, "explanation", None) or exc)):
                raise JobFault(str(exc)) from exc
            raise
        container.reload()
        pid = int(container.attrs["State"]["Pid"])
        record_pid(request, pid)  # (``reconcile`` looks for a container where one ran)
        threading.Thread(
            target=_forward_logs, args=(container, request.allocation_id), daemon=True
        ).start()
        return ContainerJob(request, container.id, time.time(), pid=pid)

    def image_for(self, request: JobRequest) -> str | None:
        """The image the job runs in: the bid's, else this node's default (None: neither)."""
        return request.image or self.default_image

    def ready(self, request: JobRequest) -> bool:
        """Whether the job's image is on this node (a job without one fails in ``start``)."""
        image = self.image_for(request)
        return not image or self._has_image(image)

    def _has_image(self, image: str) -> bool:
        import docker

        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            return False
        return True

    def prepare(self, request: JobRequest, progress: Progress) -> None:
        """Pull the job's image if it is not on this node, telling ``progress`` how far."""
        if not self.ready(request):
            self.pull(self.image_for(request), progress)

    def pull(self, image: str, progress: Progress) -> None:
        """Pull ``image`` with the engine's progress stream: ``progress`` gets a line when the
        first sizes are known, then at most every ``PULL_REPORT_SECONDS``, and a last
        ``pulled ...`` line. A failure is :class:`ImageUnavailable`, naming the image."""
        import docker
        import requests
        from docker.utils import parse_repository_tag

        began = last = time.monotonic()
        said = False
        counts = PullProgress(image)
        repository, tag = parse_repository_tag(image)
        try:
            stream = self.client.api.pull(repository, tag=tag, stream=True, decode=True)
            for message in stream:
                if "error" in message:
                    detail = (message.get("errorDetail") or {}).get("message")
                    raise _unavailable(image, detail or message["error"])
                counts.add(message)
                now = time.monotonic()
                if now - last >= PULL_REPORT_SECONDS or (not said and counts.downloaded):
                    progress(counts.line())
                    said, last = True, now
        except docker.errors.NotFound as exc:  # the registry's answer: it has no such image
            raise _unavailable(image, exc.explanation or exc, kind=ImageNotInRegistry) from None
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            raise _unavailable(image, getattr(exc, "explanation", None) or exc) from None
        progress(counts.done_line(seconds=time.monotonic() - began))

    def local_images(self) -> list[str]:
        """The references of the images on this engine (tags first, then digests) that a
        heartbeat may carry (``IMAGE_REFERENCE_PATTERN``), sorted, at most
        ``MOST_NODE_IMAGES``."""
        tags, digests = set(), set()
        for image in self.client.api.images():  # one call (``images.list`` inspects each)
            tags.update(image.get("RepoTags") or ())
            digests.update(image.get("RepoDigests") or ())
        fit = [
            r
            for r in [*sorted(tags), *sorted(digests - tags)]
            if len(r) <= MOST_REFERENCE_CHARS and re.fullmatch(IMAGE_REFERENCE_PATTERN, r)
        ]
        return sorted(fit[:MOST_NODE_IMAGES])

    def _run(self, spec: dict):
        """``containers.run``, pulling a missing image first; one that is neither here nor
        pullable is ``ImageUnavailable``, naming it (the agent reports the job failed)."""
        image = spec["image"]
        if not self._has_image(image):
            self.pull(image, lambda line: logger.info("%s", line))
        return self.client.containers.run(**spec)

    def notice(self, handle: JobHandle, deadline: float) -> None:
        write_notice(handle.request, deadline)
        self.client.containers.get(handle.ref).kill(signal="SIGUSR1")  # PID 1 only
        handle.signalled_at = time.time()

    def stop(self, handle: JobHandle, grace: float = 10.0) -> None:
        import docker

        container = self.client.containers.get(handle.ref)
        if grace > 0:
            container.stop(timeout=int(grace))
        else:  # the end of a notice: SIGKILL only (no Crashed state from the engine)
            with contextlib.suppress(docker.errors.APIError):  # (already exited)
                container.kill()
        container.remove(force=True)
        if self.job_network is not None:
            self.job_network.forget(handle.request.allocation_id)
        if self.users.euid == 0:
            retire_workdir(handle.request.workdir)

    def poll(self, handle: ContainerJob) -> int | None:
        """None while PID 1 lives; then the container's exit code (-1: it is gone)."""
        import docker

        if _alive(handle.pid):
            return None
        try:
            container = self.client.containers.get(handle.ref)
            container.reload()
        except docker.errors.NotFound:
            return -1
        state = container.attrs["State"]
        if state.get("Running"):  # PID 1's exit not yet recorded by the engine
            return None
        return int(state.get("ExitCode", -1))

    def last_line(self, handle: JobHandle) -> str | None:
        """The last non-empty line of the container's error output (of its last
        ``TAIL_LINES``), else of its standard output: the engine reads the two apart, so
        their order at the very end is not kept, and the error (a traceback's last line) is
        what a failed job's report needs."""
        import docker

        try:
            container = self.client.containers.get(handle.ref)
            for stream in ("stderr", "stdout"):
                wanted = {"stdout": stream == "stdout", "stderr": stream == "stderr"}
                line = last_line_of(container.logs(tail=TAIL_LINES, **wanted))
                if line:
                    return line
        except docker.errors.NotFound:
            pass
        return None

    def adopt(self, request: JobRequest, ref: str, job_ref: str) -> ContainerJob | None:
        """The container an agent handed over (``agent.handover``), running or exited (the
        engine keeps its exit code); None if it was removed."""
        import docker

        try:
            container = self.client.containers.get(ref)
        except docker.errors.NotFound:
            return None
        if container.labels.get(ALLOCATION_LABEL) != str(request.allocation_id):
            return None
        pid = int(container.attrs["State"].get("Pid") or 0)
        since = int(time.time())  # its output from now on: the last agent logged the rest
        threading.Thread(
            target=_forward_logs, args=(container, request.allocation_id, since), daemon=True
        ).start()
        return ContainerJob(request, container.id, time.time(), pid=pid)

    def reconcile(self, allocation_id: int, workdir: Path) -> bool:
        """Remove an earlier run's container of this allocation (found by its label), if one
        ran here."""
        found = self._remove(allocation_id)
        if self.job_network is not None:
            self.job_network.forget(allocation_id)
        (workdir / PID_NAME).unlink(missing_ok=True)
        return found

    def _remove(self, allocation_id: int) -> bool:
        import docker

        # sparse: the engine's list as it is (docker-py's full list inspects each container
        # after listing, and one removed meanwhile would fail the whole list with a 404)
        containers = self.client.containers.list(
            all=True, filters={"label": f"{ALLOCATION_LABEL}={allocation_id}"}, sparse=True
        )
        for container in containers:
            with contextlib.suppress(docker.errors.NotFound):  # (gone by itself meanwhile)
                container.remove(force=True)
        return bool(containers)


_COMMAND_REFUSED = re.compile(
    r'exec: "[^"]*": (?:stat [^:]*: )?'
    r"(?:executable file not found|no such file or directory|permission denied|exec format error)"
)


def command_refused(message: str) -> bool:
    """Whether the engine refused to start a container because of the job's own command (the
    program it names is not in its image, or not executable there), by its message.

    >>> command_refused('failed to create task for container: failed to create shim task: '
    ...     'OCI runtime create failed: runc create failed: unable to start container process: '
    ...     'exec: "trian.py": executable file not found in $PATH: unknown')
    True
    >>> command_refused("driver failed programming external connectivity: port in use")
    False
    """
    return _COMMAND_REFUSED.search(message) is not None


def _unavailable(image: str, why, kind: type[ImageUnavailable] = ImageUnavailable):
    return kind(f"image {image!r} is not on this node and could not be pulled: {why}")


def _forward_logs(container, allocation_id: int, since: int | None = None) -> None:
    """The container's output, line by line, to the agent's log (until it exits); ``since``
    (Unix seconds): only what it printed from then on (an adopted container's)."""
    try:
        for line in container.logs(stream=True, follow=True, since=since):
            text = line.decode(errors="replace").rstrip()
            if text:
                logger.info("allocation %s | %s", allocation_id, text)
    except Exception as exc:  # the container was removed: its output ends there
        logger.debug("allocation %s: logs ended: %s", allocation_id, exc)


def _alive(pid: int) -> bool:
    """Whether the host process ``pid`` lives. A container that exited before ``start`` read
    its state has pid 0, which is no process of its (``os.kill(0, 0)`` would ask about the
    agent's own process group, and say yes for ever)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
