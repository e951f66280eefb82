"""A real Docker engine, job images and a real registry for the container tests.

The tests list containers with ``ignore_removed=True``: docker-py inspects each container it
listed, and one an agent removed meanwhile (its own clean-up) would fail the list with a 404.

``ensure_engine()`` answers with the engine already running, or starts ``dockerd`` (Debian's
``docker.io``: no systemd here) and waits for ``docker info``; ``stop()`` stops only an
engine this module started. ``job_image()`` builds, once per engine, the images the tests run:

- ``spotgpu-test-base:bookworm``: ``debootstrap --variant=minbase`` with Debian's python3 and
  numpy, imported as an image (``docker import``: nothing is pulled);
- ``spotgpu-test-job:<hash of the project's wheel's files>``: the base with this checkout's
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
on a loopback port (the engine trusts registries on 127.0.0.0/8 over plain HTTP), its storage
kept from one session to the next (``REGISTRY_HOME``), behind a ``Link``: a proxy that sends
what the registry answers at ``PULL_BYTES_PER_SECOND``, as a network would (a loopback
registry answers as fast as the disk). ``push_pull_image()`` puts there an image the engine
then lacks: the job image plus a layer of random bytes, pushed, then removed from the engine,
so a pull of it fetches that layer (``forget_image`` removes it again before the next pull).

The images are named by what they hold: the wheel's files, not the wheel (its zip entries'
times change with every build), so an unchanged checkout finds the images it built before.

Each step says how long it took (``TIMINGS``), for the closing notes of the container work.
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
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

BALLAST_BYTES = 32_000_000
"""The random (incompressible) layer of the pull test's image."""
PULL_BYTES_PER_SECOND = 10_000_000
"""What the registry sends, at most (its ``Link``): the pull test's layer takes
``BALLAST_BYTES / PULL_BYTES_PER_SECOND`` = 3.2 s however fast the machine, so its progress is
reported more than once (every ``protocol.PULL_REPORT_SECONDS``) and a pull is still under way
when a test acts on it; pushes are not slowed."""
REGISTRY = shutil.which("docker-registry") or "/usr/bin/docker-registry"
REGISTRY_HOME = Path(tempfile.gettempdir()) / "spotgpu-test-registry"
"""The registry's storage, kept from one session to the next: a push skips the layers it holds
already (the job and flow images' base layers: hundreds of MB, a dozen seconds each to
compress), so a session pushes what changed and its own random layers. Each session first
drops what no tag names any more (``garbage-collect --delete-untagged``: earlier sessions'
random layers and job images). One session at a time holds it (a lock); another at the same
time gets a temporary storage of its own."""

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


_built: list[Path] = []
"""This checkout's wheel, once built (``_wheel``: once per session)."""


def _wheel(into: str) -> Path:
    """This checkout's wheel (``--no-deps``), copied into ``into``."""
    if not _built:
        folder = tempfile.mkdtemp(prefix="spotgpu-test-wheel-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", folder, str(ROOT)],
            check=True,
            capture_output=True,
        )
        _built.extend(Path(folder).glob("*.whl"))
    (wheel,) = _built
    Path(into).mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(wheel, into))


