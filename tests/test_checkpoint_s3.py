"""S3 storage against moto in server mode on a loopback port, through boto3 over HTTP."""

from __future__ import annotations

import logging
import threading
import time

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from conftest import free_port
from prefect_spotgpu.checkpoint import Checkpointer, S3Storage, storage_from_url

SECRET = "s3cr3t-key-that-must-never-be-logged"


@pytest.fixture(scope="module")
def s3_endpoint():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


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
    key = "runs/run-2/00000000000000000002/data.bin"
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
