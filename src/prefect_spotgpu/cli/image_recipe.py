"""PURE: what ``spotgpu admin image build`` decides, apart from the engine it builds on.

A flow-ready catalogue image is a base plus prefect-spotgpu and its dependencies, installed
from the operator's wheelhouse (``pip install --no-index --find-links``: no package index where
the image is built, and none on the node). Nothing of a buyer's is baked in: a flow's code
travels by its bundle (``@spot_gpu``) or its deployment's pull step.

Here, as plain data in and text out: the wheelhouse's check (:func:`wheelhouse_problem`), the
base's check (:func:`base_problem`, on what :data:`PROBE` printed in a container of it), the
recipe (:func:`dockerfile`), the image's reference (:func:`image_reference`) and what a failed
pip install means (:func:`install_problem`). ``cli/image_build.py`` does the I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from prefect_spotgpu.protocol import IMAGE_REFERENCE_PATTERN, MAX_IMAGE_REFERENCE_CHARS

PACKAGE = "prefect-spotgpu"
WHEEL_PREFIX = "prefect_spotgpu-"
WHEELHOUSE_IN_IMAGE = "/tmp/spotgpu-wheelhouse"
"""Where the build copies the wheelhouse (removed in the same layer, after the install)."""
WHEELHOUSE_DOCS = "docs/operators/image-catalogue.md#the-wheelhouse"
MAKE_WHEELHOUSE = "pip wheel prefect-spotgpu -w DIR (from a clone: pip wheel . -w DIR)"
LABEL_RUNS_FLOWS = "io.spotgpu.runs-flows"
LABEL_BASE = "io.spotgpu.base"
LABEL_VERSION = "io.spotgpu.prefect-spotgpu"

PROBE = r"""
import json, os, sys, sysconfig
def which(name):
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None
def importable(name):
    try:
        __import__(name)
        return True
    except Exception:
        return False
def bundled_pip():
    try:
        import ensurepip
    except Exception:
        return False
    in_venv = hasattr(sys, "real_prefix") or sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    if hasattr(ensurepip, "_ensurepip_is_disabled_in_debian_for_system") and not in_venv:
        return False  # Debian's system Python: "install the python3-pip package"
    places = [os.path.join(os.path.dirname(ensurepip.__file__), "_bundled"),
              "/usr/share/python-wheels"]
    for place in places:
        if os.path.isdir(place) and any(n.startswith("pip-") for n in os.listdir(place)):
            return True
    return False
print(json.dumps({
    "python": sys.executable,
    "version": list(sys.version_info[:3]),
    "pip": importable("pip"),
    "ensurepip": bundled_pip(),
    "python_on_path": which("python"),
    "platform": sysconfig.get_platform(),
}))
"""
"""Run by the base's Python in a container of the base: what the base's check needs, as one
JSON line. Plain Python that old interpreters still run, so that an old one is named, not a
syntax error."""

PROBE_SHELL = (
    'for p in python3 python; do if command -v "$p" >/dev/null 2>&1; then '
    'exec "$p" -c "$IMAGE_PROBE"; fi; done; echo "{}"'
)
"""The probe's entry point (``/bin/sh -c``): the base's ``python3``, else its ``python``, runs
:data:`PROBE`, given as ``PROBE_VARIABLE``; an empty object when it has neither."""
PROBE_VARIABLE = "IMAGE_PROBE"


@dataclass(frozen=True)
class Wheel:
    """One wheel's file name and what its metadata says."""

    filename: str
    version: str
    requires_python: str | None = None


@dataclass(frozen=True)
class Wheelhouse:
    """What the build installs from: prefect-spotgpu's wheel (``package``), Prefect's, if the
    folder holds one, and how many wheels it holds."""

    package: Wheel
    prefect: Wheel | None = None
    wheels: int = 0


@dataclass(frozen=True)
class BaseProbe:
    """What :data:`PROBE` found in the base (``python`` None: no ``python3`` nor ``python``)."""

    python: str | None = None
    version: tuple[int, ...] = ()
    pip: bool = False
    ensurepip: bool = False
    python_on_path: str | None = None
    platform: str = ""
    user: str = ""
    """The base's ``USER``: the build installs as root, then gives it back."""

    @classmethod
    def parse(cls, output: str, user: str = "") -> BaseProbe:
        """The probe's last JSON line (what the base's Python printed)."""
        lines = [line for line in output.strip().splitlines() if line.startswith("{")]
        found = json.loads(lines[-1]) if lines else {}
        return cls(
            python=found.get("python"),
            version=tuple(found.get("version") or ()),
            pip=bool(found.get("pip")),
            ensurepip=bool(found.get("ensurepip")),
            python_on_path=found.get("python_on_path"),
            platform=str(found.get("platform") or ""),
            user=user,
        )

    @property
    def version_text(self) -> str:
        return ".".join(str(part) for part in self.version)