def _held(wheel: Path) -> bytes:
    """What a wheel holds, its files' names and bytes: the same for two builds of one checkout
    (their zip entries' times differ)."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            data = archive.read(name)
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.digest()


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
        name = f"{JOB_REPOSITORY}:{hashlib.sha256(_held(wheel)).hexdigest()[:12]}"
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
    return _recipe_image(python_image(), [ROOT / "tests" / "spot_flow.py"], FLOW_REPOSITORY)


def _recipe_image(base: str, flows: list[Path], repository: str) -> str:
    """A job image made by the repository's recipe (``docker/job.Dockerfile``) from ``base``,
    with ``flows`` at ``FLOWS``; named by what it holds (built once per version of it)."""
    recipe = ROOT / "docker" / "job.Dockerfile"
    with tempfile.TemporaryDirectory(prefix="spotgpu-recipe-image-") as context:
        began = time.monotonic()
        wheel = _wheel(str(Path(context) / "dist"))
        (Path(context) / "flows").mkdir()
        for flow in flows:
            shutil.copy(flow, Path(context) / "flows")
        held = _held(wheel) + b"".join(f.read_bytes() for f in flows) + recipe.read_bytes()
        name = f"{repository}:{hashlib.sha256(held + base.encode()).hexdigest()[:12]}"
        if _has_image(name):
            return name
        shutil.copy(recipe, Path(context) / "Dockerfile")
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        _docker("build", "-q", "--build-arg", f"BASE={base}", "-t", name, context, env=env)
        TIMINGS[f"{repository}_seconds"] = round(time.monotonic() - began, 1)
        _drop_other_tags(name)
        return name


TORCH_REPOSITORY = "spotgpu-test-torch"
TORCH_FLOW_REPOSITORY = "spotgpu-test-torch-flow"


def torch_image() -> str:
    """``python_image()`` with this host's CPU torch (its wheel and its dependencies' wheels,
    from this host's pip sources: the catalogue's PyTorch images, without CUDA)."""
    from importlib.metadata import version

    base = python_image()
    name = f"{TORCH_REPOSITORY}:{version('torch').replace('+', '-')}"
    if _has_image(name):
        return name
    with tempfile.TemporaryDirectory(prefix="spotgpu-torch-image-") as context:
        began = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:",
             "-d", f"{context}/wheels", f"torch=={version('torch')}"],
            check=True, capture_output=True,
        )  # fmt: skip
        return _build(
            name,
            context,
            f"FROM {base}\nCOPY wheels /tmp/wheels\n"
            "RUN pip install -q --no-cache-dir --no-index --find-links /tmp/wheels torch"
            " && rm -r /tmp/wheels\n",
            "torch_image_seconds",
            began,
        )


def torch_flow_image() -> str:
    """A job image of the repository's recipes (``flows/``, at ``FLOWS``) on ``torch_image()``,
    made by ``docker/job.Dockerfile`` as a user makes theirs."""
    flows = sorted((ROOT / "flows").glob("*.py"))
    return _recipe_image(torch_image(), flows, TORCH_FLOW_REPOSITORY)


WHEELHOUSE_HOME = Path(tempfile.gettempdir()) / "spotgpu-test-wheelhouse"
"""The dependencies' wheels, kept from one session to the next in a folder per key (the
project's dependencies, the pip constraints of this host and this Python)."""


