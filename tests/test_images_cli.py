"""``spotgpu admin image list|add|remove``, run as the operator would (a subprocess, the key in
the environment), against the real market service on a loopback port."""

from __future__ import annotations

import os

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
    assert "added image 'lab-jax': ghcr.io/lab/jax:0.4.35-cuda12 (JAX 0.4.35)" in out.stdout
    listed = {i["name"]: i for i in service.client().get("/images").json()}
    assert listed["lab-jax"]["cuda_version"] == "12.6"
    assert listed["lab-jax"]["description"] == markup
    out = image("list", env=env)
    row = next(line for line in out.stdout.splitlines() if "lab-jax" in line)
    for text in ("ghcr.io/lab/jax:0.4.35-cuda12", "JAX 0.4.35", "12.6", markup):
        assert text in row, row

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
def test_a_tenant_key_or_no_market_is_one_clear_line(service):
    tenant = service.tenant("not-the-operator")
    key = tenant.headers["Authorization"].removeprefix("Bearer ")
    env = _env(service, SPOTGPU_ADMIN_KEY=key)
    before = service.client().get("/images").json()
    out = image("add", "mine", "ghcr.io/me/job:1", "--framework", "F", env=env)
    assert out.returncode == 1 and out.stdout.startswith("error 403"), out.stdout
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
    for command in ("list", "add", "remove"):
        assert command in listing.output
        result = runner.invoke(app, ["admin", "image", command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "Options" in result.output and len(result.output.split("Usage:")[1]) > 200
    add = runner.invoke(app, ["admin", "image", "add", "--help"], env={"COLUMNS": "200"})
    for option in ("--framework", "--cuda", "--description", "--replace", "--market"):
        assert option in add.output
    assert "@sha256:DIGEST" in add.output
