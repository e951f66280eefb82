"""A real Docker engine and job images for the container tests, with no registry.

``ensure_engine()`` answers with the engine already running, or starts ``dockerd`` (Debian's
``docker.io``: no systemd here) and waits for ``docker info``; ``stop()`` stops only an
engine this module started. ``job_image()`` builds, once per engine, the images the tests run:

- ``spotgpu-test-base:bookworm``: ``debootstrap --variant=minbase`` with Debian's python3 and
  numpy, imported as an image (``docker import``: nothing is pulled);
- ``spotgpu-test-job:<hash of the project's wheel>``: the base with this checkout's
  prefect-spotgpu unpacked from a wheel built here (``--no-deps``: the job side needs only
  the checkpoint library, the standard library and numpy).

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "spotgpu-test-base:bookworm"
JOB_REPOSITORY = "spotgpu-test-job"
MIRROR = "http://deb.debian.org/debian"
TIMINGS: dict[str, float] = {}

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


def job_image() -> str:
    """The job image of this checkout (built once per version of its code)."""
    base = base_image()
    with tempfile.TemporaryDirectory(prefix="spotgpu-image-") as context:
        began = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", context, str(ROOT)],
            check=True,
            capture_output=True,
        )
        (wheel,) = Path(context).glob("*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:12]
        name = f"{JOB_REPOSITORY}:{digest}"
        if _has_image(name):
            return name
        (Path(context) / "Dockerfile").write_text(
            f"FROM {base}\n"
            f"COPY {wheel.name} /tmp/\n"
            f"RUN python3 -m zipfile -e /tmp/{wheel.name} /usr/local/lib/python3.11/dist-packages/"
            f" && rm /tmp/{wheel.name}\n"
        )
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        _docker("build", "-q", "-t", name, context, env=env)
        TIMINGS["job_image_seconds"] = round(time.monotonic() - began, 1)
        return name
