"""The Prefect blocks (standard block tests) and the spot-gpu worker's configuration models."""

from __future__ import annotations

import typing

import pytest
from prefect.testing.standard_test_suites import BlockStandardTestSuite
from pydantic import ValidationError

from conftest import one_database
from helpers import image
from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket
from prefect_spotgpu.checkpoint import LocalStorage, S3Storage
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.worker import SpotGPUWorker
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration


@pytest.mark.parametrize("block", [SpotMarket, CheckpointStorage])
class TestBlockStandards(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block):
        return block

    def test_has_a_valid_image(self, block):
        """The suite fetches ``_logo_url`` over the internet, which this machine cannot reach:
        check the packaged file the URL publishes, with the suite's own criteria."""
        from pathlib import Path

        from PIL import Image

        import prefect_spotgpu

        assert block._logo_url.endswith("/src/prefect_spotgpu/logo.png")
        img = Image.open(Path(prefect_spotgpu.__file__).parent / "logo.png")
        assert img.width == img.height and 1000 > img.width > 45


@one_database("the block's client; its routes are tested on both databases")
def test_the_market_block_talks_to_a_real_market(service):
    alice = service.tenant("alice")
    market = SpotMarket(url=service.base_url, api_key=alice.headers["Authorization"][7:])
    with market.get_client() as client:
        assert client.get("/me").json()["name"] == "alice"
    assert "sgk_" not in repr(market) and "sgk_" not in str(market.model_dump())


def test_checkpoint_storage_blocks(tmp_path):
    local = CheckpointStorage(path=str(tmp_path))
    assert isinstance(local.get_storage(), LocalStorage)
    assert local.job_env() == {"SPOTGPU_CHECKPOINT_URL": str(tmp_path)}
    s3 = CheckpointStorage(
        bucket="ckpt",
        prefix="runs/",
        endpoint_url="http://127.0.0.1:9",
        region_name="us-east-1",
        aws_access_key_id="AKIA",
        aws_secret_access_key="very-secret",
    )
    assert s3.url() == "s3://ckpt/runs" and isinstance(s3.get_storage(), S3Storage)
    env = s3.job_env()
    assert env["AWS_SECRET_ACCESS_KEY"] == "very-secret" and env["AWS_ENDPOINT_URL_S3"]
    assert "very-secret" not in repr(s3)
    with pytest.raises(ValidationError, match="either path"):
        CheckpointStorage()
    with pytest.raises(ValidationError, match="either path"):
        CheckpointStorage(path="/x", bucket="y")


def test_the_ui_form_offers_every_gpu_model_of_the_catalog():
    choices = typing.get_args(SpotGPUJobConfiguration.model_fields["gpu_model"].annotation)
    assert set(choices) == {m.name for m in DEFAULT_CATALOG}
    schema = SpotGPUWorker.get_default_base_job_template()["variables"]
    for name, field in schema["properties"].items():
        assert field.get("title") and field.get("description"), name


def test_each_job_variable_is_declared_once_and_the_form_is_the_configuration():
    """The pool's form is derived from the job configuration (no second model to drift): the
    same variables, each templated into the configuration, with the configuration's defaults."""
    from prefect.workers.base import BaseJobConfiguration, BaseVariables

    import prefect_spotgpu.worker.config as config

    assert SpotGPUWorker.job_configuration_variables is None
    assert not [
        v for v in vars(config).values() if isinstance(v, type) and issubclass(v, BaseVariables)
    ]
    template = SpotGPUWorker.get_default_base_job_template()
    form = template["variables"]["properties"]
    assert set(form) == set(SpotGPUJobConfiguration.model_fields)
    for name, field in SpotGPUJobConfiguration.model_fields.items():
        assert template["job_configuration"][name] == "{{ " + name + " }}"
        if field.default is not None and name not in BaseJobConfiguration.model_fields:
            assert form[name]["default"] == field.default, name
    assert form["max_price"]["default"] == 1.2


