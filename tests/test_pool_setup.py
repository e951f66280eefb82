"""``spotgpu blocks save`` and ``spotgpu pool setup|check`` against a real Prefect server and
the real market: a pool of the wrong type is named and recreated
only when asked, the blocks are linked without hand-editing the base job template."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from conftest import start_service
from helpers import image
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
            found.storage_configuration,
        )

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api_url}):
        kind, market_ref, storage_ref, market_id, storage_id, data, bundles = asyncio.run(linked())
    assert kind == "spot-gpu"
    # decorated flows: bundles and results through the same storage, no uv at run time
    assert bundles.bundle_upload_step == {
        "prefect_spotgpu.bundles.upload": {"launcher": ["python"], "block": "s-x"}
    }
    assert bundles.bundle_execution_step == {
        "prefect_spotgpu.bundles.execute": {"launcher": ["python"], "url": str(ckpt)}
    }
    assert str(bundles.default_result_storage_block_id) == storage_id
    inspected = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "storage", "inspect", pool],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "upload.block" in inspected.stdout and "s-x" in inspected.stdout, inspected.stdout
    assert "execution.url" in inspected.stdout
    assert market_ref == {"$ref": {"block_document_id": market_id}}
    assert storage_ref == {"$ref": {"block_document_id": storage_id}}
    assert data["path"] == str(ckpt)


def _pool_image(prefect_api_url: str, pool: str) -> dict:
    async def read():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            found = await client.read_work_pool(pool)
        return found.base_job_template["variables"]["properties"]["image"]

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api_url}):
        return asyncio.run(read())


def _deploy(prefect_api_url: str, pool: str, image: str) -> str | None:
    """Create a deployment on ``pool`` whose job runs ``image``: None if Prefect accepts its
    job variables, else what Prefect said."""

    async def create():
        from prefect.client.orchestration import get_client
        from prefect.exceptions import PrefectHTTPStatusError

        async with get_client() as client:
            flow_id = await client.create_flow_from_name("catalogue-check")
            try:
                await client.create_deployment(
                    flow_id,
                    f"uses-{image.replace('/', '-')}",
                    work_pool_name=pool,
                    job_variables={"image": image},
                )
            except PrefectHTTPStatusError as exc:
                return exc.response.text
        return None

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api_url}):
        return asyncio.run(create())


def test_pool_setup_offers_the_markets_image_catalogue(prefect_api_url, service, tmp_path):
    """The pool's form offers the market's flow-ready images (``runs_flows``: a pool's runs are
    flow runs; the seeded bases run only a job's own command, and the setup names them and
    the command that makes one flow-ready), each image's framework and CUDA in its
    description, and Prefect validates deployments against it; after the operator adds an
    image, ``pool setup`` offers it; ``pool check`` says when the two differ (a choice the
    market no longer holds is a problem); a market that does not answer leaves the choices as
    they were."""
    buyer = service.tenant("image-user")
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "SPOTGPU_MARKET_URL": service.base_url,
        "SPOTGPU_API_KEY": buyer.headers["Authorization"].removeprefix("Bearer "),
        "COLUMNS": "200",
    }
    pool = f"img-{tmp_path.name[-8:]}".replace("_", "-")
    blocks = ("--market-block", "m-img", "--storage-block", "s-img")
    out = spotgpu(
        "blocks", "save", "--checkpoints", str(tmp_path / "ckpt"), "--market-name", "m-img",
        "--storage-name", "s-img", env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    catalogue = service.client().get("/images").json()
    assert len(catalogue) >= 6 and not any(i["runs_flows"] for i in catalogue)  # bases
    for entry in catalogue:  # two made flow-ready, as `spotgpu admin image build` does
        if entry["name"] in ("pytorch", "tensorrt"):
            body = {k: entry[k] for k in ("framework", "cuda_version", "description")}
            body["reference"] = f"registry.example.com/spotgpu/{entry['name']}:1"
            made = service.admin.put(f"/images/{entry['name']}", json={**body, "runs_flows": True})
            assert made.status_code == 200, made.text
    catalogue = service.client().get("/images").json()
    seeded = [i["name"] for i in catalogue if i["runs_flows"]]
    command_only = [i["name"] for i in catalogue if not i["runs_flows"]]
    assert seeded == ["pytorch", "tensorrt"]
    out = spotgpu("pool", "setup", pool, *blocks, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "its form offers 2 flow-ready catalogue image(s) (pytorch, tensorrt)" in out.stdout
    assert (
        f"not offered, they run only a job's own command: {', '.join(command_only)} "
        "(spotgpu admin image build NAME --wheelhouse DIR --registry HOST/PATH makes one "
        "flow-ready)"
    ) in out.stdout
    image = _pool_image(prefect_api_url, pool)
    choices, reference = image["anyOf"]
    assert choices["enum"] == ["process", *seeded] and choices["title"] == "Catalogue image"
    assert reference["title"] == "Image reference" and "pattern" in reference
    assert image["default"] == "process" and image["title"] == "Image"
    for entry in catalogue:  # each choice's framework and CUDA, where the form shows them
        cuda = f"CUDA {entry['cuda_version']}" if entry["cuda_version"] else "no CUDA version"
        shown = f"{entry['name']} ({entry['framework']}, {cuda}" in image["description"]
        assert shown == entry["runs_flows"], entry
    assert _deploy(prefect_api_url, pool, "pytorch") is None
    refused = _deploy(prefect_api_url, pool, "Not An Image")
    assert refused is not None and "image" in refused, refused

    added = service.admin.post(
        "/images",
        json={"name": "lab-jax", "reference": "ghcr.io/lab/jax:0.4.35", "framework": "JAX 0.4.35",
              "cuda_version": "12.6", "description": "The lab's JAX image.", "runs_flows": True},
    )  # fmt: skip
    assert added.status_code == 201, added.text
    command = {"reference": "ghcr.io/lab/blender:4.2", "framework": "Blender 4.2"}
    assert service.admin.put("/images/lab-blender", json=command).status_code == 201
    out = spotgpu("pool", "check", pool, env=env)
    assert out.returncode == 0, out.stdout  # not offered yet: no run is refused for it
    assert (
        f"offers {len(seeded)} of the market's {len(seeded) + 1} flow-ready catalogue image(s)"
        in out.stdout
    )
    assert f"(not yet: lab-jax; spotgpu pool setup {pool} offers them)" in out.stdout
    out = spotgpu("pool", "setup", pool, *blocks, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"its form offers {len(seeded) + 1} flow-ready catalogue image(s)" in out.stdout
    assert "lab-jax" in out.stdout
    image = _pool_image(prefect_api_url, pool)
    assert "lab-jax" in image["anyOf"][0]["enum"]
    assert "lab-blender" not in image["anyOf"][0]["enum"] + [image["description"]]
    assert "lab-jax (JAX 0.4.35, CUDA 12.6)" in image["description"]
    assert image["description"].count("Catalogue:") == 1  # set up again: nothing piles up
    assert _deploy(prefect_api_url, pool, "lab-jax") is None
    assert _deploy(prefect_api_url, pool, "ghcr.io/lab/other:1") is None  # references still
    out = spotgpu("pool", "check", pool, env=env)
    assert out.returncode == 0, out.stdout
    assert f"its form offers the market's {len(seeded) + 1} flow-ready catalogue image(s)" in (
        out.stdout
    )
    assert service.admin.delete("/images/tensorrt").status_code == 204
    out = spotgpu("pool", "check", pool, env=env)
    assert out.returncode == 1, out.stdout
    assert (
        "FIX   its form offers image(s) the market's catalogue no longer holds as flow-ready "
        "(tensorrt)" in out.stdout
    )
    assert f"spotgpu pool setup {pool}" in out.stdout

    dead = {**env, "SPOTGPU_MARKET_URL": "http://127.0.0.1:9"}
    out = spotgpu(
        "blocks", "save", "--checkpoints", str(tmp_path / "ckpt"), "--market-name", "m-dead",
        "--storage-name", "s-img", env=dead,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    out = spotgpu("pool", "setup", pool, "--market-block", "m-dead", "--storage-block", "s-img",
                  env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the market at http://127.0.0.1:9 does not answer" in out.stdout
    assert f"the form keeps its image choices ({len(seeded) + 1} catalogue image(s)" in out.stdout
    assert _pool_image(prefect_api_url, pool) == image


def test_offer_images_keeps_the_workers_shape_with_the_catalogues_names():
    from prefect_spotgpu.cli.pool import offer_images, offered_names
    from prefect_spotgpu.worker import SpotGPUWorker

    shape = SpotGPUWorker.get_default_base_job_template()["variables"]["properties"]["image"]
    catalogue = [
        image("a-img", "r/a:1", framework="PyTorch 2.5.1"),
        image("b-img", "r/b:1", framework="", cuda_version=None),
    ]
    offered = offer_images({"default": "gone-img"}, shape, catalogue)
    assert set(offered) == set(shape)  # the same keys: the same form, other choices
    assert offered["anyOf"][0] == {
        **shape["anyOf"][0], "enum": ["process", "a-img", "b-img"], "title": "Catalogue image",
    }  # fmt: skip
    assert offered["anyOf"][1] == {**shape["anyOf"][1], "title": "Image reference"}
    assert offered["default"] == shape["default"]  # a default no longer offered is not kept
    assert offered["description"].startswith(shape["description"])
    assert offered["description"].endswith(
        "Catalogue: a-img (PyTorch 2.5.1, CUDA 12.4); b-img (no CUDA version given)."
    )
    assert offer_images(offered, shape, catalogue) == offered
    assert offer_images({"default": "b-img"}, shape, catalogue)["default"] == "b-img"
    assert offer_images({"default": "r/x:1"}, shape, catalogue)["default"] == "r/x:1"
    assert offer_images({}, shape, [])["anyOf"][0]["enum"] == ["process"]
    assert offered_names({"image": offered}) == ["a-img", "b-img"]
