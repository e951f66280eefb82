"""Named objects in a run's storage: flow bundles, results and a flow's outputs.

Checkpoints have their own layout (``storage.py``); everything else a spot run keeps goes
here, beside them, under names that say what they hold (``bundles/<key>``,
``results/<key>``, ``outputs/<run>/<file>``). The next attempt of a run may start on another
host, so anything it must find again lives here, never in the job's working directory.

Every write is atomic: a reader sees the whole object or none. :meth:`put_new` writes only
when the name is free and says whether it did, so two writers of one output never both win
(a local ``link`` that fails on an existing name; S3's conditional ``If-None-Match: *``).

Names are relative, ``/``-separated, of letters, digits and ``._-`` (no ``..``): a name from a
flow's parameters cannot reach outside the store.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from prefect_spotgpu.checkpoint.storage import _fsync_dir

NAME = re.compile(r"^(?!.*(^|/)\.\.?(/|$))[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def check_name(name: str) -> str:
    """``name`` when it is a safe relative object name; ValueError naming it otherwise."""
    if not isinstance(name, str) or len(name) > 1024 or not NAME.match(name):
        raise ValueError(
            f"object name {name!r} must be relative, '/'-separated parts of letters, digits "
            "and '._-' (no '.' or '..' parts), at most 1024 characters"
        )
    return name


class ObjectStore(Protocol):
    def put(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name``, replacing what was there, atomically."""

    def put_new(self, name: str, data: bytes) -> bool:
        """Write ``data`` as ``name`` only if no object has that name; whether it did."""

    def get(self, name: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""

    def exists(self, name: str) -> bool: ...

    def names(self, prefix: str) -> list[str]:
        """The names under ``prefix`` (a folder: ``outputs/run``; "" for all), sorted."""


class LocalObjects:
    """Objects as files under ``root`` (a directory every node reaches)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalObjects({str(self.root)!r})"

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    def _staged(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        os.replace(self._staged(path, data), path)
        _fsync_dir(path.parent)

    def put_new(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        tmp = self._staged(path, data)
        try:
            os.link(tmp, path)  # fails on an existing name: the first writer wins
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        _fsync_dir(path.parent)
        return True

    def get(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def names(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )


class S3Objects:
    """Objects in S3 under ``prefix`` (a client from ``checkpoint.S3Storage``'s settings)."""

    def __init__(self, bucket: str, prefix: str = "", *, client=None, **options) -> None:
        if client is None:
            from prefect_spotgpu.checkpoint.storage import S3Storage

            client = S3Storage(bucket, prefix, **options).client
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), client

    def __repr__(self) -> str:
        return f"S3Objects(bucket={self.bucket!r}, prefix={self.prefix!r})"

    def _key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, check_name(name)) if p)

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def put_new(self, name: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*"
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                return False
            raise
        return True

    def get(self, name: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(name) from None
            raise

    def exists(self, name: str) -> bool:
        try:
            self.get(name)
        except FileNotFoundError:
            return False
        return True

    def names(self, prefix: str) -> list[str]:
        base = self._key(prefix) + "/" if prefix else (f"{self.prefix}/" if self.prefix else "")
        cut = len(self.prefix) + 1 if self.prefix else 0
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        ):
            found.extend(o["Key"][cut:] for o in page.get("Contents", []))
        return sorted(found)


def objects_from_url(url: str, **options) -> ObjectStore:
    """``/path`` or ``file:///path`` -> LocalObjects; ``s3://bucket/prefix`` -> S3Objects (its
    credentials and endpoint from ``options`` or the usual AWS chain: the job's environment)."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return LocalObjects(parsed.path if parsed.scheme else url)
    if parsed.scheme == "s3":
        return S3Objects(parsed.netloc, parsed.path.lstrip("/"), **options)
    raise ValueError(f"storage URL must be a path, file:// or s3://, got {url!r}")


NODE_ROOT_MARKER = ".spotgpu-node-root"
"""A file that node agents started with ``--checkpoint-root DIR`` write into ``DIR``: there,
each tenant's files (checkpoints, bundles read back, outputs) live in ``tenant-<id>/``, never
in ``DIR`` itself. A buyer whose storage block names ``DIR`` (docs/get-started/first-hour.md)
finds its children's outputs through :func:`tenant_objects`."""


def tenant_dir_name(tenant_id: int) -> str:
    """The directory of one tenant's files under a node checkpoint root."""
    return f"tenant-{int(tenant_id)}"


def tenant_objects(url: str, tenant_id: int | None) -> ObjectStore:
    """The objects a tenant's jobs see at the storage ``url``: for a local directory that
    node agents use as their checkpoint root (it holds ``NODE_ROOT_MARKER``), the tenant's own
    directory in it (made here when no job of the tenant ran yet); else ``url`` itself (a
    shared directory the jobs are given as is, or S3, which nodes pass through)."""
    if tenant_id is not None and urlparse(url).scheme in ("", "file"):
        root = Path(urlparse(url).path if url.startswith("file:") else url)
        if (root / NODE_ROOT_MARKER).is_file():
            mine = root / tenant_dir_name(tenant_id)
            mine.mkdir(exist_ok=True)
            return LocalObjects(mine)
    return objects_from_url(url)
