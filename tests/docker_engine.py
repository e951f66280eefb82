"""A real Docker engine, job images and a real registry for the container tests.

``ensure_engine()`` answers with the engine already running, or starts ``dockerd`` (Debian's
``docker.io``: no systemd here) and waits for ``docker info``; ``stop()`` stops only an
engine this module started. ``job_image()`` builds, once per engine, the images the tests run:

- ``spotgpu-test-base:bookworm``: ``debootstrap --variant=minbase`` with Debian's python3 and
  numpy, imported as an image (``docker import``: nothing is pulled);
- ``spotgpu-test-job:<hash of the project's wheel>``: the base with this checkout's
  prefect-spotgpu unpacked from a wheel built here (``--no-deps``: the job side needs only
  the checkpoint library, the standard library and numpy);
- ``spotgpu-test-python:prefect-<version>``: a Python image as catalogue images are: the
  base with a venv holding this host's Prefect version (from PyPI, through the host's CA
  certificates: package traffic here passes an intercepting proxy; the host's pip
  configuration names local folders and is not copied);
- ``spotgpu-test-flow:<hash>``: that image made a job image by the repository's recipe,
  ``docker/job.Dockerfile`` (this checkout's wheel with its dependencies, and the test flow
  ``spot_flow.py`` at ``FLOWS``, the deployments' working directory).

No internet registry is reachable here: ``start_registry()`` runs Debian's ``docker-registry``
on a loopback port with its storage in a temporary directory (the engine trusts registries on
127.0.0.0/8 over plain HTTP), and ``push_pull_image()`` puts there an image the engine then
lacks: the job image plus a layer of random bytes, pushed, then removed from the engine, so a
pull of it fetches that layer (``forget_image`` removes it again before the next pull).

Each step says how long it took (``TIMINGS``), for the closing notes of the container work.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "spotgpu-test-base:bookworm"
JOB_REPOSITORY = "spotgpu-test-job"
FLOW_REPOSITORY = "spotgpu-test-flow"
PYTHON_REPOSITORY = "spotgpu-test-python"
FLOWS = "/opt/spotgpu-flows"
"""Where the flow image holds the test flow: the deployment's working directory."""
CA_DIR = Path("/usr/local/share/ca-certificates")
MIRROR = "http://deb.debian.org/debian"
TIMINGS: dict[str, float] = {}

BALLAST_BYTES = 320_000_000
"""The random (incompressible) layer of the pull test's image: big enough that its pull takes
a few seconds from a loopback registry, so its progress is reported more than once."""
REGISTRY = shutil.which("docker-registry") or "/usr/bin/docker-registry"

_started: subprocess.Popen | None = None


class EngineUnavailable(RuntimeError):
    """No Docker engine could be reached or started: the message says what is missing."""


def _docker(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, **kw)


def _answers() -> bool:
    try:
        return _docker("info", check=False, timeout=20).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


def ensure_engine(wait: float = 60.0) -> None:
    """A Docker engine that answers, started here if need be."""
    global _started
    if _answers():
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or shutil.which("docker") is None:
        raise EngineUnavailable(
            "no Docker engine: install Debian's docker.io (README's test command does)"
        )
    began = time.monotonic()
    log = open(Path(tempfile.gettempdir()) / "spotgpu-test-dockerd.log", "ab")  # noqa: SIM115
    _started = subprocess.Popen([dockerd], stdout=log, stderr=log, start_new_session=True)
    while time.monotonic() - began < wait:
        if _answers():
            TIMINGS["dockerd_start_seconds"] = round(time.monotonic() - began, 1)
            return
        if _started.poll() is not None:
            break
        time.sleep(0.5)
    raise EngineUnavailable(f"dockerd did not answer within {wait:.0f} s (see {log.name})")


