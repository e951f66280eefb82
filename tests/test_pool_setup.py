"""``spotgpu blocks save`` and ``spotgpu pool setup|check`` against a real Prefect server and
the real market (issue 16, items 2 and 3): a pool of the wrong type is named and recreated
only when asked, the blocks are linked without hand-editing the base job template."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from conftest import start_service
from test_cli import spotgpu

pytestmark = pytest.mark.slow


@pytest.fixture
def service(tmp_path):
    """The market on SQLite (what this test checks is the Prefect side)."""
    svc = start_service(f"sqlite:///{tmp_path / 'market.db'}", tmp_path / "home")
    yield svc
    svc.stop()


def test_blocks_save_and_pool_setup_link_a_spot_gpu_pool(prefect_api_url, service, tmp_path):
    buyer = service.tenant("pool-user")
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "SPOTGPU_MARKET_URL": service.base_url,
        "SPOTGPU_API_KEY": buyer.headers["Authorization"].removeprefix("Bearer "),
        "COLUMNS": "200",
    }
    pool = f"spot-{tmp_path.name[-8:]}".replace("_", "-")

    out = spotgpu("pool", "check", pool, env=env)
    assert out.returncode == 1 and f"no work pool {pool!r}" in out.stdout, out.stdout
    # what `prefect worker start --pool NAME` does when the pool is missing: a process pool
    made = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    out = spotgpu("pool", "check", pool, env=env)
    assert out.returncode == 1 and "of type 'process'" in out.stdout, out.stdout
    assert "outside the market" in out.stdout and "--replace" in out.stdout

    out = spotgpu("pool", "setup", pool, "--market-block", "m-x", env=env)
    assert out.returncode == 2 and "spotgpu blocks save" in out.stdout + out.stderr
    ckpt = tmp_path / "ckpt"
    out = spotgpu(
        "blocks", "save", "--checkpoints", str(ckpt), "--market-name", "m-x",
        "--storage-name", "s-x", env=env,
    )  # fmt: skip
    assert out.returncode == 0 and "saved Spot Market 'm-x'" in out.stdout, out.stderr
    out = spotgpu("pool", "setup", pool, "--market-block", "m-x", "--storage-block", "s-x", env=env)
    assert out.returncode == 2 and "--replace" in out.stdout + out.stderr  # never silently
    out = spotgpu(
        "pool", "setup", pool, "--market-block", "m-x", "--storage-block", "s-x", "--replace",
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"created work pool {pool!r} of type spot-gpu" in out.stdout
    assert f"prefect worker start --pool {pool} --type spot-gpu" in out.stdout
    out = spotgpu("pool", "check", pool, env=env)
    assert out.returncode == 0, out.stdout
    assert "market at" in out.stdout and "tenant pool-user" in out.stdout

    async def linked():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            found = await client.read_work_pool(pool)
            market = await client.read_block_document_by_name("m-x", "spot-market")
            storage = await client.read_block_document_by_name("s-x", "spot-checkpoint-storage")
        props = found.base_job_template["variables"]["properties"]
        return (
            found.type,
            props["market"]["default"],
            props["checkpoint_storage"]["default"],
            str(market.id),
            str(storage.id),
            storage.data,
        )

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api_url}):
        kind, market_ref, storage_ref, market_id, storage_id, data = asyncio.run(linked())
    assert kind == "spot-gpu"
    assert market_ref == {"$ref": {"block_document_id": market_id}}
    assert storage_ref == {"$ref": {"block_document_id": storage_id}}
    assert data["path"] == str(ckpt)
