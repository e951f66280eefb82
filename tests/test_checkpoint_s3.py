"""S3 storage against moto in server mode on a loopback port, through boto3 over HTTP."""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from conftest import free_port
from prefect_spotgpu.checkpoint import (
    Checkpointer,
    S3Storage,
    UnreadableCheckpoint,
    storage_from_url,
)
from prefect_spotgpu.checkpoint.format import encode
from prefect_spotgpu.protocol import JOB_ENV

SIGNING_KEY_ENV = JOB_ENV.CHECKPOINT_SIGNING_KEY

SECRET = "s3cr3t-key-that-must-never-be-logged"


@pytest.fixture(autouse=True)
def no_signing_key_from_the_environment(monkeypatch):
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)


@pytest.fixture
def bucket(s3_endpoint, request):
    name = f"ckpt-{abs(hash(request.node.name)) % 10**8}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key=SECRET,
    )
    client.create_bucket(Bucket=name)
    return name, client


def storage(endpoint, bucket_name, **kw):
    return S3Storage(
        bucket_name,
        "runs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key=SECRET,
        **kw,
    )


def blob_keys(client, bucket_name, prefix):
    """The blob(s) under a step's prefix (each save names its own: ``data-<id>.bin``)."""
    listing = client.list_objects_v2(Bucket=bucket_name, Prefix=prefix).get("Contents", [])
    return [o["Key"] for o in listing if not o["Key"].endswith("/manifest.json")]


def test_round_trip_small_and_multipart(s3_endpoint, bucket, caplog):
    name, client = bucket
    store = storage(s3_endpoint, name, part_bytes=5 << 20)
    ckpt = Checkpointer(store, "run-1", keep=2, handle_sigusr1=False)
    with caplog.at_level(logging.DEBUG, logger="prefect_spotgpu"):
        ckpt.save({"small": torch.arange(10)}, 1)
        big = {"w": torch.randn(3, 1024, 1024)}  # 12 MiB: three parts
        ckpt.save(big, 2)
    assert store.steps("run-1") == [2, 1]
    got = ckpt.restore()
    assert got.step == 2 and torch.equal(got.state["w"], big["w"])
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=name)["Contents"]}
    assert "runs/run-1/00000000000000000002/manifest.json" in keys
    assert SECRET not in repr(store) and SECRET not in caplog.text
    ckpt.save({"small": torch.arange(3)}, 3)  # keep=2: step 1 goes
    assert store.steps("run-1") == [3, 2]


def test_a_blob_without_its_manifest_is_invisible_and_corruption_falls_back(s3_endpoint, bucket):
    name, client = bucket
    store = storage(s3_endpoint, name)
    ckpt = Checkpointer(store, "run-2", keep=5, handle_sigusr1=False)
    ckpt.save({"w": torch.ones(100)}, 1)
    client.put_object(Bucket=name, Key="runs/run-2/00000000000000000005/data.bin", Body=b"torn")
    assert store.steps("run-2") == [1]
    ckpt.save({"w": torch.ones(100) * 2}, 2)
    (key,) = blob_keys(client, name, "runs/run-2/00000000000000000002/")
    data = bytearray(client.get_object(Bucket=name, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=name, Key=key, Body=bytes(data))
    got = ckpt.restore()
    assert got.step == 1 and torch.equal(got.state["w"], torch.ones(100))


def test_connection_failures_are_retried_until_the_store_answers(s3_endpoint, bucket):
    name, _ = bucket
    port = free_port()
    late = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    store = S3Storage(
        name,
        "x",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key=SECRET,
        max_attempts=10,
    )
    threading.Timer(1.0, late.start).start()  # nothing listens for the first second
    try:
        t0 = time.monotonic()
        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key=SECRET,
        )
        store.client.list_buckets()  # retried through connection refusals
        client.create_bucket(Bucket=name)
        Checkpointer(store, "r", handle_sigusr1=False).save({"a": 1}, 1)
        assert store.steps("r") == [1] and time.monotonic() - t0 >= 0.9
    finally:
        late.stop()


def test_storage_from_url_builds_s3(s3_endpoint, bucket):
    name, _ = bucket
    store = storage_from_url(
        f"s3://{name}/some/prefix",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key=SECRET,
    )
    assert isinstance(store, S3Storage) and store.prefix == "some/prefix"
    with pytest.raises(ValueError, match="5 MiB"):
        storage(s3_endpoint, name, part_bytes=1024)


STEP = "runs/{key}/{step:020d}/"


