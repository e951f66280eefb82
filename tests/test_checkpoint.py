"""The checkpoint library: format, atomic local storage, notices, faults, exact resume."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from prefect_spotgpu.checkpoint import (
    Checkpointer,
    LocalStorage,
    rng_state,
    set_rng_state,
    storage_from_url,
)
from prefect_spotgpu.checkpoint.storage import step_name

HERE = Path(__file__).parent


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_every_kind_of_state_round_trips_exactly(tmp_path):
    ckpt = Checkpointer(LocalStorage(tmp_path), "run", handle_sigusr1=False)
    state = {
        "f32": torch.randn(64, 33),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "i64": torch.arange(10),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(8, 8).t(),
        "np": np.random.default_rng(1).random((3, 5)),
        "nan": float("nan"),
        "big": 2**70,
        "text": "ünïcode",
        "none": None,
        "nested": [1, (2.0, "x"), {"k": np.int32(5)}],
        "set": {1, 2, 3},
        7: "int key",
        "rng": rng_state(),
    }
    ckpt.save(state, 3)
    got = ckpt.restore()
    assert got.step == 3
    for name in ("f32", "bf16", "i64", "scalar", "empty", "strided"):
        assert (
            torch.equal(got.state[name], state[name]) and got.state[name].dtype == state[name].dtype
        )
    assert np.array_equal(got.state["np"], state["np"])
    assert np.isnan(got.state["nan"]) and got.state["big"] == 2**70
    assert got.state["nested"] == [1, (2.0, "x"), {"k": 5}] and got.state["set"] == {1, 2, 3}
    assert got.state[7] == "int key" and got.state["text"] == "ünïcode"
    before = (random.random(), np.random.random(), torch.rand(1))
    set_rng_state(got.state["rng"])
    assert (random.random(), np.random.random(), torch.rand(1)) == before


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_periodic_saves_follow_the_interval_and_retention_keeps_k(tmp_path, background):
    clock = Clock()
    ckpt = Checkpointer(
        LocalStorage(tmp_path),
        "run",
        every=60,
        keep=2,
        clock=clock,
        handle_sigusr1=False,
        background=background,
    )
    calls = []

    def state():
        calls.append(1)
        return {"x": torch.zeros(4)}

    assert ckpt.maybe_save(state, 0) is None and calls == []  # lazy: not called
    for step in range(1, 6):
        clock.t += 61
        result = ckpt.maybe_save(state, step)
        if background:  # returns once the snapshot is staged; the write is in flight
            assert result is None
            result = ckpt.wait()
        assert result.step == step and ckpt.last_save == result
        assert ckpt.maybe_save(state, step) is None  # not due again yet
    assert LocalStorage(tmp_path).steps("run") == [5, 4]
    assert len(calls) == 5


def test_a_notice_file_triggers_a_final_save_and_an_acknowledgement(tmp_path):
    notice = tmp_path / "notice.json"
    ckpt = Checkpointer(
        LocalStorage(tmp_path / "c"), "run", every=3600, notice_file=notice, handle_sigusr1=False
    )
    assert ckpt.maybe_save({"x": 1}, 1) is None
    notice.write_text(json.dumps({"deadline": 12345.0}))
    result = ckpt.maybe_save({"x": 2}, 2)
    assert result.final and ckpt.notice_received and ckpt.notice_deadline == 12345.0
    ack = json.loads((tmp_path / "notice.json.ack").read_text())
    assert ack["step"] == 2 and ack["durable"] is True
    assert ckpt.restore().state == {"x": 2}
    assert ckpt.maybe_save({"x": 3}, 3) is None  # one final save only


def test_sigusr1_only_sets_a_flag_and_the_next_call_saves(tmp_path):
    ckpt = Checkpointer(LocalStorage(tmp_path), "run", every=3600, ack_file=tmp_path / "ack.json")
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered before kill returns; handled by now
        assert LocalStorage(tmp_path).steps("run") == []  # nothing saved in the handler
        assert ckpt.notice_pending()
        assert ckpt.maybe_save({"w": torch.ones(3)}, 9).final
        assert json.loads((tmp_path / "ack.json").read_text())["step"] == 9
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_flipped_byte_is_detected_and_the_previous_checkpoint_used(tmp_path, caplog):
    ckpt = Checkpointer(LocalStorage(tmp_path), "run", keep=5, handle_sigusr1=False)
    ckpt.save({"w": torch.arange(1000.0)}, 1)
    ckpt.save({"w": torch.arange(1000.0) * 2}, 2)
    blob = tmp_path / "run" / step_name(2) / "data.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        got = ckpt.restore()
    assert got.step == 1 and torch.equal(got.state["w"], torch.arange(1000.0))
    assert "checksum mismatch" in caplog.text
    manifest = tmp_path / "run" / step_name(1) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step":1', '"step":9'))
    assert ckpt.restore() is None  # both unusable: nothing is loaded


def test_a_checkpoint_without_its_manifest_does_not_exist(tmp_path):
    ckpt = Checkpointer(LocalStorage(tmp_path), "run", handle_sigusr1=False)
    ckpt.save({"a": 1}, 1)
    torn = tmp_path / "run" / step_name(2)
    torn.mkdir()
    (torn / "data.bin").write_bytes(b"partial")
    (tmp_path / "run" / ".tmp-00000000000000000003-abcd").mkdir()
    assert LocalStorage(tmp_path).steps("run") == [1]
    assert ckpt.restore().step == 1


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_a_failing_storage_does_not_stop_training_and_the_next_call_retries(
    tmp_path, caplog, background
):
    root = tmp_path / "store"
    root.write_text("not a directory")  # every write fails for real
    clock = Clock()
    ckpt = Checkpointer(
        LocalStorage(root),
        "run",
        every=10,
        clock=clock,
        handle_sigusr1=False,
        background=background,
    )
    clock.t = 11
    with caplog.at_level(logging.ERROR):
        assert ckpt.maybe_save({"x": 1}, 1) is None
        if background:
            ckpt.close()  # the write failed in its thread; the checkpointer logs it
    assert ckpt.failures == 1 and "training goes on" in caplog.text
    root.unlink()
    root.mkdir()  # the storage comes back
    result = ckpt.maybe_save({"x": 2}, 2)  # retried at once, not a full interval later
    assert (ckpt.wait() if background else result).step == 2


def test_a_final_save_that_fails_raises(tmp_path):
    root = tmp_path / "store"
    root.write_text("x")
    ckpt = Checkpointer(LocalStorage(root), "run", notice_file=tmp_path / "n", handle_sigusr1=False)
    (tmp_path / "n").write_text("{}")
    with pytest.raises(OSError):
        ckpt.maybe_save({"x": 1}, 1)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="every"):
        Checkpointer(LocalStorage(tmp_path), "run", every=0, handle_sigusr1=False)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(LocalStorage(tmp_path), "run", keep=0, handle_sigusr1=False)
    with pytest.raises(ValueError, match="key"):
        Checkpointer(LocalStorage(tmp_path), "../escape", handle_sigusr1=False).save({}, 1)
    with pytest.raises(ValueError, match="step"):
        Checkpointer(LocalStorage(tmp_path), "run", handle_sigusr1=False).save({}, -1)
    with pytest.raises(ValueError, match="URL"):
        storage_from_url("ftp://x/y")
    assert isinstance(storage_from_url(str(tmp_path)), LocalStorage)


KILL_SCRIPT = """
import sys, torch
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
ckpt = Checkpointer(LocalStorage(sys.argv[1]), "run", keep=10, handle_sigusr1=False)
ckpt.save({"w": torch.full((1000,), 1.0)}, 1)
print("first", flush=True)
big = {"w": torch.randn(64, 1024, 1024)}  # 256 MB: the kill lands mid-write
step = 2
while True:
    ckpt.save(big, step)
    step += 1