@dataclass(frozen=True)
class Plan:
    """The build: the base, its probe, what the wheelhouse gives, where the image goes."""

    base: str
    probe: BaseProbe
    wheelhouse: Wheelhouse
    reference: str
    labels: dict[str, str] = field(default_factory=dict)


def wheel_version(filename: str) -> str:
    """The version in a wheel's file name (``name-version-...whl``)."""
    return filename.split("-")[1]


def wheelhouse_problem(folder: str, filenames: list[str]) -> str | None:
    """Why ``folder`` (its files ``filenames``) cannot be the build's wheelhouse, with what to
    do; None when it can."""
    make = f"make one on a machine with a package index: {MAKE_WHEELHOUSE} ({WHEELHOUSE_DOCS})"
    if not any(name.endswith(".whl") for name in filenames):
        return f"the wheelhouse {folder} holds no wheels: {make}"
    if not any(name.startswith(WHEEL_PREFIX) and name.endswith(".whl") for name in filenames):
        return f"the wheelhouse {folder} holds no {PACKAGE} wheel ({WHEEL_PREFIX}*.whl): {make}"
    return None


def newest(wheels: list[Wheel]) -> Wheel:
    """The wheel of the highest version (pip's choice, which the build pins)."""
    from packaging.version import InvalidVersion, Version

    def key(wheel: Wheel):
        try:
            return (1, Version(wheel.version))
        except InvalidVersion:
            return (0, Version("0"))

    return max(wheels, key=key)


def base_problem(probe: BaseProbe, wheelhouse: Wheelhouse) -> str | None:
    """Why prefect-spotgpu cannot go into a base with this probe, saying what to change; None
    when it can: a Python that prefect-spotgpu (and the wheelhouse's Prefect) accept, and pip,
    or ensurepip to bootstrap it."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if probe.python is None:
        return (
            "the base has no Python (neither python3 nor python on its PATH): pick a base "
            "with Python 3.11 or newer and pip"
        )
    needs = []
    for label, wheel in ((PACKAGE, wheelhouse.package), ("prefect", wheelhouse.prefect)):
        if wheel is not None and wheel.requires_python:
            needs.append((f"{label} {wheel.version}", wheel.requires_python))
    for who, spec in needs:
        try:
            accepted = SpecifierSet(spec).contains(probe.version_text, prereleases=True)
        except InvalidSpecifier:
            continue
        if not accepted:
            said = "; ".join(f"{w} needs Python {s}" for w, s in needs)
            return (
                f"the base's Python ({probe.python}) is {probe.version_text}, which {who} does "
                f"not run on ({said}): pick a base with a newer Python, or add one to it first"
            )
    if not probe.pip and not probe.ensurepip:
        return (
            f"the base's Python ({probe.python}, {probe.version_text}) has no pip and no "
            "ensurepip to bootstrap it: pick a base with pip, or add it first (Debian and "
            "Ubuntu: apt-get install python3-pip, or python3-venv)"
        )
    return None


def default_tag(base: str, version: str) -> str:
    """The image's tag when the operator names none: the base's tag (``latest`` when it has
    none) and prefect-spotgpu's version, e.g. ``2.5.1-cuda12.4-cudnn9-runtime-spotgpu0.1.0``."""
    name = base.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    suffix = f"-spotgpu{version}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tag)[: 128 - len(suffix)] + suffix


def image_reference(registry: str, name: str, tag: str) -> str:
    """``REGISTRY/NAME:TAG``; ValueError saying what is wrong when Docker would not take it."""
    reference = f"{registry.strip().rstrip('/')}/{name}:{tag}"
    if len(reference) > MAX_IMAGE_REFERENCE_CHARS or not re.fullmatch(
        IMAGE_REFERENCE_PATTERN, reference
    ):
        raise ValueError(
            f"{reference!r} is not an image reference Docker takes: --registry is "
            "HOST[:PORT]/PATH in lower case (e.g. registry.example.com/spotgpu), --tag letters, "
            "digits, '_', '.' and '-'"
        )
    return reference


