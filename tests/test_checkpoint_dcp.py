"""torch.distributed.checkpoint through this project's storage (docs/users/checkpointing.md#fsdp-
and-dcp): an FSDP2 model's state saved by a gang of real processes (torchrun, gloo, CPU) loads
on another world size bit for bit; a notice on one rank is a final save on every rank, each
acknowledged, and the resumed run follows the uninterrupted loss curve exactly; a torn step is
skipped, a stale attempt never commits, retention keeps whole steps, on local disk and S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import wait_for
from prefect_spotgpu.checkpoint import LocalStorage, S3Storage, StaleAttempt
from prefect_spotgpu.checkpoint.dcp import (
    SpotStorageReader,
    SpotStorageWriter,
    commit_name,
    committed_steps,
    rank_name,
)
from prefect_spotgpu.checkpoint.distributed import DistributedCheckpointer

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(300)


def torchrun(ranks: int, url: str, steps: int, log: Path, **env: str) -> subprocess.Popen:
    """``dcp_train.py`` on ``ranks`` real processes (torchrun, a standalone rendezvous)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), str(HERE / "dcp_train.py"), url, str(steps),
               str(log)]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def finish(run: subprocess.Popen) -> None:
    output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output[-4000:]


def losses(log: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def same_state(a: Path, b: Path) -> None:
    left, right = torch.load(a), torch.load(b)
    for part in ("model", "optim"):
        assert left[part].keys() == right[part].keys() and left[part]
        for name, tensor in left[part].items():
            assert torch.equal(tensor, right[part][name]), f"{part} {name} differs"


@pytest.mark.slow
def test_a_notice_on_one_rank_is_a_final_save_on_all_and_the_resume_follows_the_same_curve(
    tmp_path,
):
    url = str(tmp_path / "ckpt")
    calm = tmp_path / "calm.jsonl"
    finish(torchrun(2, str(tmp_path / "calm-ckpt"), 40, calm, FULL=str(tmp_path / "calm.pt")))
    notices = tmp_path / "notices"
    notices.mkdir()
    log = tmp_path / "noticed.jsonl"
    run = torchrun(2, url, 40, log, NOTICE_DIR=str(notices), STEP_SECONDS="0.1")
    wait_for(lambda: log.exists() and len(losses(log)) >= 12, 120, "twelve steps")
    deadline = time.time() + 300  # rank 1's node alone gets the notice
    (notices / "notice-1").write_text(json.dumps({"deadline": deadline, "allocation_id": 2}))
    finish(run)
    final = [json.loads(line)["final"] for line in log.read_text().splitlines() if "final" in line]
    assert len(final) == 1 and 12 <= final[0] < 39
    for rank in (0, 1):  # every rank acknowledged the same durable step
        ack = json.loads((notices / f"notice-{rank}.ack").read_text())
        assert ack["step"] == final[0] and ack["durable"] is True
    assert committed_steps(LocalStorage(url), "run")[0] == final[0]
    finish(torchrun(2, url, 40, log, FULL=str(tmp_path / "resumed.pt")))
    resumed = losses(log)
    assert sorted(resumed) == list(range(40))  # no step lost, none done twice after the save
    assert resumed == losses(calm)  # the uninterrupted run's curve, exactly
    same_state(tmp_path / "calm.pt", tmp_path / "resumed.pt")


@pytest.mark.slow
def test_a_checkpoint_saved_by_two_ranks_loads_on_three_and_on_one(tmp_path):
    url = str(tmp_path / "ckpt")
    saved = tmp_path / "saved.pt"
    finish(torchrun(2, url, 12, tmp_path / "log", EVERY="1000", FULL=str(saved), SAVE_AT="11"))
    assert committed_steps(LocalStorage(url), "run") == [11]
    for ranks in (3, 1):  # nothing left to train: the restored state, written out
        loaded = tmp_path / f"loaded-{ranks}.pt"
        finish(torchrun(ranks, url, 12, tmp_path / "log", EVERY="1000", FULL=str(loaded)))
        same_state(saved, loaded)


def plain_state(value: float) -> dict:
    return {"weights": torch.full((64, 8), value), "bias": torch.arange(8.0) * value, "step": 1}


def test_a_torn_step_is_skipped_and_a_stale_attempt_never_commits(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    ckpt = DistributedCheckpointer(storage, "run", every=1000, handle_sigusr1=False)
    ckpt.save(plain_state(1.0), 1)
    ckpt.save(plain_state(2.0), 2)
    newest = next((tmp_path / rank_name("run", 0)).glob("*2*"))
    blob = newest / "data.bin"
    blob.write_bytes(blob.read_bytes()[:-16] + bytes(16))  # a flipped tail
    into = plain_state(0.0)
    assert ckpt.restore(into) == 1  # the torn step 2 skipped
    assert torch.equal(into["weights"], plain_state(1.0)["weights"])
    # an earlier attempt of the run (allocation 5) while allocation 7 writes the key
    monkeypatch.setenv("SPOTGPU_ALLOCATION_ID", "5")
    stale = DistributedCheckpointer(storage, "run", every=1000, handle_sigusr1=False)
    storage.claim("run", 7)
    with pytest.raises(StaleAttempt, match="later attempt"):  # (not DCP's BaseException)
        stale.save(plain_state(3.0), 3)
    assert 3 not in committed_steps(storage, "run")


def test_signed_dcp_checkpoints_refuse_another_key(tmp_path):
    storage = LocalStorage(tmp_path)
    signed = DistributedCheckpointer(storage, "run", every=1000, handle_sigusr1=False,
                                     signing_key="run-secret")  # fmt: skip
    signed.save(plain_state(4.0), 4)
    other = DistributedCheckpointer(storage, "run", every=1000, handle_sigusr1=False,
                                    signing_key="another")  # fmt: skip
    assert other.restore(plain_state(0.0)) is None
    into = plain_state(0.0)
    assert signed.restore(into) == 4 and torch.equal(into["bias"], plain_state(4.0)["bias"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (no_dist=True: meant)
def test_dcp_on_s3_keeps_whole_steps_and_loads_the_newest(s3_endpoint):
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")  # fmt: skip
    client.create_bucket(Bucket="dcp")
    storage = S3Storage("dcp", prefix="ckpts", client=client)
    ckpt = DistributedCheckpointer(storage, "run", every=1000, keep=2, handle_sigusr1=False)
    for step in range(1, 5):
        ckpt.save(plain_state(float(step)), step)
    assert committed_steps(storage, "run") == [4, 3]
    assert storage.steps(rank_name("run", 0)) == [4, 3]  # the deleted steps' blobs too
    into = plain_state(0.0)
    assert ckpt.restore(into) == 4 and torch.equal(into["weights"], plain_state(4.0)["weights"])
    # the storage plug-ins alone, as a user of dcp.save/dcp.load would pass them
    dcp.save(plain_state(9.0), storage_writer=SpotStorageWriter(storage, "mine", 9), no_dist=True)
    into = plain_state(0.0)
    dcp.load(into, storage_reader=SpotStorageReader(storage, "mine", 9), no_dist=True)
    assert torch.equal(into["bias"], plain_state(9.0)["bias"])
    assert storage.steps(commit_name("mine")) == [9]


def test_a_commit_that_names_no_rank_is_skipped_for_the_step_before(tmp_path):
    """An unsigned store anyone may write: a commit whose metadata points nowhere usable is a
    step skipped (a clear ``CorruptCheckpoint`` inside), never a crash of the restore."""
    from prefect_spotgpu.checkpoint.dcp import _Sealed

    storage = LocalStorage(tmp_path)
    ckpt = DistributedCheckpointer(storage, "run", every=1000, handle_sigusr1=False)
    ckpt.save(plain_state(1.0), 1)
    metadata = SpotStorageReader(storage, "run", 1).read_metadata()
    _Sealed(storage, None).write(commit_name("run"), 2, {"metadata": metadata, "manifests": []})
    into = plain_state(0.0)
    assert ckpt.restore(into) == 1 and torch.equal(into["bias"], plain_state(1.0)["bias"])
