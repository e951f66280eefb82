"""Where checkpoints live: a local directory, or S3 (and S3-compatible stores).

A checkpoint is committed atomically or not at all:

- local: the blob and manifest are written into a temporary directory, fsynced, and the
  directory is renamed to its final name (``rename`` is atomic), then the parent is fsynced;
- S3: the blob is uploaded (multipart for large ones) and the manifest is written last; a
  checkpoint without its manifest does not exist for readers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

logger = logging.getLogger("prefect_spotgpu.checkpoint")

MANIFEST = "manifest.json"
BLOB = "data.bin"


def step_name(step: int) -> str:
    return f"{step:020d}"


class CheckpointStorage(Protocol):
    def write(
        self,
        key: str,
        step: int,
        buffers: Sequence[memoryview],
        size: int,
        manifest: Callable[[], bytes],
    ) -> None:
        """Commit one checkpoint; ``manifest()`` is called after the blob is written."""
        ...

    def steps(self, key: str) -> list[int]:
        """Committed checkpoints of ``key``, newest first."""
        ...

    def read(self, key: str, step: int) -> tuple[bytes, bytearray]: ...

    def delete(self, key: str, step: int) -> None: ...


def _check_key(key: str) -> str:
    if not key or key.startswith(("/", ".")) or ".." in key.split("/") or "\x00" in key:
        raise ValueError(f"checkpoint key must be a relative name like 'run-123', got {key!r}")
    return key


class LocalStorage:
    """Checkpoints in a directory: ``<root>/<key>/<step>/{data.bin,manifest.json}``."""

    def __init__(self, root: str | os.PathLike, *, chunk_bytes: int = 64 << 20) -> None:
        self.root = Path(root)
        self.chunk_bytes = chunk_bytes

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def write(
        self,
        key: str,
        step: int,
        buffers: Sequence[memoryview],
        size: int,
        manifest: Callable[[], bytes],
    ) -> None:
        base = self.root / _check_key(key)
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _write_file(tmp / BLOB, buffers)
            _write_file(tmp / MANIFEST, [memoryview(manifest())])
            _fsync_dir(tmp)
            final = base / step_name(step)
            if final.exists():  # the same step saved again: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(base)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def steps(self, key: str) -> list[int]:
        base = self.root / _check_key(key)
        if not base.is_dir():
            return []
        found = [
            int(p.name) for p in base.iterdir() if p.name.isdigit() and (p / MANIFEST).is_file()
        ]
        return sorted(found, reverse=True)

    def read(self, key: str, step: int) -> tuple[bytes, bytearray]:
        path = self.root / _check_key(key) / step_name(step)
        manifest = (path / MANIFEST).read_bytes()
        size = (path / BLOB).stat().st_size
        blob = bytearray(size)
        with open(path / BLOB, "rb", buffering=0) as f:
            view, done = memoryview(blob), 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    break
                done += n
        return manifest, blob

    def delete(self, key: str, step: int) -> None:
        shutil.rmtree(self.root / _check_key(key) / step_name(step), ignore_errors=True)


def _write_file(path: Path, buffers: Sequence[memoryview]) -> None:
    """Write ``buffers`` back to back with large sequential writes, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buffer in buffers:
            view = buffer if buffer.format == "B" else buffer.cast("B")
            while view.nbytes:
                written = os.write(fd, view[: 1 << 30])
                view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Storage:
    """Checkpoints in S3: ``s3://<bucket>/<prefix>/<key>/<step>/{data.bin,manifest.json}``.

    ``endpoint_url`` points at S3-compatible stores (MinIO, Ceph, moto). Throttling, timeouts
    and connection errors are retried by botocore (adaptive mode); credentials come from the
    arguments or the usual AWS chain and never appear in logs or ``repr``.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        part_bytes: int = 64 << 20,
        max_attempts: int = 10,
        client=None,
    ) -> None:
        import boto3
        from botocore.config import Config

        if part_bytes < 5 << 20:
            raise ValueError("part_bytes must be at least 5 MiB (S3's multipart minimum)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.part_bytes = part_bytes
        self.client = client or boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region_name,
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            config=Config(
                retries={"max_attempts": max_attempts, "mode": "adaptive"},
                connect_timeout=10,
                read_timeout=120,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"S3Storage(bucket={self.bucket!r}, prefix={self.prefix!r}, "
            f"endpoint_url={self.endpoint_url!r})"
        )

    def _key(self, key: str, step: int | None = None, name: str | None = None) -> str:
        parts = [p for p in (self.prefix, _check_key(key)) if p]
        if step is not None:
            parts.append(step_name(step))
        if name is not None:
            parts.append(name)
        return "/".join(parts) + ("" if name else "/")

    def write(
        self,
        key: str,
        step: int,
        buffers: Sequence[memoryview],
        size: int,
        manifest: Callable[[], bytes],
    ) -> None:
        blob_key = self._key(key, step, BLOB)
        if size <= self.part_bytes:
            self.client.put_object(
                Bucket=self.bucket, Key=blob_key, Body=b"".join(bytes(b) for b in buffers)
            )
        else:
            self._multipart(blob_key, buffers)
        # the manifest last: only now does the checkpoint exist for readers
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(key, step, MANIFEST), Body=manifest()
        )

    def _multipart(self, blob_key: str, buffers: Sequence[memoryview]) -> None:
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=blob_key)
        upload_id = upload["UploadId"]
        parts: list[dict] = []
        try:
            for number, chunk in enumerate(_chunks(buffers, self.part_bytes), start=1):
                etag = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=blob_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=chunk,
                )["ETag"]
                parts.append({"PartNumber": number, "ETag": etag})
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=blob_key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=blob_key, UploadId=upload_id
                )
            raise

    def steps(self, key: str) -> list[int]:
        prefix = self._key(key)
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(prefix) :]
                name, _, leaf = rest.partition("/")
                if leaf == MANIFEST and name.isdigit():
                    found.append(int(name))
        return sorted(found, reverse=True)

    def read(self, key: str, step: int) -> tuple[bytes, bytearray]:
        manifest = self.client.get_object(Bucket=self.bucket, Key=self._key(key, step, MANIFEST))[
            "Body"
        ].read()
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(key, step, BLOB))
        blob = bytearray(body["ContentLength"])
        view, done = memoryview(blob), 0
        stream = body["Body"]
        while done < len(blob):
            chunk = stream.read(min(8 << 20, len(blob) - done))
            if not chunk:
                break
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
        return manifest, blob

    def delete(self, key: str, step: int) -> None:
        for name in (MANIFEST, BLOB):  # the manifest first: the checkpoint vanishes at once
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key, step, name))


def _chunks(buffers: Sequence[memoryview], size: int):
    """Re-cut a sequence of buffers into ``size``-byte chunks (the last one shorter)."""
    pending, have = [], 0
    for buffer in buffers:
        view = buffer if buffer.format == "B" else buffer.cast("B")
        while view.nbytes:
            take = min(size - have, view.nbytes)
            pending.append(view[:take])
            have += take
            view = view[take:]
            if have == size:
                yield b"".join(pending)
                pending, have = [], 0
    if pending:
        yield b"".join(pending)


def storage_from_url(url: str, **options) -> CheckpointStorage:
    """``/path`` or ``file:///path`` -> LocalStorage; ``s3://bucket/prefix`` -> S3Storage."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return LocalStorage(parsed.path if parsed.scheme else url, **options)
    if parsed.scheme == "s3":
        return S3Storage(parsed.netloc, parsed.path.lstrip("/"), **options)
    raise ValueError(f"checkpoint storage URL must be a path, file:// or s3://, got {url!r}")
