"""Checkpoint integrity on a real local disk: retention by verified checkpoints, restore's
fall-back on anything unreadable, atomic re-saves of a step (real SIGKILLs), signed manifests."""

from __future__ import annotations

import doctest
import json
import logging
import pickle
import shutil
import signal
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest
import torch

import prefect_spotgpu.checkpoint.checkpointer as checkpointer_module
from prefect_spotgpu.checkpoint import (
    Checkpointer,
    LocalStorage,
    UnreadableCheckpoint,
)
from prefect_spotgpu.checkpoint.storage import step_name
from prefect_spotgpu.protocol import JOB_ENV

SIGNING_KEY_ENV = JOB_ENV.CHECKPOINT_SIGNING_KEY


@pytest.fixture(autouse=True)
def no_signing_key_from_the_environment(monkeypatch):
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)


def checkpointer(root, **kw) -> Checkpointer:
    return Checkpointer(LocalStorage(root), "run", handle_sigusr1=False, **kw)


def step_dir(root: Path, step: int) -> Path:
    return root / "run" / step_name(step)


def flip_a_blob_byte(root: Path, step: int) -> None:
    blob = step_dir(root, step) / "data.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))


def rewrite_manifest(path: Path, change) -> None:
    """Change a stored manifest the way someone who can write the storage could: the change,
    then a fresh CRC32 (the signature, if any, is kept: it cannot be recomputed)."""
    outer = json.loads(path.read_bytes())
    change(outer["manifest"])
    body = json.dumps(outer["manifest"], sort_keys=True, separators=(",", ":")).encode()
    outer["crc32"] = zlib.crc32(body)
    path.write_text(json.dumps(outer))


class Planted:
    """A pickle an attacker plants: unpickling it creates ``marker`` (code execution)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ---------------------------------------------------------------- 1. retention


def test_retention_keeps_new_saves_when_the_newest_step_is_corrupt(tmp_path, caplog):
    notice = tmp_path / "notice.json"
    first = checkpointer(tmp_path, keep=5)
    for step in (1, 2, 3):
        first.save({"w": torch.full((256,), float(step))}, step)
    first.save({"w": torch.full((256,), 10.0)}, 10)
    flip_a_blob_byte(tmp_path, 10)  # the newest step is corrupt
    resumed = checkpointer(tmp_path, keep=1, notice_file=notice, every=1e-9)
    with caplog.at_level(logging.WARNING):
        assert resumed.restore().step == 3
        assert resumed.maybe_save({"w": torch.full((256,), 4.0)}, 4) is None  # periodic
        assert resumed.wait().step == 4  # written in the background
        assert LocalStorage(tmp_path).steps("run") == [10, 4]  # kept: 4; not deleted: 10
        notice.write_text(json.dumps({"deadline": 1e12}))
        result = resumed.maybe_save({"w": torch.full((256,), 5.0)}, 5)  # final, acknowledged
    assert result.final and json.loads((tmp_path / "notice.json.ack").read_text())["step"] == 5
    assert LocalStorage(tmp_path).steps("run") == [10, 5]
    # the corrupt step was checked once (by restore), not again at every save
    assert caplog.text.count("step 10 is not usable") == 1
    got = checkpointer(tmp_path).restore()
    assert got.step == 5 and torch.equal(got.state["w"], torch.full((256,), 5.0))


def test_retention_never_deletes_the_newest_verified_nor_the_one_just_written(tmp_path):
    writer = checkpointer(tmp_path, keep=5)
    writer.save({"w": torch.full((8,), 7.0)}, 7)
    writer.save({"w": torch.full((8,), 10.0)}, 10)
    flip_a_blob_byte(tmp_path, 10)
    fresh = checkpointer(tmp_path, keep=1)  # e.g. a run that starts over under the same key
    fresh.save({"w": torch.full((8,), 3.0)}, 3)
    assert LocalStorage(tmp_path).steps("run") == [10, 7, 3]
    fresh.save({"w": torch.full((8,), 4.0)}, 4)
    assert LocalStorage(tmp_path).steps("run") == [10, 7, 4]
    assert torch.equal(checkpointer(tmp_path).restore().state["w"], torch.full((8,), 7.0))


def test_the_retention_rule_examples_hold():
    assert doctest.testmod(checkpointer_module).failed == 0
    keep_two = checkpointer_module.steps_to_delete
    assert keep_two([9, 8, 7, 6, 5], lambda s: s in (8, 6), keep=2, written=5) == []
    assert keep_two([9, 8, 7, 6, 5], lambda s: s in (9, 8), keep=2, written=9) == [7, 6, 5]


# ---------------------------------------------------------------- 2. restore falls back

GONE_MODULE = """
class Config:
    def __init__(self, lr):
        self.lr = lr
