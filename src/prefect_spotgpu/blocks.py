"""Prefect blocks: the market connection and the checkpoint storage a spot flow uses.

Register them with ``prefect block register -m prefect_spotgpu.blocks`` (they are also
found through the ``prefect.collections`` entry point). Secrets are ``SecretStr``.
"""

from __future__ import annotations

import os

import anyio
import httpx
from prefect.blocks.core import Block
from prefect.filesystems import WritableFileSystem
from pydantic import Field, SecretStr, model_validator

from prefect_spotgpu.api_client import DEFAULT_TIMEOUT, api_client, async_api_client
from prefect_spotgpu.protocol import JOB_ENV

LOGO = "https://raw.githubusercontent.com/prefect-spotgpu/prefect-spotgpu/main/src/prefect_spotgpu/logo.png"
"""The packaged ``logo.png`` (64x64), where the project publishes it."""
DOCS = "https://pypi.org/project/prefect-spotgpu/"
RESULTS = "results"
"""Where a storage block keeps Prefect results (the flow runs' return values)."""


class SpotMarket(Block):
    """Connection to a prefect-spotgpu market service: its URL and your tenant API key.

    Example:
        Load a saved market and ask it who you are:
        ```python
        from prefect_spotgpu.blocks import SpotMarket

        market = SpotMarket.load("BLOCK_NAME")
        with market.get_client() as client:
            print(client.get("/me").json())
        ```
    """

    _block_type_name = "Spot Market"
    _logo_url = LOGO
    _documentation_url = DOCS

    url: str = Field(
        default="http://127.0.0.1:4300",
        description="Base URL of the market service, e.g. http://127.0.0.1:4300.",
    )
    api_key: SecretStr = Field(description="Your tenant's API key (sgk_...).")

    def get_client(self, timeout: float = 60.0) -> httpx.Client:
        """An HTTP client for the market's ``/api/v1``, authenticated as the tenant."""
        return api_client(self.url, self.api_key.get_secret_value(), timeout)

    def get_async_client(self, timeout: float = DEFAULT_TIMEOUT) -> httpx.AsyncClient:
        """``get_client``, for asyncio callers (the worker)."""
        return async_api_client(self.url, self.api_key.get_secret_value(), timeout)


class CheckpointStorage(WritableFileSystem):
    """Where spot flows keep their checkpoints: a local (shared) directory, or S3.

    It is also where everything else of a run lives that another host must find: the bundles
    of decorated flows (``bundles/``), their results (``results/``: this block serves as
    Prefect result storage, ``read_path``/``write_path``) and a flow's outputs (``outputs/``).

    Example:
        Give a flow its checkpointer:
        ```python
        from prefect_spotgpu.blocks import CheckpointStorage
        from prefect_spotgpu.checkpoint import Checkpointer

        storage = CheckpointStorage.load("BLOCK_NAME")
        ckpt = Checkpointer(storage.get_storage(), key="my-run")
        ```
    """

    _block_type_name = "Spot Checkpoint Storage"
    _logo_url = LOGO
    _documentation_url = DOCS

    path: str | None = Field(
        default=None, description="A directory every node can reach, e.g. /mnt/ckpt."
    )
    bucket: str | None = Field(default=None, description="S3 bucket, for S3 storage.")
    prefix: str = Field(default="", description="Key prefix inside the bucket.")
    endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, Ceph); empty for AWS."
    )
    region_name: str | None = Field(default=None, description="S3 region, e.g. us-east-1.")
    aws_access_key_id: str | None = Field(default=None, description="S3 access key id.")
    aws_secret_access_key: SecretStr | None = Field(
        default=None, description="S3 secret access key."
    )

    @model_validator(mode="after")
    def _one_place(self) -> CheckpointStorage:
        if (self.path is None) == (self.bucket is None):
            raise ValueError("give either path (local) or bucket (S3), not both")
        return self

    def url(self) -> str:
        """The storage as a URL: a path, or s3://bucket/prefix."""
        if self.path is not None:
            return self.path
        return f"s3://{self.bucket}/{self.prefix.strip('/')}".rstrip("/")

    def here(self) -> str | None:
        """The block's directory as this process reaches it: ``path``; but in a job whose node
        mounts the tenant's directory elsewhere (a container: the job's
        ``SPOTGPU_CHECKPOINT_URL``, ``/spotgpu/checkpoints``) and where ``path`` is not, that
        mount, as the bundle executor reads bundles: so a result a flow writes in a container
        lands where its caller reads it."""
        given = os.environ.get(JOB_ENV.CHECKPOINT_URL, "")
        if (
            self.path is not None
            and given.startswith("/")
            and not os.path.isdir(self.path)
            and os.path.isdir(given)
        ):
            return given
        return self.path

    def get_storage(self):
        """The checkpoint library's storage object for this block."""
        from prefect_spotgpu.checkpoint import LocalStorage, S3Storage

        if self.path is not None:
            return LocalStorage(self.here())
        secret = self.aws_secret_access_key
        return S3Storage(
            self.bucket,
            self.prefix,
            endpoint_url=self.endpoint_url,
            region_name=self.region_name,
            aws_access_key_id=self.aws_access_key_id,
            aws_secret_access_key=secret.get_secret_value() if secret else None,
        )

    def objects(self):
        """The storage's named objects (``checkpoint.objects``), with this block's credentials."""
        from prefect_spotgpu.checkpoint.objects import LocalObjects, S3Objects

        if self.path is not None:
            return LocalObjects(self.here())
        return S3Objects(self.bucket, self.prefix, client=self.get_storage().client)

    def read_path(self, path: str) -> bytes:
        """Prefect result storage: the result stored as ``path`` (under ``results/``)."""
        return self.objects().get(f"{RESULTS}/{path}")

    def write_path(self, path: str, content: bytes) -> str:
        """Prefect result storage: store ``content`` as ``path`` (under ``results/``)."""
        self.objects().put(f"{RESULTS}/{path}", content)
        return path

    async def aread_path(self, path: str) -> bytes:
        return await anyio.to_thread.run_sync(self.read_path, path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return await anyio.to_thread.run_sync(self.write_path, path, content)

    def job_env(self) -> dict[str, str]:
        """Environment for a job on a node: ``SPOTGPU_CHECKPOINT_URL`` and S3 credentials."""
        env = {JOB_ENV.CHECKPOINT_URL: self.url()}
        if self.bucket is not None:
            for name, value in (
                ("AWS_ACCESS_KEY_ID", self.aws_access_key_id),
                ("AWS_DEFAULT_REGION", self.region_name),
                ("AWS_ENDPOINT_URL_S3", self.endpoint_url),
            ):
                if value:
                    env[name] = value
            if self.aws_secret_access_key is not None:
                env["AWS_SECRET_ACCESS_KEY"] = self.aws_secret_access_key.get_secret_value()
        return env