def stop() -> None:
    """Stop the engine this module started (by its pid), if it did."""
    global _started
    if _started is not None and _started.poll() is None:
        _started.terminate()
        try:
            _started.wait(30)
        except subprocess.TimeoutExpired:
            _started.kill()
    _started = None


def _has_image(name: str) -> bool:
    return _docker("image", "inspect", name, check=False).returncode == 0


def base_image() -> str:
    if _has_image(BASE_IMAGE):
        return BASE_IMAGE
    if shutil.which("debootstrap") is None:
        raise EngineUnavailable("no debootstrap: install Debian's debootstrap")
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spotgpu-rootfs-") as rootfs:
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-numpy,ca-certificates",
                "bookworm",
                rootfs,
                MIRROR,
            ],
            check=True,
            capture_output=True,
        )
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True
        )
        tar.wait()
    TIMINGS["base_image_seconds"] = round(time.monotonic() - began, 1)
    return BASE_IMAGE


def _wheel(into: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", into, str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = Path(into).glob("*.whl")
    return wheel


def _build(name: str, context: str, dockerfile: str, timing: str, began: float) -> str:
    (Path(context) / "Dockerfile").write_text(dockerfile)
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    _docker("build", "-q", "-t", name, context, env=env)
    TIMINGS[timing] = round(time.monotonic() - began, 1)
    _drop_other_tags(name)
    return name


def _drop_other_tags(name: str) -> None:
    """Untag an earlier checkout's image of the same repository (its layers are shared)."""
    repository = name.split(":")[0]
    listed = _docker("images", repository, "--format", "{{.Repository}}:{{.Tag}}").stdout
    for line in listed.split():
        if line != name:
            _docker("rmi", line, check=False)


def job_image() -> str:
    """The job image of this checkout (built once per version of its code)."""
    base = base_image()
    with tempfile.TemporaryDirectory(prefix="spotgpu-image-") as context:
        began = time.monotonic()
        wheel = _wheel(context)
        name = f"{JOB_REPOSITORY}:{hashlib.sha256(wheel.read_bytes()).hexdigest()[:12]}"
        if _has_image(name):
            return name
        return _build(
            name,
            context,
            f"FROM {base}\n"
            f"COPY {wheel.name} /tmp/\n"
            f"RUN python3 -m zipfile -e /tmp/{wheel.name} /usr/local/lib/python3.11/dist-packages/"
            f" && rm /tmp/{wheel.name}\n",
            "job_image_seconds",
            began,
        )


def python_image() -> str:
    """A Python image as the catalogue's are: the base with a venv holding this host's
    Prefect version (from PyPI), ``python`` and ``pip`` first on the PATH."""
    from importlib.metadata import version

    base = base_image()
    name = f"{PYTHON_REPOSITORY}:prefect-{version('prefect')}"
    if _has_image(name):
        return name
    with tempfile.TemporaryDirectory(prefix="spotgpu-python-image-") as context:
        began = time.monotonic()
        certs = list(CA_DIR.glob("*.crt"))
        for cert in certs:
            shutil.copy(cert, context)
        return _build(
            name,
            context,
            f"FROM {base}\n"
            + ("COPY *.crt /usr/local/share/ca-certificates/\n" if certs else "")
            + "RUN update-ca-certificates >/dev/null && apt-get update -q"
            " && apt-get install -y -q --no-install-recommends python3-venv >/dev/null\n"
            "RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-cache-dir"
            f" prefect=={version('prefect')} numpy\n"
            "ENV PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin\n",
            "python_image_seconds",
            began,
        )


def flow_image() -> str:
    """The test flow's job image, made by the repository's recipe (``docker/job.Dockerfile``)
    from ``python_image()``: prefect-spotgpu from this checkout's wheel, with its
    dependencies, and ``tests/spot_flow.py`` at ``FLOWS``."""
    base = python_image()
    recipe = ROOT / "docker" / "job.Dockerfile"
    flow = ROOT / "tests" / "spot_flow.py"
    with tempfile.TemporaryDirectory(prefix="spotgpu-flow-image-") as context:
        began = time.monotonic()
        wheel = _wheel(str(Path(context) / "dist"))
        (Path(context) / "flows").mkdir()
        shutil.copy(flow, Path(context) / "flows")
        digest = hashlib.sha256(
            wheel.read_bytes() + flow.read_bytes() + recipe.read_bytes() + base.encode()
        ).hexdigest()[:12]
        name = f"{FLOW_REPOSITORY}:{digest}"
        if _has_image(name):
            return name
        shutil.copy(recipe, Path(context) / "Dockerfile")
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        _docker("build", "-q", "--build-arg", f"BASE={base}", "-t", name, context, env=env)
        TIMINGS["flow_image_seconds"] = round(time.monotonic() - began, 1)
        _drop_other_tags(name)
        return name


def bridge_gateway() -> str:
    """The host's address on Docker's default bridge: what a container reaches the host at."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True, text=True, check=True
    ).stdout
    return out.split("inet ", 1)[1].split("/", 1)[0]


def remove_job_containers() -> None:
    """Remove every job container (the agents' label): a test's agents are gone, and with
    them whoever would have stopped them."""
    ids = _docker("ps", "-aq", "--filter", "label=io.spotgpu.allocation-id").stdout.split()
    if ids:
        _docker("rm", "-f", *ids, check=False)


@dataclass
class Registry:
    """A running registry: ``address`` is ``127.0.0.1:PORT`` (an image reference's host)."""

    address: str
    process: subprocess.Popen
    storage: Path

    def stop(self) -> None:
        """Stop the registry (by its pid) and remove its storage."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        shutil.rmtree(self.storage, ignore_errors=True)


def start_registry(wait: float = 30.0) -> Registry:
    """A registry on a free loopback port, its storage a new temporary directory."""
    from prefect_spotgpu.cli.stack import free_port

    if not Path(REGISTRY).exists():
        raise EngineUnavailable("no registry: install Debian's docker-registry")
    storage = Path(tempfile.mkdtemp(prefix="spotgpu-test-registry-"))
    address = f"127.0.0.1:{free_port()}"
    config = storage / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}\n"
    )
    log = open(storage / "registry.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(
        [REGISTRY, "serve", str(config)], stdout=log, stderr=log, start_new_session=True
    )
    registry = Registry(address, process, storage)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return registry
        except OSError:
            time.sleep(0.2)
    registry.stop()
    raise EngineUnavailable(f"the registry did not answer on {address} (see {log.name})")


def push_pull_image(
    registry: Registry,
    base: str,
    name: str = "spotgpu-test/pull:1",
    ballast_bytes: int = BALLAST_BYTES,
) -> str:
    """``base`` plus a layer of ``ballast_bytes`` random bytes (and ``/opt/ballast-id``
    holding ``name``), pushed to ``registry`` as ``name`` and removed from the engine: the
    reference, which only the registry has."""
    reference = f"{registry.address}/{name}"
    with tempfile.TemporaryDirectory(prefix="spotgpu-pull-image-") as context:
        began = time.monotonic()
        (Path(context) / "Dockerfile").write_text(
            f"FROM {base}\n"
            f"RUN head -c {ballast_bytes} /dev/urandom > /opt/ballast"
            f" && echo {name} > /opt/ballast-id\n"
        )
        _docker("build", "-q", "-t", reference, context, env={**os.environ, "DOCKER_BUILDKIT": "0"})
        TIMINGS["pull_image_build_seconds"] = round(time.monotonic() - began, 1)
    began = time.monotonic()
    _docker("push", "-q", reference)
    TIMINGS["pull_image_push_seconds"] = round(time.monotonic() - began, 1)
    forget_image(reference)
    return reference


def forget_image(reference: str) -> None:
    """Remove an image from the engine (its own layers with it), if it has it."""
    _docker("rmi", "-f", reference, check=False)
