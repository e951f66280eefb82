"""Asynchronous periodic saves: a consistent snapshot, a background write, at most one in
flight, the final save wins, and a process killed mid-write loses nothing committed. Real
local disk and real processes; the only seam is a gate that holds a write at a chosen point
(its storage is the real LocalStorage underneath)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
from prefect_spotgpu.checkpoint.background import CHUNK_BYTES
from prefect_spotgpu.cli.stack import wait_for
from test_checkpoint_shards import start_gang

HERE = Path(__file__).parent


class Gated:
    """A real ``LocalStorage`` whose writes wait at one point: ``before`` the blob, or
    ``after_blob`` (the blob written, before its manifest), until ``opened`` is set."""

    def __init__(self, root: Path, where: str = "before") -> None:
        self.inner = LocalStorage(root)
        self.where = where
        self.opened = threading.Event()
        self.waiting = threading.Event()

    def write(self, name, step, buffers, size, manifest):
        if self.where == "before":
            self.waiting.set()
            self.opened.wait(30)
            return self.inner.write(name, step, buffers, size, manifest)

        def gated_manifest() -> bytes:
            self.waiting.set()
            self.opened.wait(30)
            return manifest()

        return self.inner.write(name, step, buffers, size, gated_manifest)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def checkpointer(storage, clock=None, **options) -> Checkpointer:
    return Checkpointer(
        storage, "run", every=10, clock=clock or Clock(), handle_sigusr1=False, **options
    )


def test_the_snapshot_is_the_state_at_the_call_whatever_training_does_next(tmp_path):
    gated = Gated(tmp_path)
    clock = Clock()
    ckpt = checkpointer(gated, clock)
    weights = torch.arange(1 << 16, dtype=torch.float32)
    moments = np.ones(1000)
    clock.t = 11
    t0 = time.perf_counter()
    assert ckpt.maybe_save(lambda: {"w": weights, "m": moments, "note": [1, "a"]}, 1) is None
    assert time.perf_counter() - t0 < 5 and gated.waiting.wait(5)  # returned; write held
    weights.mul_(-1)  # training goes on, in place, while the save is written
    moments[:] = 7
    gated.opened.set()
    assert ckpt.wait().step == 1
    got = ckpt.restore()
    assert torch.equal(got.state["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert (got.state["m"] == 1).all() and got.state["note"] == [1, "a"]


def test_the_staging_memory_is_one_copy_of_the_state_reused_from_save_to_save(tmp_path):
    clock = Clock()
    ckpt = checkpointer(LocalStorage(tmp_path), clock)
    state = {"w": torch.zeros(1 << 18), "b": np.zeros(100)}
    buffers = []
    for step in (1, 2, 3):
        clock.t += 11
        ckpt.maybe_save(state, step)
        ckpt.wait()
        buffers.append(ckpt._staging._array.ctypes.data)
    size = ckpt.last_save.bytes
    assert ckpt._staging.nbytes == size <= (1 << 20) + 800 + 128  # one copy, the padding
    assert len(set(buffers)) == 1  # the same memory every time: no allocation after the first
    ckpt.close()
    assert ckpt._staging.nbytes == 0


@pytest.mark.parametrize("if_busy", ["skip", "wait"])
def test_at_most_one_save_is_in_flight(tmp_path, caplog, if_busy):
    gated = Gated(tmp_path)
    clock = Clock()
    ckpt = checkpointer(gated, clock, if_busy=if_busy)
    clock.t = 11
    ckpt.maybe_save({"x": torch.ones(4)}, 1)
    assert gated.waiting.wait(5)
    clock.t = 22  # due again while step 1 is still being written
    if if_busy == "skip":
        with caplog.at_level(logging.WARNING):
            assert ckpt.maybe_save({"x": torch.ones(4) * 2}, 2) is None
        assert ckpt.skipped == 1 and "skipped" in caplog.text
        clock.t = 25
        assert ckpt.maybe_save({"x": 3}, 3) is None and ckpt.skipped == 1  # interval restarted
        gated.opened.set()
        ckpt.wait()
        assert LocalStorage(tmp_path).steps("run") == [1]
    else:
        threading.Timer(0.5, gated.opened.set).start()
        t0 = time.perf_counter()
        ckpt.maybe_save({"x": torch.ones(4) * 2}, 2)  # waits for step 1, then stages step 2
        assert time.perf_counter() - t0 >= 0.4
        ckpt.wait()
        assert LocalStorage(tmp_path).steps("run") == [2, 1]


def test_the_final_save_abandons_a_periodic_one_still_writing_its_blob(tmp_path):
    gated = Gated(tmp_path, where="before")
    clock = Clock()
    notice = tmp_path / "notice.json"
    ckpt = checkpointer(gated, clock, notice_file=notice)
    clock.t = 11
    ckpt.maybe_save({"w": torch.zeros(CHUNK_BYTES // 4 + 10)}, 1)  # two chunks
    assert gated.waiting.wait(5)
    notice.write_text(json.dumps({"deadline": time.time() + 300}))
    threading.Timer(0.3, gated.opened.set).start()  # the periodic write resumes, sees abandon
    result = ckpt.maybe_save({"w": torch.ones(8)}, 2)
    assert result.final and result.step == 2
    ack = json.loads((tmp_path / "notice.json.ack").read_text())
    assert ack["step"] == 2 and ack["durable"] is True
    root = tmp_path / "run"
    assert LocalStorage(tmp_path).steps("run") == [2]  # step 1: abandoned, nothing committed
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # nor left behind
    assert torch.equal(ckpt.restore().state["w"], torch.ones(8))


def test_a_periodic_save_past_its_blob_finishes_before_the_final_save(tmp_path):
    gated = Gated(tmp_path, where="after_blob")
    clock = Clock()
    notice = tmp_path / "notice.json"
    ckpt = checkpointer(gated, clock, notice_file=notice)
    clock.t = 11
    ckpt.maybe_save({"w": torch.zeros(16)}, 1)
    assert gated.waiting.wait(5)  # the blob is written; the manifest waits
    notice.write_text("{}")
    threading.Timer(0.3, gated.opened.set).start()
    assert ckpt.maybe_save({"w": torch.ones(16)}, 2).step == 2
    assert LocalStorage(tmp_path).steps("run") == [2, 1]  # one after the other, never two


KILLED_MID_WRITE = """
import sys, time, torch
from pathlib import Path
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage

