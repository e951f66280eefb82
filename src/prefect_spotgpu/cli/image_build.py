"""``spotgpu admin image build NAME``: a flow-ready catalogue image from any base, one command.

    spotgpu admin image build pytorch --wheelhouse ./wheelhouse \\
        --registry registry.example.com/spotgpu

The steps, each saying how far it is and, when it fails, what to change: the wheelhouse is
checked (it holds a prefect-spotgpu wheel); the catalogue is read (a name it holds gives the
base, framework, CUDA and description: ``--base`` and the rest override them); the Docker
engine is reached (``DOCKER_HOST``, as the docker CLI) and the base found or pulled; the
base's Python is checked in a container of it (new enough for prefect-spotgpu and the
wheelhouse's Prefect, with pip or ensurepip); the image is built (``image_recipe.dockerfile``:
prefect-spotgpu from the wheelhouse with no package index), run once as a non-root user to
check that the launcher imports, pushed to ``--registry``, and put in the catalogue as
``runs_flows``. The decisions are ``cli/image_recipe.py``'s; this module does the I/O, with the
docker SDK the agents use (no registry client of its own: the engine pushes).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import typer

from prefect_spotgpu.cli import image_recipe as recipe
from prefect_spotgpu.cli.common import MARKET, admin_client, console

PROGRESS_SECONDS = 2.0
"""How often, at most, a pull or push prints its progress."""
VERIFY = (
    "import sys, prefect, prefect_spotgpu.launch, prefect_spotgpu.bundles.execute; "
    "print(prefect.__version__, sys.version.split()[0])"
)
"""What the built image must run as a non-root user (as the docker runner runs jobs): the
launcher and the bundle executor import."""
NOBODY = "65534:65534"


class BuildFailed(Exception):
    """A step failed; the message says what to change."""


def say(text: str, style: str | None = None) -> None:
    console.print(text, style=style, markup=False, soft_wrap=True, highlight=False)


def build_image(
    name: str,
    base: str | None,
    wheelhouse: Path,
    registry: str,
    tag: str | None,
    framework: str | None,
    cuda: str | None,
    description: str | None,
    market: str = MARKET,
) -> None:
    """The command (registered by ``cli/images.py``): see the module docstring."""
    from prefect_spotgpu.cli.images import RUNS, refusal, runs

    catalogue_client = admin_client(market)  # no key: ends here, before any build
    try:
        house = read_wheelhouse(wheelhouse)
        with catalogue_client as http:
            response = http.get("/images")
            operator = http.get("/tenants")  # the admin's only: refused now, not after a build
        if operator.status_code != 200:
            raise BuildFailed(
                f"{refusal(operator)}: only the operator changes the catalogue (the admin key: "
                "SPOTGPU_ADMIN_KEY, or the key file the service generated); nothing was built"
            )
        listed = {entry["name"]: entry for entry in response.json()}
        entry = listed.get(name) or {}
        base = base or entry.get("reference")
        framework = framework or entry.get("framework")
        if not base or not framework:
            raise BuildFailed(
                f"{name!r} is not in the catalogue: give its --base (the image to start from) "
                "and --framework (what it provides, e.g. 'PyTorch 2.5.1')"
            )
        version = house.package.version
        reference = recipe.image_reference(registry, name, tag or recipe.default_tag(base, version))
        engine = connect()
        probe = probe_base(engine, base)
        problem = recipe.base_problem(probe, house)
        if problem:
            raise BuildFailed(problem)
        say(
            f"base {base}: Python {probe.version_text} ({probe.python}), "
            f"{'pip' if probe.pip else 'ensurepip'}; installing {recipe.PACKAGE} {version} "
            f"from {wheelhouse} ({house.wheels} wheels)"
        )
        plan = recipe.Plan(base=base, probe=probe, wheelhouse=house, reference=reference)
        build(engine, plan, wheelhouse)
        verify(engine, reference)
        digest = push(engine, reference)
    except (BuildFailed, ValueError) as exc:
        say(str(exc), style="red")
        raise typer.Exit(1) from None
    body = {
        "reference": reference,
        "framework": framework,
        "cuda_version": cuda or entry.get("cuda_version"),
        "description": description
        if description is not None
        else entry.get("description") or f"{base} with {recipe.PACKAGE} {version}: runs flows.",
        "runs_flows": True,
    }
    with admin_client(market) as http:
        response = http.put(f"/images/{name}", json=body)
    if response.status_code not in (200, 201):
        say(f"{refusal(response)} (the image is pushed: {reference})", style="red")
        raise typer.Exit(1)
    done = "added" if response.status_code == 201 else "replaced"
    say(
        f"{done} image {name!r}: {reference} ({framework}; {RUNS[runs(response.json())]}), "
        f"{digest or 'digest not reported'}"
    )


# ---------------------------------------------------------------- the wheelhouse


def read_wheelhouse(folder: Path) -> recipe.Wheelhouse:
    """The wheelhouse's prefect-spotgpu wheel (the newest) and Prefect's, with what their
    metadata says; BuildFailed naming what is missing."""
    if not folder.is_dir():
        raise BuildFailed(
            f"the wheelhouse {folder} is not a folder: make one on a machine with a package "
            f"index: {recipe.MAKE_WHEELHOUSE} ({recipe.WHEELHOUSE_DOCS})"
        )
    names = sorted(path.name for path in folder.iterdir())
    problem = recipe.wheelhouse_problem(str(folder), names)
    if problem:
        raise BuildFailed(problem)
    wheels = {n: _wheel(folder / n) for n in names if n.endswith(".whl")}
    ours = [w for n, w in wheels.items() if n.startswith(recipe.WHEEL_PREFIX) and w]
    prefect = [w for n, w in wheels.items() if n.startswith("prefect-") and w]
    if not ours:
        raise BuildFailed(
            f"the {recipe.PACKAGE} file in the wheelhouse {folder} is not a wheel (a zip with "
            f"its metadata): make the wheelhouse again: {recipe.MAKE_WHEELHOUSE}"
        )
    return recipe.Wheelhouse(
        package=recipe.newest(ours),
        prefect=recipe.newest(prefect) if prefect else None,
        wheels=len(wheels),
    )


def _wheel(path: Path) -> recipe.Wheel | None:
    """A wheel's version and ``Requires-Python`` (its METADATA); None if it is no wheel."""
    try:
        with zipfile.ZipFile(path) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            text = archive.read(metadata).decode("utf-8", "replace")
    except (zipfile.BadZipFile, StopIteration, OSError):
        return None
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return recipe.Wheel(
        filename=path.name,
        version=fields.get("version") or recipe.wheel_version(path.name),
        requires_python=fields.get("requires-python"),
    )