def flip_last_byte(client, bucket_name, key):
    data = bytearray(client.get_object(Bucket=bucket_name, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=bucket_name, Key=key, Body=bytes(data))


def test_a_missing_blob_under_a_listed_manifest_falls_back(s3_endpoint, bucket, caplog):
    name, client = bucket
    store = storage(s3_endpoint, name)
    ckpt = Checkpointer(store, "run-3", keep=5, handle_sigusr1=False)
    ckpt.save({"w": torch.ones(10)}, 1)
    ckpt.save({"w": torch.ones(10) * 2}, 2)
    (blob,) = blob_keys(client, name, STEP.format(key="run-3", step=2))
    client.delete_object(Bucket=name, Key=blob)
    assert store.steps("run-3") == [2, 1]  # still listed: its manifest is there
    with pytest.raises(UnreadableCheckpoint, match="NoSuchKey"):
        store.read("run-3", 2)
    with caplog.at_level(logging.WARNING):
        got = Checkpointer(store, "run-3", handle_sigusr1=False).restore()
    assert got.step == 1 and torch.equal(got.state["w"], torch.ones(10))
    assert "step 2 is not usable (UnreadableCheckpoint" in caplog.text


def test_retention_on_s3_counts_only_verified_checkpoints(s3_endpoint, bucket):
    name, client = bucket
    store = storage(s3_endpoint, name)
    first = Checkpointer(store, "run-4", keep=5, handle_sigusr1=False)
    for step in (1, 2, 3, 10):
        first.save({"w": torch.full((64,), float(step))}, step)
    (blob,) = blob_keys(client, name, STEP.format(key="run-4", step=10))
    flip_last_byte(client, name, blob)
    resumed = Checkpointer(store, "run-4", keep=1, handle_sigusr1=False)
    assert resumed.restore().step == 3
    resumed.save({"w": torch.full((64,), 4.0)}, 4)
    assert store.steps("run-4") == [10, 4]  # the new save stays, the corrupt one is not counted
    got = Checkpointer(store, "run-4", handle_sigusr1=False).restore()
    assert got.step == 4 and torch.equal(got.state["w"], torch.full((64,), 4.0))


def test_saving_a_step_again_never_leaves_it_without_a_valid_copy(s3_endpoint, bucket):
    name, client = bucket
    store = storage(s3_endpoint, name)
    ckpt = Checkpointer(store, "run-5", keep=5, handle_sigusr1=False)
    ckpt.save({"w": torch.full((64,), 1.0)}, 5)
    again = encode({"w": torch.full((64,), 2.0)}, step=5)

    def crash() -> bytes:  # the writer dies after the new blob is up, before its manifest
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        store.write("run-5", 5, again.buffers, again.size, crash)
    got = Checkpointer(store, "run-5", handle_sigusr1=False).restore()
    assert got.step == 5 and torch.equal(got.state["w"], torch.full((64,), 1.0))
    ckpt.save({"w": torch.full((64,), 3.0)}, 5)  # a save that completes replaces it ...
    got = Checkpointer(store, "run-5", handle_sigusr1=False).restore()
    assert torch.equal(got.state["w"], torch.full((64,), 3.0))
    assert len(blob_keys(client, name, STEP.format(key="run-5", step=5))) == 1  # ... and tidies


def test_checkpoints_written_before_named_blobs_are_still_read(s3_endpoint, bucket):
    name, client = bucket
    store = storage(s3_endpoint, name)
    old = encode({"w": torch.arange(6)}, step=1)
    old.fill_checksums()
    prefix = STEP.format(key="run-6", step=1)
    client.put_object(Bucket=name, Key=prefix + "data.bin", Body=b"".join(old.buffers))
    client.put_object(Bucket=name, Key=prefix + "manifest.json", Body=old.manifest_bytes())
    ckpt = Checkpointer(store, "run-6", handle_sigusr1=False)
    assert torch.equal(ckpt.restore().state["w"], torch.arange(6))
    ckpt.save({"w": torch.arange(7)}, 1)
    assert blob_keys(client, name, prefix) != [prefix + "data.bin"]
    assert torch.equal(ckpt.restore().state["w"], torch.arange(7))


class Planted:
    """A pickle an attacker plants: unpickling it creates ``marker`` (code execution)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_signed_checkpoints_on_s3_refuse_other_keys_tampering_and_planted_pickles(
    s3_endpoint, bucket, tmp_path
):
    name, client = bucket
    store = storage(s3_endpoint, name)
    signed = Checkpointer(store, "run-7", keep=9, handle_sigusr1=False, signing_key="key-A")
    signed.save({"w": torch.ones(8)}, 1)
    signed.save({"w": torch.ones(8) * 2}, 2)
    other = Checkpointer(store, "run-7", keep=9, handle_sigusr1=False, signing_key="key-B")
    assert other.restore() is None
    marker = tmp_path / "owned"
    Checkpointer(store, "run-7", keep=9, handle_sigusr1=False, signing_key="").save(
        {"w": Planted(marker)}, 3
    )
    assert signed.restore().step == 2 and not marker.exists()
    key = STEP.format(key="run-7", step=2) + "manifest.json"
    response = client.get_object(Bucket=name, Key=key)
    outer = json.loads(response["Body"].read())
    outer["manifest"]["extra"]["final"] = True  # and a CRC32 to match: only the HMAC catches it
    body = json.dumps(outer["manifest"], sort_keys=True, separators=(",", ":")).encode()
    outer["crc32"] = zlib.crc32(body)
    client.put_object(
        Bucket=name, Key=key, Body=json.dumps(outer).encode(), Metadata=response["Metadata"]
    )
    got = signed.restore()
    assert got.step == 1 and torch.equal(got.state["w"], torch.ones(8)) and not marker.exists()
