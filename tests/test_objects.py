"""Named objects in a run's storage (``checkpoint/objects.py``): bundles, results and outputs,
on a local directory and on S3 (moto's server over HTTP, with boto3). Writes are atomic, a
``put_new`` race has exactly one winner, and a name from a hostile parameter never leaves the
store."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest

from prefect_spotgpu.blocks import CheckpointStorage
from prefect_spotgpu.checkpoint.objects import LocalObjects, S3Objects, objects_from_url


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjects(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"objects-{uuid.uuid4().hex[:8]}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="test", aws_secret_access_key="test",
    )  # fmt: skip
    client.create_bucket(Bucket=bucket)
    return S3Objects(bucket, "runs", client=client)


def test_objects_round_trip_and_list_by_folder(store):
    store.put("outputs/job/frame-0001.png", b"one")
    store.put("outputs/job/frame-0000.png", b"zero")
    store.put("outputs/other/x", b"x")
    store.put("outputs/job/frame-0001.png", b"one again")  # put replaces
    assert store.get("outputs/job/frame-0001.png") == b"one again"
    assert store.names("outputs/job") == [
        "outputs/job/frame-0000.png",
        "outputs/job/frame-0001.png",
    ]
    assert store.exists("outputs/other/x") and not store.exists("outputs/other/y")
    with pytest.raises(FileNotFoundError):
        store.get("outputs/nothing")


def test_of_many_writers_of_one_output_exactly_one_stores_it(store):
    def write(i: int) -> bool:
        return store.put_new("outputs/job/frame-0007.png", f"writer {i}".encode())

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(write, range(8)))
    assert won.count(True) == 1
    assert store.get("outputs/job/frame-0007.png") == f"writer {won.index(True)}".encode()


@pytest.mark.parametrize(
    "name", ["../escape", "/etc/passwd", "outputs/../../x", "a//b", "", "outputs/./x", "a\\b"]
)
def test_a_hostile_name_never_reaches_outside_the_store(tmp_path, name):
    store = LocalObjects(tmp_path / "store")
    with pytest.raises(ValueError, match="must be relative"):
        store.put(name, b"x")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "x").exists()


def test_the_storage_block_serves_prefect_results_and_finds_its_objects(tmp_path):
    block = CheckpointStorage(path=str(tmp_path))
    assert block.write_path("abc123", b"result") == "abc123"
    assert block.read_path("abc123") == b"result"
    assert (tmp_path / "results" / "abc123").read_bytes() == b"result"
    assert objects_from_url(str(tmp_path)).get("results/abc123") == b"result"
    with pytest.raises(ValueError, match="must be a path"):
        objects_from_url("ftp://host/x")
