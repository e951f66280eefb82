"""``spotgpu admin image list|add|remove``, run as the operator would (a subprocess, the key in
the environment), against the real market service on a loopback port."""

from __future__ import annotations

import os
import zipfile

import pytest
from typer.testing import CliRunner

from conftest import ADMIN_KEY
from test_cli import spotgpu


def _env(service, **extra) -> dict[str, str]:
    return {
        **os.environ,
        "SPOTGPU_MARKET_URL": service.base_url,
        "SPOTGPU_ADMIN_KEY": ADMIN_KEY,
        "COLUMNS": "250",
        **extra,
    }


def image(*args: str, env: dict[str, str]):
    return spotgpu("admin", "image", *args, env=env)


ONE_DATABASE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
"""The command line is a client of the API, the same whatever the market's database; the
catalogue's routes are tried on both databases in ``test_images.py``."""


@ONE_DATABASE
def test_the_operator_adds_replaces_lists_and_removes_an_image(service):
    env = _env(service)
    out = image("list", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for seeded in service.client().get("/images").json():
        assert seeded["name"] in out.stdout and seeded["reference"] in out.stdout
    markup = "[bold red]ours[/bold red] <img src=x>"  # operator text: shown as typed
    out = image(
        "add", "lab-jax", "ghcr.io/lab/jax:0.4.35-cuda12", "--framework", "JAX 0.4.35",
        "--cuda", "12.6", "--description", markup, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "added image 'lab-jax': ghcr.io/lab/jax:0.4.35-cuda12 (JAX 0.4.35; runs only a job's "
        "own command)" in out.stdout
    )
    listed = {i["name"]: i for i in service.client().get("/images").json()}
    assert listed["lab-jax"]["cuda_version"] == "12.6"
    assert listed["lab-jax"]["description"] == markup
    out = image("list", env=env)
    row = next(line for line in out.stdout.splitlines() if "lab-jax" in line)
    for text in ("ghcr.io/lab/jax:0.4.35-cuda12", "JAX 0.4.35", "12.6", markup, " command "):
        assert text in row, row
    pytorch = next(line for line in out.stdout.splitlines() if "pytorch/pytorch:" in line)
    assert " command " in pytorch, pytorch  # a seeded base: no prefect-spotgpu in it
    assert "'command' images run only a job's own command" in out.stdout
    assert "spotgpu admin image build NAME --wheelhouse DIR --registry HOST/PATH" in out.stdout
    out = image(
        "add", "lab-flows", "ghcr.io/lab/flows:1", "--framework", "F", "--runs-flows", env=env
    )
    assert out.returncode == 0 and "(F; runs flows)" in out.stdout, out.stdout
    row = next(line for line in image("list", env=env).stdout.splitlines() if "lab-flows" in line)
    assert " flows " in row, row
    assert image("remove", "lab-flows", env=env).returncode == 0

    out = image("add", "lab-jax", "ghcr.io/lab/jax:0.4.36", "--framework", "JAX", env=env)
    assert out.returncode == 1, out.stdout
    assert "error 409" in out.stdout and "'lab-jax'" in out.stdout and "--replace" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    assert len(out.stdout.strip().splitlines()) == 1  # one line at any width
    assert service.client().get("/images").json() == list(listed.values())  # nothing written

    out = image(
        "add", "lab-jax", "ghcr.io/lab/jax:0.4.36", "--framework", "JAX 0.4.36", "--replace",
        env=env,
    )  # fmt: skip
    assert out.returncode == 0 and "replaced image 'lab-jax'" in out.stdout, out.stdout
    replaced = {i["name"]: i for i in service.client().get("/images").json()}["lab-jax"]
    assert replaced["reference"] == "ghcr.io/lab/jax:0.4.36" and replaced["cuda_version"] is None
    out = image("add", "lab-new", "ghcr.io/lab/new:1", "--framework", "F", "--replace", env=env)
    assert out.returncode == 0 and "added image 'lab-new'" in out.stdout, out.stdout

    out = image("remove", "lab-jax", env=env)
    assert out.returncode == 0 and "removed image 'lab-jax'" in out.stdout, out.stdout
    names = [i["name"] for i in service.client().get("/images").json()]
    assert "lab-jax" not in names and "lab-new" in names
    out = image("remove", "lab-jax", env=env)
    assert out.returncode == 1 and "error 404" in out.stdout and "'lab-jax'" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


@ONE_DATABASE
def test_bad_input_is_refused_naming_the_field(service):
    env = _env(service)
    out = image("add", "ok-name", "Not A Reference", "--framework", "F", "--cuda", "x", env=env)
    assert out.returncode == 1 and "error 422" in out.stdout, out.stdout
    assert "reference:" in out.stdout and "cuda_version:" in out.stdout
    for name in ("Bad Name", "../tenants", "process"):  # refused before any request
        out = image("add", name, "a/b:1", "--framework", "F", env=env)
        assert out.returncode == 2 and "Invalid value for 'name'" in out.stderr, out.stderr
        out = image("remove", name, env=env)
        assert out.returncode == 2 and "'name'" in out.stderr, out.stderr
    out = image("add", "ok-name", "a/b:1", env=env)
    assert out.returncode == 2 and "--framework" in out.stderr
    names = {i["name"] for i in service.client().get("/images").json()}
    assert "ok-name" not in names


@ONE_DATABASE
def test_a_tenant_key_or_no_market_is_one_clear_line(service, tmp_path):
    tenant = service.tenant("not-the-operator")
    key = tenant.headers["Authorization"].removeprefix("Bearer ")
    env = _env(service, SPOTGPU_ADMIN_KEY=key)
    before = service.client().get("/images").json()
    out = image("add", "mine", "ghcr.io/me/job:1", "--framework", "F", env=env)
    assert out.returncode == 1 and out.stdout.startswith("error 403"), out.stdout
    wheelhouse = tmp_path / "wheelhouse"  # checked first: a wheelhouse that would do
    wheelhouse.mkdir()
    with zipfile.ZipFile(wheelhouse / "prefect_spotgpu-0.1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("prefect_spotgpu-0.1.0.dist-info/METADATA", "Version: 0.1.0\n")
    build = ("build", "pytorch", "--wheelhouse", str(wheelhouse), "--registry", "r.example/x")
    out = image(*build, env={**env, "DOCKER_HOST": "tcp://127.0.0.1:9"})
    assert out.returncode == 1 and out.stdout.startswith("error 403"), out.stdout
    assert "only the operator changes the catalogue" in out.stdout
    assert "nothing was built" in out.stdout  # refused before the engine is asked anything
    out = image("remove", "pytorch", env=env)
    assert out.returncode == 1 and out.stdout.startswith("error 403"), out.stdout
    assert service.client().get("/images").json() == before
    out = image("list", env=env)  # the catalogue is public
    assert out.returncode == 0 and "pytorch" in out.stdout
    gone = _env(service, SPOTGPU_MARKET_URL="http://127.0.0.1:9")
    for args in (("list",), ("remove", "pytorch"), ("add", "x", "a/b:1", "--framework", "F")):
        out = image(*args, env=gone)
        assert out.returncode == 1, out.stdout
        assert "cannot reach the market at http://127.0.0.1:9" in out.stdout
        assert "Traceback" not in out.stdout + out.stderr


def test_every_image_command_has_help():
    from prefect_spotgpu.cli.app import app

    runner = CliRunner()
    listing = runner.invoke(app, ["admin", "image", "--help"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    for command in ("list", "add", "build", "remove"):
        assert command in listing.output
        result = runner.invoke(app, ["admin", "image", command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "Options" in result.output and len(result.output.split("Usage:")[1]) > 200
    add = runner.invoke(app, ["admin", "image", "add", "--help"], env={"COLUMNS": "200"})
    for option in ("--framework", "--cuda", "--description", "--replace", "--market"):
        assert option in add.output
    assert "@sha256:DIGEST" in add.output
    assert "--runs-flows" in add.output and "--command-only" in add.output
    build = runner.invoke(app, ["admin", "image", "build", "--help"], env={"COLUMNS": "200"})
    for option in ("--base", "--wheelhouse", "--registry", "--tag", "--framework", "--market"):
        assert option in build.output


@ONE_DATABASE
def test_image_build_refuses_a_wheelhouse_without_prefect_spotgpu_before_any_engine(
    service, tmp_path
):
    """The wheelhouse and the entry are checked before the engine is asked anything: one line
    each, saying what to change (``DOCKER_HOST`` points nowhere: no engine is reached)."""
    env = _env(service, DOCKER_HOST="tcp://127.0.0.1:9")
    registry = ("--registry", "127.0.0.1:5000/spotgpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = image("build", "pytorch", "--wheelhouse", str(empty), *registry, env=env)
    assert out.returncode == 1, out.stdout
    assert "holds no wheels" in out.stdout and "pip wheel prefect-spotgpu -w DIR" in out.stdout
    others = tmp_path / "others"
    others.mkdir()
    (others / "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    out = image("build", "pytorch", "--wheelhouse", str(others), *registry, env=env)
    assert out.returncode == 1 and "holds no prefect-spotgpu wheel" in out.stdout, out.stdout
    out = image("build", "pytorch", "--wheelhouse", str(tmp_path / "nope"), *registry, env=env)
    assert out.returncode == 1 and "is not a folder" in out.stdout, out.stdout
    ours = tmp_path / "ours"
    ours.mkdir()
    wheel = ours / "prefect_spotgpu-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"not a zip")
    out = image("build", "pytorch", "--wheelhouse", str(ours), *registry, env=env)
    assert out.returncode == 1 and "is not a wheel" in out.stdout, out.stdout
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "prefect_spotgpu-0.1.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: prefect-spotgpu\nVersion: 0.1.0\n"
            "Requires-Python: >=3.11\n",
        )
    out = image("build", "lab-new", "--wheelhouse", str(ours), *registry, env=env)
    assert out.returncode == 1 and "give its --base" in out.stdout, out.stdout
    out = image("build", "pytorch", "--wheelhouse", str(ours), "--registry", "Bad Host", env=env)
    assert out.returncode == 1 and "--registry is HOST[:PORT]/PATH" in out.stdout, out.stdout
    out = image("build", "pytorch", "--wheelhouse", str(ours), *registry, env=env)
    assert out.returncode == 1 and "no Docker engine answers" in out.stdout, out.stdout
    assert "DOCKER_HOST" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    assert service.client().get("/images").json()[3]["runs_flows"] is False  # nothing written