def test_a_flow_run_naming_an_image_that_runs_only_a_command_is_refused_with_the_way_out():
    """A seeded base holds no prefect-spotgpu: a flow in it would fail on the node after a bid
    was paid for. Refused before any bid, naming the images that run flows and the command
    that makes one (by name or by reference alike)."""
    base = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
    catalogue = [
        image("pytorch", base, runs_flows=False),
        image("tensorrt", "nvcr.io/nvidia/tensorrt:25.06-py3", runs_flows=False),
        image("pytorch-flows", "registry.example.com/spotgpu/pytorch:2.5.1-spotgpu0.1.0"),
    ]
    for named in ("pytorch", base):
        with pytest.raises(ValueError) as refused:
            SpotGPUJobConfiguration(image=named).catalogue_image(catalogue)
        message = str(refused.value)
        assert f"image {named!r} ({base}) runs only a job's own command, not a flow" in message
        assert "Images that run flows: process, pytorch-flows." in message
        assert "spotgpu admin image build pytorch --wheelhouse DIR --registry HOST/PATH" in message
        assert message.endswith("nothing was bid")
    ready = SpotGPUJobConfiguration(image="pytorch-flows").catalogue_image(catalogue)
    assert ready == "registry.example.com/spotgpu/pytorch:2.5.1-spotgpu0.1.0"
    only_bases = catalogue[:2]
    with pytest.raises(ValueError, match=r"Images that run flows: process\. The operator"):
        SpotGPUJobConfiguration(image="tensorrt").catalogue_image(only_bases)
    # one reference catalogued twice, once as flow-ready: the flow runs
    twice = [*only_bases, image("pt-ready", base)]
    assert SpotGPUJobConfiguration(image=base).catalogue_image(twice) == base


def test_job_configuration_rules():
    catalogue = [  # as the worker reads GET /images (messages.ImageResponse)
        image("pytorch", "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"),
        image("train", "ghcr.io/me/train:1"),
    ]
    config = SpotGPUJobConfiguration(gpu_model="nvidia h200", image="pytorch")
    assert config.gpu_model == "H200"
    assert config.catalogue_image(catalogue).startswith("pytorch/pytorch")
    assert SpotGPUJobConfiguration(image="process").catalogue_image(catalogue) is None
    by_reference = SpotGPUJobConfiguration(image="ghcr.io/me/train:1")
    assert by_reference.catalogue_image(catalogue) == "ghcr.io/me/train:1"
    unknown = SpotGPUJobConfiguration(image="ghcr.io/attacker/miner:1")
    with pytest.raises(
        ValueError,
        match=r"not in the market's image catalogue; known images: "
        r"process, pytorch, train",
    ):
        unknown.catalogue_image(catalogue)
    with pytest.raises(ValidationError, match="not a known GPU model"):
        SpotGPUJobConfiguration(gpu_model="B200")
    with pytest.raises(ValidationError, match="gpu_hours needs a deadline"):
        SpotGPUJobConfiguration(gpu_hours=3)
    with pytest.raises(ValidationError, match="catalogue"):
        SpotGPUJobConfiguration(image="Not An Image")


@pytest.mark.slow
def test_prefect_block_register_finds_both_blocks(tmp_path):
    """``prefect block register -m prefect_spotgpu.blocks`` against a real (temporary) server."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    env.pop("PREFECT_API_URL", None)
    prefect = Path(sys.executable).with_name("prefect")
    out = subprocess.run(
        [str(prefect), "block", "register", "-m", "prefect_spotgpu.blocks"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Spot Market" in out.stdout and "Spot Checkpoint Storage" in out.stdout


def test_a_local_block_in_a_container_reads_and_writes_the_jobs_mount(tmp_path, monkeypatch):
    """In a container the node mounts the tenant's directory at the job's checkpoint URL, not at
    the block's host path: results and outputs go there (where the caller reads them on the
    host); where the block's path exists (a process job, the caller), the path itself."""
    from prefect_spotgpu.blocks import CheckpointStorage
    from prefect_spotgpu.protocol import JOB_ENV

    mount = tmp_path / "mount"
    mount.mkdir()
    block = CheckpointStorage(path=str(tmp_path / "host" / "tenant-1"))
    assert block.here() == block.path  # no job here
    monkeypatch.setenv(JOB_ENV.CHECKPOINT_URL, str(mount))
    assert block.here() == str(mount)  # the host path is not in this container
    block.write_path("r1", b"result")
    assert (mount / "results" / "r1").read_bytes() == b"result"
    (tmp_path / "host" / "tenant-1").mkdir(parents=True)
    assert block.here() == block.path  # the path is here: it wins
    monkeypatch.setenv(JOB_ENV.CHECKPOINT_URL, "s3://bucket/x")
    (tmp_path / "host" / "tenant-1").rmdir()
    assert block.here() == block.path  # not a local mount