def dockerfile(plan: Plan) -> str:
    """The recipe: the base, as root, the wheelhouse copied in, pip bootstrapped if need be,
    prefect-spotgpu installed at the wheelhouse's version with no index, the wheelhouse
    removed in the same layer; ``python`` on the PATH (the job's launcher is ``python -m
    prefect_spotgpu.launch``); the base's user given back."""
    probe, package = plan.probe, plan.wheelhouse.package
    python = probe.python
    steps = [f"python={python}"]
    if not probe.pip:
        steps.append('"$python" -m ensurepip --default-pip')
    steps.append(
        f'PIP_BREAK_SYSTEM_PACKAGES=1 "$python" -m pip install --no-cache-dir '
        f"--disable-pip-version-check --no-index --find-links {WHEELHOUSE_IN_IMAGE} "
        f"{PACKAGE}=={package.version}"
    )
    if probe.python_on_path is None:
        steps.append('ln -s "$python" /usr/local/bin/python')
    steps.append(f"rm -rf {WHEELHOUSE_IN_IMAGE}")
    labels = {
        LABEL_RUNS_FLOWS: "true",
        LABEL_BASE: plan.base,
        LABEL_VERSION: package.version,
        **plan.labels,
    }
    lines = [
        f"FROM {plan.base}",
        "USER root",
        f"COPY wheelhouse {WHEELHOUSE_IN_IMAGE}",
        "RUN " + " \\\n && ".join(steps),
        "LABEL " + " ".join(f"{key}={json.dumps(value)}" for key, value in labels.items()),
    ]
    if probe.user and probe.user not in ("root", "0", "0:0"):
        lines.append(f"USER {probe.user}")
    return "\n".join(lines) + "\n"


_MISSING = re.compile(
    r"(?:No matching distribution found for|Could not find a version that satisfies the "
    r"requirement) ([^\s()]+)"
)


def install_problem(log: list[str], probe: BaseProbe, folder: str) -> str | None:
    """What a failed install's log means, saying what to change (None: nothing known)."""
    for line in reversed(log):
        missing = _MISSING.search(line)
        if missing:
            return (
                f"the wheelhouse {folder} has no wheel of {missing[1]} that the base's Python "
                f"{probe.version_text} ({probe.platform or 'its platform'}) can install: make "
                f"the wheelhouse for that Python ({MAKE_WHEELHOUSE}, run with the same Python "
                f"version; or pip download --only-binary=:all: --python-version "
                f"{'.'.join(str(p) for p in probe.version[:2])} ...; {WHEELHOUSE_DOCS})"
            )
    return None


class PushProgress:
    """A push's layers, from the engine's push messages (``add``), as one line.

    >>> push = PushProgress("registry.local:5000/spotgpu/pytorch:1")
    >>> for message in [
    ...     {"status": "Preparing", "id": "a1"}, {"status": "Preparing", "id": "b2"},
    ...     {"status": "Layer already exists", "id": "a1"},
    ...     {"status": "Pushing", "progressDetail": {"current": 30_000_000,
    ...                                              "total": 120_000_000}, "id": "b2"},
    ... ]:
    ...     push.add(message)
    >>> push.line()
    'pushing registry.local:5000/spotgpu/pytorch:1: 30 of 120 MB, 1 of 2 layers done'
    >>> push.add({"status": "Pushing", "progressDetail": {"current": 125_000_000,
    ...                                                   "total": 120_000_000}, "id": "b2"})
    >>> push.add({"status": "Pushed", "progressDetail": {}, "id": "b2"})
    >>> push.line()
    'pushing registry.local:5000/spotgpu/pytorch:1: 120 of 120 MB, 2 of 2 layers done'
    """

    _DONE = ("Pushed", "Layer already exists", "Mounted from")

    def __init__(self, reference: str) -> None:
        self.reference = reference
        self.layers: dict[str, list] = {}  # id -> [current, total, done]
        self.digest: str | None = None

    def add(self, message: dict) -> None:
        aux = message.get("aux") or {}
        if aux.get("Digest"):
            self.digest = aux["Digest"]
        layer = message.get("id")
        if not layer or "status" not in message or message["status"].startswith(("The push",)):
            return
        current, total, done = self.layers.setdefault(layer, [0, 0, False])
        detail = message.get("progressDetail") or {}
        status = message["status"]
        if status == "Pushing":
            current, total = detail.get("current") or current, detail.get("total") or total
        if status.startswith(self._DONE):
            done, current = True, total or current
        self.layers[layer] = [min(current, total) if total else current, total, done]

    def line(self) -> str:
        """(The engine's totals are its estimates: a layer's bytes sent are shown at most its
        total, and all of it once it is pushed.)"""
        sent = sum(current for current, _, _ in self.layers.values()) / 1e6
        total = sum(total for _, total, _ in self.layers.values()) / 1e6
        done = sum(1 for *_, finished in self.layers.values() if finished)
        return (
            f"pushing {self.reference}: {sent:.0f} of {total:.0f} MB, "
            f"{done} of {len(self.layers)} layers done"
        )