def wheelhouse(into: Path) -> Path:
    """``into`` made a wheelhouse as an operator makes one (``pip wheel . -w DIR``): this
    checkout's wheel and its dependencies' wheels for this Python (bookworm's python3 is 3.11,
    as this venv's). The dependencies come from the folder of their key, made the first time
    (the package index, or this host's pip sources); this checkout's wheel is the session's."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    constraints = Path("/etc/xdg/pip/constraints.txt")
    key = hashlib.sha256(
        "\n".join(project["dependencies"]).encode()
        + (constraints.read_bytes() if constraints.exists() else b"")
        + sys.version.encode()
    ).hexdigest()[:12]
    kept = WHEELHOUSE_HOME / key
    if not (kept / "complete").exists():
        began = time.monotonic()
        WHEELHOUSE_HOME.mkdir(exist_ok=True)
        made = Path(tempfile.mkdtemp(prefix="making-", dir=WHEELHOUSE_HOME))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(made), str(ROOT)],
            check=True,
            capture_output=True,
        )
        for ours in made.glob("prefect_spotgpu-*.whl"):
            ours.unlink()
        (made / "complete").touch()
        shutil.rmtree(kept, ignore_errors=True)
        made.rename(kept)
        TIMINGS["wheelhouse_seconds"] = round(time.monotonic() - began, 1)
    into.mkdir(parents=True, exist_ok=True)
    for wheel in kept.glob("*.whl"):
        shutil.copy(wheel, into)
    _wheel(str(into))
    return into


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


class Link:
    """A TCP proxy on a loopback port (``address``) to ``upstream``: what ``upstream`` answers
    goes at ``rate`` bytes per second at most, all connections together (one network link);
    what clients send goes at once. Its event loop runs on a thread of its own until
    ``close()``."""

    CHUNK = 64 * 1024

    def __init__(self, upstream: str, rate: float) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.rate = rate
        self.address = ""
        self._free_at = 0.0  # when the link has sent what it was given (the loop's clock)
        self._listening = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: asyncio.Event | None = None
        self._open: dict[asyncio.Task, list[asyncio.StreamWriter]] = {}
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(),), name="registry-link", daemon=True
        )
        self._thread.start()
        if not self._listening.wait(10):
            raise EngineUnavailable(f"no proxy to the registry on {upstream}")

    def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._closed.set)
            self._thread.join(10)

    async def _serve(self) -> None:
        self._loop, self._closed = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._listening.set()
        await self._closed.wait()
        server.close()
        for writers in self._open.values():
            for writer in writers:
                writer.close()  # each way sees its end
        await asyncio.gather(*self._open, return_exceptions=True)

    async def _connection(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._open[task] = [to_client]
        try:
            upstream, to_upstream = await asyncio.open_connection(*self.upstream)
            self._open[task].append(to_upstream)
            await asyncio.gather(
                self._pipe(client, to_upstream, throttled=False),
                self._pipe(upstream, to_client, throttled=True),
            )
        except OSError:
            pass  # the registry is down: the client sees its connection closed
        finally:
            for writer in self._open.pop(task):
                writer.close()

    async def _pipe(self, reader, writer, *, throttled: bool) -> None:
        try:
            while data := await reader.read(self.CHUNK):
                if throttled:
                    await self._sent(len(data))
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()  # (the other way may still carry an answer)
        except OSError:
            writer.close()  # one side is gone: the other way ends too

    async def _sent(self, size: int) -> None:
        """Wait while the link sends ``size`` bytes after what it was given before."""
        now = self._loop.time()
        self._free_at = max(self._free_at, now) + size / self.rate
        await asyncio.sleep(self._free_at - now)


@dataclass
class Registry:
    """A running registry behind its ``Link``: ``address`` is the link's ``127.0.0.1:PORT``
    (an image reference's host)."""

    address: str
    process: subprocess.Popen
    storage: Path
    link: Link
    lock: int | None
    """The descriptor holding ``REGISTRY_HOME``'s lock; None: the storage is temporary."""

    def stop(self) -> None:
        """Stop the link, the registry (by its pid); remove a temporary storage, unlock a kept
        one."""
        self.link.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        if self.lock is None:
            shutil.rmtree(self.storage, ignore_errors=True)
        else:
            os.close(self.lock)


def _storage() -> tuple[Path, int | None]:
    """``REGISTRY_HOME``, locked for this session (and the lock), or a new temporary
    directory (and None) while another session holds it."""
    REGISTRY_HOME.mkdir(exist_ok=True)
    lock = os.open(REGISTRY_HOME / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return Path(tempfile.mkdtemp(prefix="spotgpu-test-registry-")), None
    return REGISTRY_HOME, lock


def start_registry(wait: float = 30.0, rate: float = PULL_BYTES_PER_SECOND) -> Registry:
    """A registry on a free loopback port, its storage ``REGISTRY_HOME`` (what no tag names
    dropped), behind a ``Link`` of ``rate`` bytes per second."""
    from prefect_spotgpu.cli.stack import free_port

    if not Path(REGISTRY).exists():
        raise EngineUnavailable("no registry: install Debian's docker-registry")
    storage, lock = _storage()
    address = f"127.0.0.1:{free_port()}"
    config = storage / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}\n"
    )
    log = open(storage / "registry.log", "wb")  # noqa: SIM115
    if lock is not None:
        began = time.monotonic()
        collected = subprocess.run(
            [REGISTRY, "garbage-collect", "--delete-untagged", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            timeout=300,
            check=False,
        )
        if collected.returncode != 0:  # (what it could not read is pushed again)
            shutil.rmtree(storage / "data", ignore_errors=True)
        TIMINGS["registry_collect_seconds"] = round(time.monotonic() - began, 1)
    process = subprocess.Popen(
        [REGISTRY, "serve", str(config)], stdout=log, stderr=log, start_new_session=True
    )
    try:
        link = Link(address, rate)
    except EngineUnavailable:
        process.terminate()
        if lock is not None:
            os.close(lock)
        raise
    registry = Registry(link.address, process, storage, link, lock)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{link.address}/v2/", timeout=2) as answer:
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
    """Remove an image from the engine (its own layers with it), if it has it, and the
    stopped containers made from it first: an image a container still uses would only be
    untagged, and stay on the engine's disk, nameless, after every run."""
    users = _docker("ps", "-aq", "--filter", f"ancestor={reference}", check=False).stdout.split()
    if users:
        _docker("rm", "-f", *users, check=False)
    _docker("rmi", "-f", reference, check=False)
