"""Where checkpoints live: a local directory, or S3 (and S3-compatible stores).

A checkpoint is committed atomically or not at all, and saving a step again replaces it
atomically too: at every moment one complete copy of each committed step is readable.

- local: the blob and manifest are written into a temporary directory, fsynced, and the
  directory is renamed to a name no other directory has (``rename`` is atomic), then the
  parent is fsynced. A step saved again gets a newer version of its directory
  (``<step>.<n>``); readers take the newest version that has a manifest, and the older one
  is removed only after the new one is durable.
- S3: the blob is uploaded under a name of its own (multipart for large ones) and the
  manifest, which names that blob in its metadata, is written last: a checkpoint without its
  manifest does not exist for readers, and a step saved again switches to its new blob in one
  PUT of its manifest. The step's other blobs are deleted after that.

A listed checkpoint whose blob or manifest cannot be found (or is refused to us) raises
``UnreadableCheckpoint``: each storage maps its own errors for that (``FileNotFoundError``,
S3's ``NoSuchKey``/404, ``AccessDenied``/403) to that one exception. Other failures (a store
that does not answer) propagate as they are. The single writer of a key's checkpoints is its
``Checkpointer``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from prefect_spotgpu.checkpoint.format import UnreadableCheckpoint

logger = logging.getLogger("prefect_spotgpu.checkpoint")

MANIFEST = "manifest.json"
BLOB = "data.bin"
CLAIMS = "attempts"
"""Where a key's claims by attempt lie (``fencing``): ``<key>/.attempts/<n>`` locally,
``<key>/attempts/<n>`` in S3 (neither a step's name)."""
BLOB_METADATA = "blob"  # the S3 manifest's metadata naming its blob (absent: data.bin)
_BLOB_NAME = re.compile(r"data(-[0-9a-f]{32})?\.bin")
_MISSING_S3 = {"NoSuchKey", "404", "NotFound", "AccessDenied", "403", "InvalidObjectState"}


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

    def read(self, key: str, step: int) -> tuple[bytes, bytearray]:
        """The manifest and blob; ``UnreadableCheckpoint`` when either is missing."""
        ...

    def read_manifest(self, key: str, step: int) -> bytes:
        """The manifest alone (cheap); ``UnreadableCheckpoint`` when it is missing."""
        ...

    def delete(self, key: str, step: int) -> None: ...


def _check_key(key: str) -> str:
    if not key or key.startswith(("/", ".")) or ".." in key.split("/") or "\x00" in key:
        raise ValueError(f"checkpoint key must be a relative name like 'run-123', got {key!r}")
    return key


def _version(name: str) -> tuple[int, int] | None:
    """``(step, version)`` of a step directory's name (``<step>`` or ``<step>.<n>``)."""
    head, dot, tail = name.partition(".")
    if not head.isdigit() or (dot and not tail.isdigit()):
        return None
    return int(head), int(tail) if dot else 0


class LocalStorage:
    """Checkpoints in a directory: ``<root>/<key>/<step>[.<n>]/{data.bin,manifest.json}``."""

    def __init__(self, root: str | os.PathLike, *, chunk_bytes: int = 64 << 20) -> None:
        self.root = Path(root)
        self.chunk_bytes = chunk_bytes

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def _versions(self, base: Path) -> dict[int, list[tuple[int, Path]]]:
        """Every step's directories, newest version first."""
        found: dict[int, list[tuple[int, Path]]] = {}
        if not base.is_dir():
            return found
        for path in base.iterdir():
            parsed = _version(path.name)
            if parsed is not None:
                found.setdefault(parsed[0], []).append((parsed[1], path))
        for versions in found.values():
            versions.sort(reverse=True)
        return found

    def _current(self, key: str, step: int) -> Path:
        base = self.root / _check_key(key)
        for _, path in self._versions(base).get(step, []):
            if (path / MANIFEST).is_file():
                return path
        raise UnreadableCheckpoint(f"step {step} of {key} is not in {self.root}")

    def write(
        self,
        key: str,
        step: int,
        buffers: Sequence[memoryview],
        size: int,
        manifest: Callable[[], bytes],
    ) -> None:
        base = self.root / _check_key(key)
        _shared_dir(base)
        tmp = base / f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}"
        _shared_dir(tmp)
        try:
            _write_file(tmp / BLOB, buffers)
            _write_file(tmp / MANIFEST, [memoryview(manifest())])
            _fsync_dir(tmp)
            older = self._versions(base).get(step, [])
            name = step_name(step) + (f".{older[0][0] + 1}" if older else "")
            os.rename(tmp, base / name)  # a name no directory has: nothing is replaced
            _fsync_dir(base)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, path in older:  # the same step saved again: the new version is durable
            _remove(path)

    def claim(self, key: str, attempt: int) -> None:
        """Record, durably, that ``attempt`` writes ``key`` from now on (``fencing``)."""
        claims = self.root / _check_key(key) / f".{CLAIMS}"
        _shared_dir(claims)
        (claims / f"{attempt:020d}").touch()
        _fsync_dir(claims)

    def latest_claim(self, key: str) -> int | None:
        """The latest attempt that claimed ``key``, if any."""
        claims = self.root / _check_key(key) / f".{CLAIMS}"
        found = [int(n) for n in os.listdir(claims) if n.isdigit()] if claims.is_dir() else []
        return max(found, default=None)

    def steps(self, key: str) -> list[int]:
        versions = self._versions(self.root / _check_key(key))
        found = [
            step
            for step, paths in versions.items()
            if any((path / MANIFEST).is_file() for _, path in paths)
        ]
        return sorted(found, reverse=True)

    def read_manifest(self, key: str, step: int) -> bytes:
        path = self._current(key, step)
        try:
            return (path / MANIFEST).read_bytes()
        except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            raise UnreadableCheckpoint(f"step {step} of {key}: {exc}") from None

    def read(self, key: str, step: int) -> tuple[bytes, bytearray]:
        path = self._current(key, step)
        try:
            manifest = (path / MANIFEST).read_bytes()
            with open(path / BLOB, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                blob = bytearray(size)
                view, done = memoryview(blob), 0
                while done < size:
                    n = f.readinto(view[done:])
                    if not n:
                        break
                    done += n
        except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            raise UnreadableCheckpoint(f"step {step} of {key}: {exc}") from None
        return manifest, blob

    def delete(self, key: str, step: int) -> None:
        base = self.root / _check_key(key)
        for _, path in self._versions(base).get(step, []):
            _remove(path)
        with contextlib.suppress(OSError):  # what an interrupted delete left behind
            for leftover in base.glob(".del-*"):
                shutil.rmtree(leftover, ignore_errors=True)


def _remove(path: Path) -> None:
    """Remove a step's directory: first renamed aside (it vanishes for readers at once, never
    half deleted under its name), then deleted."""
    aside = path.with_name(f".del-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)
        return
    shutil.rmtree(aside, ignore_errors=True)


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


def _shared_dir(path: Path) -> None:
    """Make ``path`` (and its missing parents); under a node's tenant directory (setgid: its
    group is the tenant's), each one writable by the tenant's group whatever the job's umask
    (a container's is 022): a node runs each attempt of a run as a user of its own, and a
    later attempt writes steps, and claims, where an earlier one made the directories.
    Elsewhere (no setgid), directories keep the mode the umask gives them."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        at = at.parent
    path.mkdir(parents=True, exist_ok=True)
    for made in missing:
        with contextlib.suppress(OSError):  # (someone else's directory: as it is)
            if os.stat(made).st_mode & stat.S_ISGID:  # inherited from the tenant's directory
                os.chmod(made, 0o2770)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Storage:
    """Checkpoints in S3: ``s3://<bucket>/<prefix>/<key>/<step>/{data-<id>.bin,manifest.json}``
    (the manifest's metadata ``blob`` names the blob; checkpoints written before it existed
    have ``data.bin``).

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
        blob = f"data-{uuid.uuid4().hex}.bin"  # its own name: an older version stays intact
        blob_key = self._key(key, step, blob)
        if size <= self.part_bytes:
            self.client.put_object(
                Bucket=self.bucket, Key=blob_key, Body=b"".join(bytes(b) for b in buffers)
            )
        else:
            self._multipart(blob_key, buffers)
        # the manifest last: only now does the checkpoint (or its new version) exist for readers
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._key(key, step, MANIFEST),
            Body=manifest(),
            Metadata={BLOB_METADATA: blob},
        )
        try:  # an older version's blob, or one a crashed save left behind
            for other in self._objects(self._key(key, step)):
                if other != blob_key and not other.endswith("/" + MANIFEST):
                    self.client.delete_object(Bucket=self.bucket, Key=other)
        except Exception as exc:  # housekeeping: the save is committed
            logger.warning("could not delete old blobs of %s step %s: %s", key, step, exc)

    def _objects(self, prefix: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        return [
            obj["Key"]
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]

    def _get(self, key: str, step: int, name: str) -> dict:
        """``get_object``, with a missing or forbidden object as ``UnreadableCheckpoint``."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key, step, name))
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING_S3:
                raise UnreadableCheckpoint(f"step {step} of {key}: {name}: {code}") from None
            raise

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

    def claim(self, key: str, attempt: int) -> None:
        """Record that ``attempt`` writes ``key`` from now on (``fencing``)."""
        claim = self._key(key) + f"{CLAIMS}/{attempt:020d}"
        self.client.put_object(Bucket=self.bucket, Key=claim, Body=b"")

    def latest_claim(self, key: str) -> int | None:
        """The latest attempt that claimed ``key``, if any."""
        prefix = self._key(key) + f"{CLAIMS}/"
        found = [int(n[len(prefix) :]) for n in self._objects(prefix) if n[len(prefix) :].isdigit()]
        return max(found, default=None)

    def steps(self, key: str) -> list[int]:
        prefix = self._key(key)
        found = []
        for name in self._objects(prefix):
            step, _, leaf = name[len(prefix) :].partition("/")
            if leaf == MANIFEST and step.isdigit():
                found.append(int(step))
        return sorted(found, reverse=True)

    def read_manifest(self, key: str, step: int) -> bytes:
        return self._get(key, step, MANIFEST)["Body"].read()

    def read(self, key: str, step: int) -> tuple[bytes, bytearray]:
        response = self._get(key, step, MANIFEST)
        manifest = response["Body"].read()
        name = response.get("Metadata", {}).get(BLOB_METADATA, BLOB)
        if not _BLOB_NAME.fullmatch(name):
            raise UnreadableCheckpoint(f"step {step} of {key}: bad blob name {name!r}")
        body = self._get(key, step, name)
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
        # the manifest first: the checkpoint vanishes at once; then its blob(s)
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key, step, MANIFEST))
        for name in self._objects(self._key(key, step)):
            self.client.delete_object(Bucket=self.bucket, Key=name)


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
