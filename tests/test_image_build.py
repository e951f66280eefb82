"""``spotgpu admin image build`` on a real Docker engine and a real registry, as an operator
runs it (a subprocess, the admin key in the environment): a base without prefect-spotgpu (a
Python image with Prefect, as the catalogue's are) becomes a flow-ready catalogue image, built
from a wheelhouse with no package index, checked, pushed; then a decorated flow whose code is
only in the caller's script picks it by name and runs in it on two docker nodes through a
reclaim, completing with the uninterrupted result. Then what the command refuses, each in one
line that says what to change: a base with no Python, one too old, one without pip, a
wheelhouse that lacks a dependency, a registry that refuses the push.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import docker_engine
from conftest import wait_for
from prefect_spotgpu.cli.stack import LocalStack

HERE = Path(__file__).parent
NAME = "built-flows"
STEPS = 40
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(job_image, registry):
    home = Path(tempfile.mkdtemp(prefix="spotgpu-image-build-"))
    home.chmod(0o711)  # the job users traverse it to their directories
    try:
        with LocalStack(home, heartbeat_timeout_seconds=3) as stack:
            stack.start_prefect_server(host=docker_engine.bridge_gateway())
            stack.start_market()
            stack.wheelhouse = docker_engine.wheelhouse(home / "wheelhouse")
            stack.base = docker_engine.python_image()
            stack.registry = registry
            yield stack
    finally:
        docker_engine.remove_job_containers()
        shutil.rmtree(home, ignore_errors=True)


def build(stack, *args: str, registry: str | None = None) -> subprocess.CompletedProcess:
    """``spotgpu admin image build`` as the operator runs it."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "prefect_spotgpu.cli", "admin", "image", "build", *args),
            *("--wheelhouse", str(stack.wheelhouse)),
            *("--registry", registry or f"{stack.registry.address}/spotgpu-test"),
            *("--market", stack.market_url),
        ],
        env={**os.environ, "SPOTGPU_ADMIN_KEY": stack.admin_key, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def progress_of(stack) -> list[dict]:
    entries = []
    for path in (stack.home / "node-checkpoints").glob("tenant-*/walk.jsonl"):
        entries += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return entries


def test_a_base_made_flow_ready_runs_a_decorated_flow_through_a_reclaim(stack):
    began = time.monotonic()
    out = build(stack, NAME, "--base", stack.base, "--framework", "Prefect + NumPy (built)")
    built_in = time.monotonic() - began
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    tag = docker_engine_tag(stack.base)
    reference = f"{stack.registry.address}/spotgpu-test/{NAME}:{tag}"
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"base {stack.base}: Python 3.11"), lines
    assert "installing prefect-spotgpu 0.1.0 from" in lines[0]
    for said in (
        f"building {reference}",
        "  Step 1/5 : FROM " + stack.base,
        "checked: python -m prefect_spotgpu.launch imports (Prefect",
        f"pushing {reference}",
        f"pushed {reference} in ",
        f"added image '{NAME}': {reference} (Prefect + NumPy (built); runs flows), sha256:",
    ):
        assert any(line.startswith(said) for line in lines), (said, lines)
    entry = next(i for i in stack.market().get("/images").json() if i["name"] == NAME)
    assert entry["runs_flows"] is True and entry["reference"] == reference
    tags = f"http://{stack.registry.address}/v2/spotgpu-test/{NAME}/tags/list"
    with urllib.request.urlopen(tags, timeout=10) as answer:
        assert tag in json.load(answer)["tags"]  # the registry holds it

    for name in ("node-a", "node-b"):
        stack.start_agent(name, runner="docker")
    pool = stack.create_pool("spot-built", defaults={"gpu_count": 2, "max_price": 1.5})
    started = time.monotonic()
    caller = subprocess.Popen(
        [sys.executable, str(HERE / "built_image_flow.py"), pool, NAME, str(STEPS)],
        cwd=stack.home,  # nothing of the tests' folder on the caller's path but the script
        env={**os.environ, "PREFECT_API_URL": stack.prefect_api_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: sum("step" in e for e in progress_of(stack)) >= 8, 180, "progress")
        first = int(next(e["alloc"] for e in progress_of(stack) if "start" in e))
        node = stack.market().get(f"/allocations/{first}").json()["node_id"]
        owner = stack.market(stack.owner_key)
        reclaimed_at = time.monotonic()
        assert owner.patch(f"/nodes/{node}", json={"state": "reclaimed"}).is_success
        stdout, stderr = caller.communicate(timeout=240)
    finally:
        if caller.poll() is None:
            caller.kill()
    answer = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    assert answer.get("result", {}).get("total") == sum(s * s for s in range(STEPS)), (
        answer,
        stderr[-3000:],
    )
    assert answer["result"]["python"].startswith("/opt/venv/")  # the image's Python
    entries = progress_of(stack)
    starts = [e for e in entries if "start" in e]
    saved = [e["saved"] for e in entries if "saved" in e]
    assert len(starts) == 2 and int(starts[1]["alloc"]) != first, entries
    assert starts[1]["start"] == saved[0] + 1  # resumed from the final save
    print(
        json.dumps(
            {
                "image_build_push_catalogue_s": round(built_in, 1),
                "decorated_call_to_first_progress_s": round(reclaimed_at - started, 1),
                "reclaim_to_result_s": round(time.monotonic() - reclaimed_at, 1),
            }
        )
    )


def docker_engine_tag(base: str) -> str:
    from prefect_spotgpu.cli.image_recipe import default_tag

    return default_tag(base, "0.1.0")


def test_what_the_command_refuses_is_one_line_saying_what_to_change(stack):
    bare = docker_engine.base_image()  # Debian's python3: no pip, ensurepip disabled
    no_python = _derived("spotgpu-test-nopython:1", bare, "RUN rm -f /usr/bin/python3*")
    fake = '#!/bin/sh\necho \'{"python": "/usr/local/bin/python3", "version": [3, 9, 18]}\'\n'
    old_python = _derived(  # a python3 that says it is 3.9 (a fake: only the probe runs it)
        "spotgpu-test-oldpython:1",
        bare,
        "COPY python3 /usr/local/bin/python3",
        files={"python3": fake},
    )
    cases = [
        (no_python, "the base has no Python (neither python3 nor python on its PATH)"),
        (old_python, "the base's Python (/usr/local/bin/python3) is 3.9.18, which prefect-spotgpu"),
        (bare, "has no pip and no ensurepip to bootstrap it"),
    ]
    for base, says in cases:
        out = build(stack, "refused", "--base", base, "--framework", "F")
        assert out.returncode == 1 and says in out.stdout, out.stdout + out.stderr
        assert "Traceback" not in out.stdout + out.stderr
        print(out.stdout.strip())

    out = build(stack, "refused", "--base", "spotgpu-test/no-such-base:1", "--framework", "F")
    assert out.returncode == 1 and "the base spotgpu-test/no-such-base:1 is not found" in (
        out.stdout
    ), out.stdout
    print(out.stdout.strip())

    lacking = stack.home / "lacking"  # prefect-spotgpu, without prefect-docker
    lacking.mkdir()
    for wheel in stack.wheelhouse.glob("*.whl"):
        if not wheel.name.startswith(("prefect_docker-", "prefect-docker-")):
            shutil.copy(wheel, lacking)
    out = subprocess.run(
        [
            *(sys.executable, "-m", "prefect_spotgpu.cli", "admin", "image", "build", "refused"),
            *("--base", stack.base, "--framework", "F", "--wheelhouse", str(lacking)),
            *("--registry", f"{stack.registry.address}/spotgpu-test", "--market", stack.market_url),
        ],
        env={**os.environ, "SPOTGPU_ADMIN_KEY": stack.admin_key, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"the wheelhouse {lacking} has no wheel of prefect-docker" in out.stdout, out.stdout
    assert "Python 3.11" in out.stdout
    print(out.stdout.strip().splitlines()[-1])

    out = build(stack, "refused", "--base", stack.base, "--framework", "F",
                registry="127.0.0.1:9/spotgpu-test")  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the registry refused the push of 127.0.0.1:9/spotgpu-test/refused:" in out.stdout
    assert "docker login 127.0.0.1:9" in out.stdout
    print(out.stdout.strip().splitlines()[-1])
    names = [i["name"] for i in stack.market().get("/images").json()]
    assert "refused" not in names  # nothing refused reached the catalogue


def _derived(name: str, base: str, step: str, files: dict[str, str] | None = None) -> str:
    """``base`` plus one step (and ``files``, executable, in its context), built once per
    engine."""
    if subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode:
        with tempfile.TemporaryDirectory() as context:
            for file, text in (files or {}).items():
                (Path(context) / file).write_text(text)
                (Path(context) / file).chmod(0o755)
            (Path(context) / "Dockerfile").write_text(f"FROM {base}\n{step}\n")
            subprocess.run(
                ["docker", "build", "-q", "-t", name, context],
                check=True,
                capture_output=True,
                env={**os.environ, "DOCKER_BUILDKIT": "0"},
            )
    return name