"""


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "first"
    time.sleep(random.uniform(0.2, 0.8))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    ckpt = Checkpointer(LocalStorage(tmp_path), "run", handle_sigusr1=False)
    got = ckpt.restore()
    assert got is not None
    if got.step == 1:
        assert torch.equal(got.state["w"], torch.full((1000,), 1.0))
    else:  # a later save that committed before the kill: complete and verified
        assert got.state["w"].shape == (64, 1024, 1024)


def run_training(ckpt_dir, log, steps, notice_at=None):
    cmd = [sys.executable, str(HERE / "ckpt_train.py"), str(ckpt_dir), str(log), str(steps)]
    proc = subprocess.Popen(cmd)
    if notice_at is not None:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().splitlines()) > notice_at):
            assert time.monotonic() < deadline and proc.poll() is None, "training stalled"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGUSR1)  # from another process: the notice
    assert proc.wait(timeout=120) == 0


@pytest.mark.slow
def test_resumed_training_follows_the_same_loss_curve_bitwise(tmp_path):
    steps = 60
    run_training(tmp_path / "a", tmp_path / "a.log", steps)
    uninterrupted = (tmp_path / "a.log").read_text().splitlines()
    assert len(uninterrupted) == steps
    notice_at = random.Random().randint(5, 45)
    run_training(tmp_path / "b", tmp_path / "b.log", steps, notice_at=notice_at)
    stopped = (tmp_path / "b.log").read_text().splitlines()
    assert len(stopped) < steps, "the notice should have stopped the first process"
    run_training(tmp_path / "b", tmp_path / "b.log", steps)  # a fresh process resumes
    resumed = (tmp_path / "b.log").read_text().splitlines()
    assert resumed == uninterrupted, f"diverged after a notice at step ~{notice_at}"


@pytest.mark.slow
def test_checkpoint_benchmark_reports_one_json_object():
    out = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "benchmarks" / "checkpoint.py"),
            "--gib",
            "0.125",
            "--repeat",
            "3",  # a median: one save alone is now and then 5x slower on this disk
            "--async-gib",
            "0.125",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["state_bytes"] == 1 << 27
    # gross regressions only: the target (0.9 x raw at 1 GiB) is in the benchmark itself
    assert report["ratio_to_raw"]["ours"] > 0.3  # (0.5 was met by a hair under a full suite)
    assert report["notice_to_durable_seconds"] < 5
    periodic = report["periodic_saves"]["0.125GiB"]
    assert periodic["staging_bytes_over_state"] == 1.0  # one copy of the state
    assert periodic["seconds"]["async_blocking"] < periodic["seconds"]["sync_blocking"]


def test_the_flow_helper_takes_storage_from_the_environment(tmp_path, monkeypatch):
    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run
    from prefect_spotgpu.protocol import JOB_ENV

    CHECKPOINT_URL_ENV = JOB_ENV.CHECKPOINT_URL

    monkeypatch.delenv(CHECKPOINT_URL_ENV, raising=False)
    with pytest.raises(ValueError, match=CHECKPOINT_URL_ENV):
        checkpointer_for_run(key="k")
    monkeypatch.setenv(CHECKPOINT_URL_ENV, f"file://{tmp_path}")
    with pytest.raises(ValueError, match="not inside a flow run"):
        checkpointer_for_run()
    ckpt = checkpointer_for_run(key="flow-run-abc", every=60)
    assert isinstance(ckpt.storage, LocalStorage) and ckpt.storage.root == tmp_path
    ckpt.save({"x": 1}, 1)
    assert checkpointer_for_run(key="flow-run-abc").restore().state == {"x": 1}
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_numpy_only_checkpoint_never_imports_torch(tmp_path):
    """torch installed but unused: saving and restoring NumPy state must not import it (its
    import cost a NumPy-only flow 1.5 s a save)."""
    import subprocess
    import sys

    script = f"""
import sys
import numpy as np
from pathlib import Path
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
ckpt = Checkpointer(LocalStorage(Path({str(tmp_path)!r})), "numpy-only")
ckpt.save({{"w": np.arange(4.0), "step": 3}}, 3)
restored = ckpt.restore()
assert restored.step == 3 and restored.state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
