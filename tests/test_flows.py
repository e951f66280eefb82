"""The example flows: an attempt stopped by a notice and resumed in a fresh process gives the
same output as an uninterrupted run (losses, the cleaned set, the frames, byte for byte)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
DRIVER = HERE / "flow_driver.py"
sys.path.insert(0, str(HERE.parent / "flows"))

pytestmark = pytest.mark.slow


def drive(flow: str, work: Path, out: Path, notice_at: int = -1, env=None, **args):
    result = subprocess.run(
        [sys.executable, str(DRIVER), flow, str(work), str(out), str(notice_at), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def interrupted_and_uninterrupted(tmp_path, flow, notice_at, **args):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for d in (whole, parts):
        d.mkdir()
    drive(flow, whole, whole / "out", **args)
    stopped = drive(flow, parts, parts / "out", notice_at=notice_at, **args)
    assert f"stopped after the final save at {notice_at}" in stopped
    assert not (parts / "out" / "result.json").exists()
    drive(flow, parts, parts / "out", **args)
    return whole / "out", parts / "out"


def test_pretraining_resumes_on_the_same_loss_curve(tmp_path):
    whole, parts = interrupted_and_uninterrupted(
        tmp_path, "pretrain", notice_at=17, steps=40, corpus_bytes=300_000
    )
    a = json.loads((whole / "result.json").read_text())
    b = json.loads((parts / "result.json").read_text())
    assert len(a["losses"]) == 40
    assert [x.hex() for x in a["losses"]] == [x.hex() for x in b["losses"]]  # bitwise
    assert a["losses"][-1] < a["losses"][0] - 0.5  # it learns


def test_the_cleaned_set_is_the_same_and_no_pair_is_lost_or_doubled(tmp_path):
    from clean import make_dataset

    source = tmp_path / "source"
    planted = make_dataset(source, pairs=400, shards=8, seed=3)
    whole, parts = interrupted_and_uninterrupted(tmp_path, "clean", notice_at=3, source=str(source))
    names = sorted(p.name for p in whole.glob("shard-*.jsonl"))
    assert names == sorted(p.name for p in parts.glob("shard-*.jsonl")) and len(names) == 8
    for name in [*names, "report.json"]:
        assert (whole / name).read_bytes() == (parts / name).read_bytes(), name
    report = json.loads((whole / "report.json").read_text())
    ids = [json.loads(line)["id"] for n in names for line in (parts / n).read_text().splitlines()]
    assert len(ids) == len(set(ids)) == report["kept"]
    assert report["seen"] == 400
    assert report["exact_duplicate"] + report["near_duplicate"] >= 0.9 * (
        planted.get("exact", 0) + planted.get("near", 0)
    )
    assert report["undecodable"] == planted.get("undecodable", 0)
    assert report["too_small"] == planted.get("too_small", 0)


def test_cleaning_killed_mid_shard_redoes_that_shard_only(tmp_path):
    from clean import make_dataset

    source = tmp_path / "source"
    make_dataset(source, pairs=600, shards=12, seed=4)
    whole = tmp_path / "whole"
    whole.mkdir()
    drive("clean", whole, whole / "out", source=str(source))
    parts = tmp_path / "parts"
    parts.mkdir()
    args = [sys.executable, str(DRIVER), "clean", str(parts), str(parts / "out"), "-1"]
    victim = subprocess.Popen(
        [*args, json.dumps({"source": str(source)})],
        env={**os.environ, "FLOW_DRIVER_EVERY": "0.000001"},  # a checkpoint after every shard
    )
    deadline = time.monotonic() + 60
    while len(list((parts / "out").glob("shard-*.jsonl"))) < 5:
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)  # between shards, or in the middle of one
    victim.wait()
    drive("clean", parts, parts / "out", env={"FLOW_DRIVER_EVERY": "0.000001"}, source=str(source))
    for path in sorted((whole).glob("*.json*")):
        assert path.read_bytes() == (parts / "out" / path.name).read_bytes(), path.name


def test_rendering_skips_done_frames_and_writes_the_same_bytes(tmp_path):
    whole, parts = interrupted_and_uninterrupted(
        tmp_path, "render", notice_at=2, frames=6, width=64, height=48
    )
    frames = sorted(p.name for p in whole.glob("frame-*.png"))
    assert len(frames) == 6
    for name in [*frames, "animation.gif"]:
        assert (whole / name).read_bytes() == (parts / name).read_bytes(), name
    from PIL import Image

    with Image.open(whole / "animation.gif") as gif:
        assert gif.n_frames == 6
        pixels = np.asarray(gif.convert("RGB")).reshape(-1, 3)
        assert len(np.unique(pixels, axis=0)) > 50  # a picture, not a blank