# ---------------------------------------------------------------- the engine


def connect():
    """The Docker engine of ``DOCKER_HOST`` (or the local socket), answering."""
    import docker

    try:
        engine = docker.from_env(timeout=300)
        engine.ping()
    except docker.errors.DockerException as exc:
        raise BuildFailed(
            f"no Docker engine answers ({_short(exc)}): start Docker on this machine, or set "
            "DOCKER_HOST to an engine that can reach the registry, then run this again"
        ) from None
    return engine


def probe_base(engine, base: str) -> recipe.BaseProbe:
    """The base's Python, as :data:`image_recipe.PROBE` finds it in a container of the base
    (pulled first when the engine lacks it)."""
    import docker

    try:
        image = engine.images.get(base)
    except docker.errors.ImageNotFound:
        image = pull(engine, base)
    try:
        output = engine.containers.run(
            base,
            entrypoint=["/bin/sh", "-c", recipe.PROBE_SHELL],
            command=[],
            environment={recipe.PROBE_VARIABLE: recipe.PROBE},
            network_disabled=True,
            remove=True,
            stdout=True,
            stderr=True,
        )
    except docker.errors.ContainerError as exc:
        raise BuildFailed(f"the base's Python did not run in {base}: {_short(exc)}") from None
    except docker.errors.APIError as exc:
        if "/bin/sh" in str(exc):
            raise BuildFailed(
                f"the base {base} has no /bin/sh: the build's steps need a shell; pick a base "
                "with one (most have: not distroless or scratch images)"
            ) from None
        raise BuildFailed(f"a container of {base} did not start: {_short(exc)}") from None
    user = (image.attrs.get("Config") or {}).get("User") or ""
    return recipe.BaseProbe.parse(output.decode("utf-8", "replace"), user=user)