"""


def test_state_that_no_longer_unpickles_falls_back_to_the_previous_checkpoint(
    tmp_path, monkeypatch, caplog
):
    name = f"gone_{uuid.uuid4().hex[:8]}"
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{name}.py").write_text(GONE_MODULE)
    monkeypatch.syspath_prepend(str(code))
    module = __import__(name)
    ckpt = checkpointer(tmp_path / "store", keep=5)
    ckpt.save({"cfg": {"lr": 0.1}}, 1)
    ckpt.save({"cfg": module.Config(0.2)}, 2)
    shutil.rmtree(code)  # the class is gone (renamed in a newer version of the code)
    del sys.modules[name]
    sys.path.remove(str(code))
    with caplog.at_level(logging.WARNING):
        got = checkpointer(tmp_path / "store").restore()
    assert got.step == 1 and got.state == {"cfg": {"lr": 0.1}}
    assert "step 2 is not usable" in caplog.text and "ModuleNotFoundError" in caplog.text


def test_a_missing_part_is_unreadable_and_skipped(tmp_path, caplog):
    ckpt = checkpointer(tmp_path, keep=5)
    ckpt.save({"x": 1}, 1)
    ckpt.save({"x": 2}, 2)
    (step_dir(tmp_path, 2) / "data.bin").unlink()
    with pytest.raises(UnreadableCheckpoint):
        LocalStorage(tmp_path).read("run", 2)
    with pytest.raises(UnreadableCheckpoint):
        LocalStorage(tmp_path).read("run", 99)
    with caplog.at_level(logging.WARNING):
        assert checkpointer(tmp_path).restore().state == {"x": 1}
    assert "step 2 is not usable (UnreadableCheckpoint" in caplog.text


# ---------------------------------------------------------------- 3. atomic re-saves

RESAVE_SCRIPT = """
import os, signal, sys
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
root, when = sys.argv[1], sys.argv[2]
ckpt = Checkpointer(LocalStorage(root), "run", keep=5, handle_sigusr1=False, signing_key="")
ckpt.save({"v": 1}, 5)
real_rename = os.rename

