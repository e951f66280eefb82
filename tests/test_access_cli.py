"""``spotgpu admin`` access commands and ``spotgpu keys``, run as the operator and a tenant
would, against the real service."""

from __future__ import annotations

import os

from typer.testing import CliRunner

from conftest import ADMIN_KEY, one_database
from test_cli import spotgpu


def _env(service, **extra) -> dict[str, str]:
    return {
        **os.environ,
        "SPOTGPU_MARKET_URL": service.base_url,
        "SPOTGPU_ADMIN_KEY": ADMIN_KEY,
        "COLUMNS": "200",
        **extra,
    }


@one_database("the CLI's rendering of the API's replies")
def test_the_operator_grants_and_revokes_providers_keys_and_node_tokens(service):
    env = _env(service)
    tenant = service.tenant("carol")
    body = {"name": "n", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 1}
    assert tenant.post("/nodes", json={**body, "reserve_price": 0.9}).status_code == 403
    out = spotgpu("admin", "grant-provider", "carol", env=env)
    assert out.returncode == 0 and "carol is now a provider" in out.stdout, out.stderr
    node = tenant.post("/nodes", json={**body, "reserve_price": 0.9}).json()
    agent = service.client(node["token"])
    assert agent.get("/nodes/me").status_code == 200
    out = spotgpu("admin", "revoke-node", str(node["id"]), env=env)
    assert out.returncode == 0 and "agent token revoked" in out.stdout, out.stderr
    assert agent.get("/nodes/me").status_code == 401
    out = spotgpu("admin", "revoke-provider", "carol", env=env)
    assert out.returncode == 0 and "no longer a provider" in out.stdout
    assert (
        tenant.post("/nodes", json={**body, "name": "m", "reserve_price": 0.9}).status_code == 403
    )
    out = spotgpu("admin", "revoke-keys", "carol", env=env)
    assert out.returncode == 0 and "revoked 1 key(s)" in out.stdout
    assert tenant.get("/me").status_code == 401
    out = spotgpu("admin", "issue-key", "carol", env=env)
    key = out.stdout.split(": ")[-1].strip()
    assert service.client(key).get("/me").json()["name"] == "carol"
    out = spotgpu("admin", "grant-provider", "nobody-here", env=env)
    assert out.returncode == 1 and "no tenant named" in out.stdout


@one_database("the CLI's rendering of the API's replies")
def test_a_tenant_rotates_its_key_and_its_nodes_token_from_the_environment(service, tmp_path):
    tenant = service.tenant()
    node, agent = service.node(tenant, gpus=1)
    old = tenant.headers["Authorization"].removeprefix("Bearer ")
    key_file = tmp_path / "key"
    out = spotgpu(
        "keys", "rotate", "--write", str(key_file), env=_env(service, SPOTGPU_API_KEY=old)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert service.client(old).get("/me").status_code == 401
    out = spotgpu(
        "keys", "node-token", str(node["id"]), "--api-key-file", str(key_file), env=_env(service)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    token = out.stdout.split(": ")[-1].strip()
    assert agent.get("/nodes/me").status_code == 401
    assert service.client(token).get("/nodes/me").json()["id"] == node["id"]
    out = spotgpu(
        "keys", "rotate", env={k: v for k, v in _env(service).items() if k != "SPOTGPU_API_KEY"}
    )
    assert out.returncode == 2 and "SPOTGPU_API_KEY" in out.stdout


def test_new_secret_key_prints_a_usable_key():
    from prefect_spotgpu.service.sealing import Sealer

    out = spotgpu("admin", "new-secret-key")
    assert out.returncode == 0
    Sealer(out.stdout.strip()).seal({"A": "b"})


def test_no_command_takes_a_key_on_its_command_line():
    """Every user of a host can read a process's argv (``ps``): keys come from a file or the
    environment. Each of these options is refused (typer's usage error, exit 2)."""
    from prefect_spotgpu.cli.app import app

    for args in (
        ["bids", "--api-key", "sgk_x"],
        ["nodes", "--api-key", "sgk_x"],
        ["node", "reclaim", "1", "--api-key", "sgk_x"],
        ["blocks", "save", "--api-key", "sgk_x", "--checkpoints", "/tmp"],
        ["agent", "start", "--token", "sgk_x", "--gpus", "A100-80G:1"],
        ["keys", "rotate", "--api-key", "sgk_x"],
        ["admin", "image", "add", "x", "a/b:1", "--framework", "F", "--admin-key", "sgadm_x"],
        ["admin", "image", "remove", "x", "--api-key", "sgadm_x"],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "No such option" in result.output, (args, result.output)