def pull(engine, base: str):
    """Pull the base, printing its progress; BuildFailed when no registry has it."""
    import docker
    from docker.utils import parse_repository_tag

    from prefect_spotgpu.agent.runners.pull import PullProgress

    say(f"pulling the base {base}")
    began = time.monotonic()
    counts = PullProgress(base)
    repository, tag = parse_repository_tag(base)
    try:
        _follow(engine.api.pull(repository, tag=tag or "latest", stream=True, decode=True), counts)
        image = engine.images.get(base)
    except docker.errors.DockerException as exc:
        raise BuildFailed(
            f"the base {base} is not found: neither this engine nor its registry has it "
            f"({_short(exc)}); check its name and tag (docker pull {base}), and log in to a "
            "private registry first (docker login HOST)"
        ) from None
    say(counts.done_line(seconds=time.monotonic() - began))
    return image


def build(engine, plan: recipe.Plan, wheelhouse: Path) -> None:
    """Build ``plan.reference`` from the recipe, printing each step as it starts."""
    import docker

    began = time.monotonic()
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="spotgpu-image-build-") as context:
        house = Path(context) / "wheelhouse"
        house.mkdir()
        for wheel in wheelhouse.glob("*.whl"):
            shutil.copy(wheel, house)
        (Path(context) / "Dockerfile").write_text(recipe.dockerfile(plan))
        say(f"building {plan.reference}")
        try:
            stream = engine.api.build(
                path=context, tag=plan.reference, rm=True, forcerm=True, decode=True
            )
            for message in stream:
                if "error" in message:
                    log.append(message["error"])
                    raise BuildFailed(
                        recipe.install_problem(log, plan.probe, str(wheelhouse))
                        or f"the build failed: {' | '.join(_tail(log))}"
                    )
                for line in str(message.get("stream", "")).splitlines():
                    log.append(line)
                    if line.startswith(("Step ", "Successfully installed")):
                        say(f"  {line[:200]}")
        except docker.errors.DockerException as exc:
            raise BuildFailed(f"the build failed: {_short(exc)}") from None
    say(f"built {plan.reference} in {time.monotonic() - began:.0f} s")


def verify(engine, reference: str) -> None:
    """Run the launcher's imports in the new image as a non-root user, before any push."""
    import docker

    try:
        output = engine.containers.run(
            reference,
            entrypoint=["python", "-c", VERIFY],
            command=[],
            user=NOBODY,
            environment={"HOME": "/tmp"},  # (as the runner gives a job a home of its own)
            network_disabled=True,
            remove=True,
            stderr=True,
        )
    except docker.errors.DockerException as exc:
        raise BuildFailed(
            f"the built image {reference} does not run prefect-spotgpu as a non-root user "
            f"({_short(exc)}); nothing was pushed"
        ) from None
    prefect_version, python = [*output.decode().split(), "?", "?"][:2]
    say(f"checked: python -m prefect_spotgpu.launch imports (Prefect {prefect_version}, "
        f"Python {python}, as user {NOBODY})")  # fmt: skip


def push(engine, reference: str) -> str | None:
    """Push ``reference`` through the engine, printing its progress; its digest."""
    import docker
    from docker.utils import parse_repository_tag

    began = time.monotonic()
    counts = recipe.PushProgress(reference)
    repository, tag = parse_repository_tag(reference)
    say(f"pushing {reference}")
    try:
        _follow(engine.api.push(repository, tag=tag, stream=True, decode=True), counts)
    except docker.errors.DockerException as exc:
        host = repository.split("/", 1)[0]
        raise BuildFailed(
            f"the registry refused the push of {reference} ({_short(exc)}): check --registry, "
            f"log in first (docker login {host}); a registry over plain HTTP must be among the "
            "engine's insecure-registries. The image is built; run this again to push it"
        ) from None
    say(f"pushed {reference} in {time.monotonic() - began:.0f} s ({counts.line().split(': ')[1]})")
    return counts.digest


def _follow(messages, counts) -> None:
    """Read an engine's pull or push stream into ``counts``, printing its line every
    ``PROGRESS_SECONDS``; an error it reports raises ``APIError``."""
    import docker

    last = time.monotonic()
    for message in messages:
        if "error" in message:
            raise docker.errors.APIError(message["error"])
        counts.add(message)
        if time.monotonic() - last >= PROGRESS_SECONDS:
            say(counts.line())
            last = time.monotonic()


def _tail(log: list[str], lines: int = 6) -> list[str]:
    return [line.strip() for line in log if line.strip()][-lines:]


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "explanation", None) or exc).strip()
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:200] + " ... " + text[-190:]