root, marker = Path(sys.argv[1]), Path(sys.argv[2])

class HalfWay(LocalStorage):
    # Stops the background write of step 2 after its first chunk, for the test to kill.

    def write(self, name, step, buffers, size, manifest):
        def chunks():
            for i, chunk in enumerate(buffers):
                if i == 1:
                    marker.write_text("half")
                    time.sleep(600)
                yield chunk

        return super().write(name, step, chunks() if step == 2 else buffers, size, manifest)

ckpt = Checkpointer(HalfWay(root), "run", every=1e-9, handle_sigusr1=False)
ckpt.save({"w": torch.full((16,), 1.0)}, 1)  # committed
ckpt.maybe_save({"w": torch.zeros((3 << 20) * 8)}, 2)  # in the background: killed mid-write
while True:
    time.sleep(1)
"""


@pytest.mark.slow
def test_a_process_killed_mid_background_write_keeps_the_previous_checkpoint(tmp_path):
    marker = tmp_path / "half"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "never got half way"
            time.sleep(0.01)
        torn = [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".tmp-")]
        assert torn and (torn[0] / "data.bin").stat().st_size > 0  # a blob half written
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    ckpt = Checkpointer(LocalStorage(tmp_path), "run", handle_sigusr1=False)
    got = ckpt.restore()
    assert got.step == 1 and torch.equal(got.state["w"], torch.full((16,), 1.0))
    assert LocalStorage(tmp_path).steps("run") == [1]


@pytest.mark.slow
def test_a_gang_commits_a_background_save_once_and_its_final_save_wins(tmp_path):
    """Rank 0's periodic shard write is held; a notice comes; the final save abandons it on
    every rank and commits the final step; a background save commits at the next agreement."""
    gate = tmp_path / "gate"
    notices = []
    for rank in (0, 1):
        notices.append(tmp_path / f"notice{rank}")
    envs = [
        {"SPOTGPU_TEST_EVERY": "0.000001", "SPOTGPU_NOTICE_FILE": str(notices[r])} for r in (0, 1)
    ]
    ops = ["maybe:1", "wait", "restore", f"gate:{gate}", "maybe:2", "notice", "maybe:3"]
    procs, errs = start_gang("shard_ops.py", [str(tmp_path / "s"), "run", *ops], tmp_path, envs)
    lines = [[], []]
    try:
        read = []  # rank 0's lines until its notice: held at the gate with step 2, the notice
        while not read or read[-1]["op"] != "notice":  # seen at step 3 (each op prints a line)
            line = procs[0].stdout.readline()
            assert line, errs[0].read_text()[-3000:]
            read.append(json.loads(line))
        wait_for(Path(f"{gate}.held").exists, 30, "rank 0's step 2 held at the gate")
        gate.write_text("open")
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 0, errs[rank].read_text()[-3000:]
            lines[rank] = (read if rank == 0 else []) + [json.loads(x) for x in out.splitlines()]
    finally:
        for proc in procs:
            proc.kill()
    for rank in (0, 1):
        by_op = [(r["op"], r.get("step")) for r in lines[rank]]
        assert by_op == [
            ("maybe", None),  # step 1 staged, written in the background
            ("wait", 1),  # committed once every rank's shard was durable
            ("restore", 1),
            ("maybe", None),
            ("notice", None),
            ("maybe", 3),  # the final save; step 2 abandoned on every rank
        ], by_op
        ack = json.loads(Path(str(notices[rank]) + ".ack").read_text())
        assert ack["step"] == 3 and ack["durable"] is True
    assert LocalStorage(tmp_path / "s").steps("run/gang") == [3, 1]


def test_large_read_only_and_pickled_parts_stage_quietly_and_round_trip(tmp_path):
    import warnings

    clock = Clock()
    ckpt = checkpointer(LocalStorage(tmp_path), clock)
    frozen = np.frombuffer(bytes(range(256)) * 8192, dtype=np.uint8)  # 2 MiB, read-only
    state = {"frozen": frozen, "big_object": {"blob": b"x" * (2 << 20)}, "t": torch.ones(1 << 19)}
    clock.t = 11
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "the given buffer is not writable"
        ckpt.maybe_save(state, 1)
        assert ckpt.wait().step == 1
    got = ckpt.restore().state
    assert (got["frozen"] == frozen).all() and got["big_object"] == state["big_object"]
    assert torch.equal(got["t"], state["t"])