def rename(src, dst, **kw):  # the process dies right before, or right after, the commit
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(src, dst, **kw)
    if when == "after":
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename
ckpt.save({"v": 2}, 5)
print("not killed")
"""


@pytest.mark.parametrize(("when", "expected"), [("before", 1), ("after", 2)])
def test_a_process_killed_while_saving_a_step_again_leaves_that_step_restorable(
    tmp_path, when, expected
):
    proc = subprocess.run(
        [sys.executable, "-c", RESAVE_SCRIPT, str(tmp_path), when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    ckpt = checkpointer(tmp_path, keep=5)
    got = ckpt.restore()
    assert got is not None and (got.step, got.state) == (5, {"v": expected})
    ckpt.save({"v": 3}, 5)  # and saving it again tidies every older version away
    versions = [p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")]
    assert len(versions) == 1 and checkpointer(tmp_path).restore().state == {"v": 3}


# ---------------------------------------------------------------- 4. signed manifests


def test_a_checkpoint_signed_with_another_key_is_refused(tmp_path, caplog):
    a = checkpointer(tmp_path, keep=1, signing_key="key-A")
    a.save({"w": torch.arange(5)}, 1)
    b = checkpointer(tmp_path, keep=9, signing_key=b"key-B")  # bytes work too
    assert a.signed and b.signed
    with caplog.at_level(logging.WARNING):
        assert b.restore() is None
    assert "step 1 is not usable (UntrustedCheckpoint" in caplog.text
    b.save({"w": torch.arange(9)}, 9)  # a newer one, signed with the other key
    a.save({"w": torch.arange(2)}, 2)
    # A's retention counts only what A verifies: its own 1 goes, B's newer 9 is left alone
    assert LocalStorage(tmp_path).steps("run") == [9, 2]
    got = a.restore()
    assert got.step == 2 and torch.equal(got.state["w"], torch.arange(2))


def test_tampered_moved_and_unsigned_checkpoints_are_refused(tmp_path):
    signed = checkpointer(tmp_path, keep=9, signing_key="run-key")
    signed.save({"w": torch.ones(4)}, 1)
    signed.save({"w": torch.ones(4) * 2}, 2)
    assert signed.restore().step == 2
    manifest = step_dir(tmp_path, 2) / "manifest.json"
    rewrite_manifest(manifest, lambda m: m["extra"].update(final=True))  # CRC32 made to match
    assert signed.restore().step == 1
    shutil.copytree(step_dir(tmp_path, 1), step_dir(tmp_path, 8))  # a signed one, moved
    assert signed.restore().step == 1
    unsigned = checkpointer(tmp_path, keep=9, signing_key="")
    unsigned.save({"w": torch.ones(4) * 3}, 9)
    assert not unsigned.signed and unsigned.restore().step == 9  # no key: as before signing
    assert signed.restore().step == 1  # a key: unsigned is refused


def test_a_planted_pickle_never_runs_when_a_key_is_set(tmp_path, caplog):
    marker, root = tmp_path / "owned", tmp_path / "store"
    signed = checkpointer(root, keep=9, signing_key="run-key")
    signed.save({"w": torch.ones(3), "note": b"n" * 4096}, 1)
    signed.save({"w": torch.ones(3), "note": b"m" * 4096}, 2)
    # someone who can write the storage but cannot sign swaps a pickle into step 2's blob,
    # same offset, same length (pickle ignores the bytes after its end) ...
    outer = json.loads((step_dir(root, 2) / "manifest.json").read_bytes())
    (note,) = [node for name, node in outer["manifest"]["tree"]["items"] if name == "note"]
    payload = pickle.dumps(Planted(marker)).ljust(note["length"], b"\0")
    blob = step_dir(root, 2) / "data.bin"
    data = bytearray(blob.read_bytes())
    data[note["offset"] : note["offset"] + note["length"]] = payload
    blob.write_bytes(bytes(data))
    # ... and plants a whole unsigned checkpoint of their own
    checkpointer(root, keep=9, signing_key="").save({"w": Planted(marker)}, 3)
    with caplog.at_level(logging.WARNING):
        assert signed.restore().step == 1
    assert not marker.exists()
    assert "step 3 is not usable (UntrustedCheckpoint: the manifest is not signed" in caplog.text
    assert "step 2 is not usable (CorruptCheckpoint: checksum mismatch" in caplog.text
    # the control: without a key, the planted checkpoint runs its code (the documented risk)
    assert checkpointer(root, signing_key="").restore().step == 3
    assert marker.exists()


def test_the_signing_key_comes_from_the_environment_and_the_flow_helper(tmp_path, monkeypatch):
    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run

    monkeypatch.setenv(SIGNING_KEY_ENV, "from-the-worker")
    ckpt = checkpointer_for_run(str(tmp_path), key="flow-run-1")
    assert ckpt.signed
    ckpt.save({"x": 1}, 1)
    assert checkpointer_for_run(str(tmp_path), key="flow-run-1").restore().state == {"x": 1}
    assert (
        checkpointer_for_run(str(tmp_path), key="flow-run-1", signing_key="other").restore() is None
    )
    monkeypatch.setenv(SIGNING_KEY_ENV, "")
    assert not checkpointer_for_run(str(tmp_path), key="flow-run-1").signed
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_the_worker_gives_each_flow_run_a_stable_signing_key(tmp_path):
    import hashlib
    import hmac

    from prefect.client.schemas.objects import FlowRun

    from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket
    from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

    def job_env(flow_run, market):
        config = SpotGPUJobConfiguration(
            market=market, checkpoint_storage=CheckpointStorage(path=str(tmp_path))
        )
        config.prepare_for_flow_run(flow_run)
        return config.job_spec().env

    market = SpotMarket(url="http://127.0.0.1:4300", api_key="sgk_tenant-key")
    run = FlowRun(id=uuid.uuid4(), name="quiet-otter", flow_id=uuid.uuid4())
    other = FlowRun(id=uuid.uuid4(), name="loud-otter", flow_id=uuid.uuid4())
    expected = hmac.new(
        b"sgk_tenant-key", f"checkpoint-signing:{run.id}".encode(), hashlib.sha256
    ).hexdigest()
    assert job_env(run, market)[SIGNING_KEY_ENV] == expected
    assert job_env(run, market)[SIGNING_KEY_ENV] == expected  # a resume: the same key
    assert job_env(other, market)[SIGNING_KEY_ENV] != expected
    assert SIGNING_KEY_ENV not in job_env(run, None)  # no market key: unsigned, as before


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("key", "written", "older"),
    [("", "spotgpu-checkpoint/3", "spotgpu-checkpoint/1"),
     ("run-key", "spotgpu-checkpoint/4", "spotgpu-checkpoint/2")],
)  # fmt: skip
def test_saves_write_the_fast_formats_and_the_earlier_ones_still_restore(
    tmp_path, monkeypatch, key, written, older
):
    """A save writes XXH3 leaves (BLAKE3 when signed); a checkpoint of an earlier version
    (CRC32, SHA-256), or written where those libraries were missing, restores as before, and
    a flipped byte is caught in each format."""
    import prefect_spotgpu.checkpoint.format as fmt

    ckpt = checkpointer(tmp_path, keep=9, signing_key=key)
    ckpt.save({"w": torch.arange(6.0)}, 1)
    manifest = json.loads((step_dir(tmp_path, 1) / "manifest.json").read_bytes())["manifest"]
    assert manifest["format"] == written
    leaf = manifest["tree"]["items"][0][1]
    assert set(leaf) & set(fmt.DIGESTS.values()) == {fmt.DIGESTS[written]}
    monkeypatch.setattr(fmt, "writing_format", lambda signed: older)  # an earlier version's
    ckpt.save({"w": torch.arange(7.0)}, 2)
    monkeypatch.undo()
    assert (
        json.loads((step_dir(tmp_path, 2) / "manifest.json").read_bytes())["manifest"]["format"]
        == older
    )
    got = checkpointer(tmp_path, keep=9, signing_key=key).restore()
    assert got.step == 2 and torch.equal(got.state["w"], torch.arange(7.0))
    for step in (2, 1):  # each format's checksum catches a flipped byte
        flip_a_blob_byte(tmp_path, step)
    assert checkpointer(tmp_path, keep=9, signing_key=key).restore() is None


def test_a_format_whose_hash_library_is_missing_fails_loudly_not_as_corrupt(monkeypatch):
    """A reader without ``xxhash`` must not take a good checkpoint for a corrupt one (the run
    would restart from scratch): it says what to install."""
    import prefect_spotgpu.checkpoint.format as fmt

    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ImportError, match="pip install xxhash"):
        fmt._digest("xxh3", b"abc")
    assert fmt.writing_format(False) == fmt.FORMAT  # a save there writes CRC32 leaves
