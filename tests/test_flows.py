"""The example flows: an attempt stopped by a notice and resumed in a fresh process gives the
same output as an uninterrupted run (losses, the cleaned set, the frames, byte for byte); the
pretraining flow also as a gang of two ranks (DDP over gloo on loopback, a process a rank)."""

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
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )  # one thread: a CPU reduction split over threads may round otherwise on a busy machine
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


# ---------------------------------------------------------------- the pretraining gang

PRETRAIN = HERE.parent / "flows" / "pretrain.py"
GANG_STEPS = 30
TORCH_DISTRIBUTED = ("RANK", "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_RANK", "MASTER_PORT")


def start_ranks(commands: list[list[str]], envs: list[dict], logs: Path) -> list[subprocess.Popen]:
    """Rank r of ``len(envs)`` as its own process, as a node's agent will start a member:
    ``commands[r]`` with torch.distributed's standard environment (a free loopback port;
    ``envs[r]`` added) and one CPU thread; its output in ``logs/rank<r>.out``."""
    from conftest import free_port

    port = free_port()
    logs.mkdir(parents=True)
    procs = []
    for rank, (command, extra) in enumerate(zip(commands, envs, strict=True)):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SPOTGPU_") and k not in TORCH_DISTRIBUTED
        }
        env.update(RANK=str(rank), WORLD_SIZE=str(len(envs)), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
        env.update(PYTHONFAULTHANDLER="1")  # a crash prints every thread's Python stack
        with open(logs / f"rank{rank}.out", "w") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def start_pretraining_gang(
    store: Path, logs: Path, result: Path, envs: list[dict], *flags: str
) -> list[subprocess.Popen]:
    """Every rank runs ``flows/pretrain.py``'s command line; rank 0 writes ``result``."""
    command = [
        *(sys.executable, str(PRETRAIN), "--steps", str(GANG_STEPS)),
        *("--corpus-bytes", "300000", "--log-every", "1"),  # the key: "pretrain"
        *("--checkpoints", str(store), "--result", str(result), *flags),
    ]
    return start_ranks([command] * len(envs), envs, logs)


def finish(procs: list[subprocess.Popen], logs: Path) -> None:
    for rank, proc in enumerate(procs):
        code = proc.wait(timeout=180)
        assert code == 0, (logs / f"rank{rank}.out").read_text()[-3000:]


def logged_steps(logs: Path, rank: int) -> list[int]:
    lines = (logs / f"rank{rank}.out").read_text().splitlines()
    return [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")]


def test_a_pretraining_gang_noticed_on_one_rank_resumes_on_the_same_loss_curve(tmp_path):
    """Two ranks (DDP over gloo), the second noticed by SIGUSR1 alone: both save one gang
    checkpoint at the same step and wait to be stopped; restarted, they finish on the loss
    curve of a gang never stopped, bit for bit."""
    from prefect_spotgpu.checkpoint.storage import step_name
    from prefect_spotgpu.protocol import JOB_ENV

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole_logs = whole / "logs"
    uninterrupted = start_pretraining_gang(
        whole / "store", whole_logs, whole / "result.json", [{}, {}]
    )
    agent_files = [
        {
            name: str(parts / f"{name.lower()}-{rank}")
            for name in (JOB_ENV.NOTICE_FILE, JOB_ENV.ACK_FILE, JOB_ENV.SAVED_FILE)
        }
        for rank in (0, 1)
    ]
    logs = parts / "first"
    procs = start_pretraining_gang(
        parts / "store", logs, parts / "result.json", agent_files, "--after-notice", "wait"
    )
    deadline = time.monotonic() + 120
    while len(logged_steps(logs, 0)) < 8:
        assert time.monotonic() < deadline and procs[0].poll() is None, "training stalled"
        time.sleep(0.01)
    os.kill(procs[1].pid, signal.SIGUSR1)  # one member noticed: not the flow run's rank
    acks = []
    for files in agent_files:
        ack = Path(files[JOB_ENV.ACK_FILE])
        while not ack.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, "no final save"
            time.sleep(0.01)
        acks.append(json.loads(ack.read_text()))
    saved_at = acks[0]["step"]
    assert [a["step"] for a in acks] == [saved_at] * 2 and all(a["durable"] for a in acks)
    assert 7 <= saved_at < GANG_STEPS - 1  # (rank 0 had logged step index 7)
    assert (parts / "store" / "pretrain" / "gang" / step_name(saved_at) / "manifest.json").exists()
    for proc in procs:  # they wait to be stopped, as a flow run
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.25)
    for proc in procs:  # as the agents do after the acknowledgements
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not (parts / "result.json").exists()
    finish(uninterrupted, whole_logs)
    assert logged_steps(whole_logs, 1) == [], "only rank 0 (the flow run's) reports losses"

    logs = parts / "resumed"
    finish(start_pretraining_gang(parts / "store", logs, parts / "result.json", [{}, {}]), logs)
    assert logged_steps(logs, 0)[0] == saved_at + 2, "the restart resumes after the saved step"
    a = json.loads((whole / "result.json").read_text())["losses"]
    b = json.loads((parts / "result.json").read_text())["losses"]
    assert len(a) == GANG_STEPS
    assert [x.hex() for x in a] == [x.hex() for x in b]  # bitwise
    assert a[-1] < a[0] - 0.5  # it learns


def test_rank_0_of_a_pretraining_gang_is_the_flow_run(prefect_api_url, tmp_path):
    """As the agents will start a gang of two: rank 0 is the Prefect engine (the flow run's
    state and logs are its), rank 1 the command line the module documents, both with the flow
    run's id; they find the same checkpoint key, so their gang checkpoints commit."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from prefect_spotgpu.protocol import JOB_ENV

    @flow(name="pretrain")
    def stand_in():  # the flow run's flow: the engine loads the real one from its entrypoint
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(stand_in, parameters={"steps": 6, "checkpoint_minutes": 1e-4})
    store = tmp_path / "store"
    job = {
        "PREFECT_API_URL": prefect_api_url,
        "PREFECT__FLOW_RUN_ID": str(run.id),
        JOB_ENV.CHECKPOINT_URL: str(store),
    }
    engine = [sys.executable, "-m", "prefect.engine"]
    member = [sys.executable, str(PRETRAIN), "--steps", "6", "--checkpoint-minutes", "1e-4"]
    envs = [{**job, "PREFECT__FLOW_ENTRYPOINT": f"{PRETRAIN}:pretrain"}, job]
    finish(start_ranks([engine, member], envs, tmp_path / "logs"), tmp_path / "logs")

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run.id).state.is_completed()
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    messages = [log.message for log in logs]
    assert "rank 0 of a gang of 2: data-parallel, batch 8 a rank" in messages
    assert any(m.startswith("step 6/6 loss") for m in messages)
    assert logged_steps(tmp_path / "logs", 1) == []
    key = store / f"flow-run-{run.id}"
    assert sorted(p.name for p in key.iterdir()) == ["gang", "rank-00000", "rank-00001"]
    assert len(list((key / "gang").iterdir())) == 3  # committed every step, the newest kept


def fsdp(ranks: int, work: Path, notice_at: int = -1, steps: int = 40) -> tuple[str, dict]:
    """``flows/fsdp_pretrain.py``'s training on ``ranks`` processes (torchrun, gloo)."""
    result = work / f"result-{notice_at}-{ranks}.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(HERE / "fsdp_driver.py"), str(work), str(result), str(notice_at),
         str(steps)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(result.read_text())


def test_an_fsdp_gang_noticed_on_one_rank_resumes_on_the_same_curve_and_reshards(tmp_path):
    import shutil

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for work in (whole, parts):
        work.mkdir()
    _, calm = fsdp(2, whole)
    assert len(calm["losses"]) == 40 and calm["losses"][-1] < calm["losses"][0] - 1  # learns
    said, stopped = fsdp(2, parts, notice_at=17)
    assert "stopped after the final save at 17" in said and len(stopped["losses"]) == 18
    for rank in (0, 1):  # each node's agent hears from its own rank
        assert json.loads((parts / f"notice-{rank}.ack").read_text())["step"] == 17
    alone = tmp_path / "alone"
    shutil.copytree(parts, alone)
    _, resumed = fsdp(2, parts)
    assert [x.hex() for x in resumed["losses"]] == [x.hex() for x in calm["losses"]]  # bitwise
    # the same checkpoint on one rank: DCP reshards the 2-rank save; the run goes on from 18
    _, one = fsdp(1, alone)
    assert one["world_size"] == 1 and len(one["losses"]) == 40
    assert one["losses"][:18] == calm["losses"][:18]
    assert abs(one["losses"][18] - calm["losses"][18]) < 0.05 * calm["losses"][18]
