"""Sharded (gang) checkpoints: real rank processes on real torch.distributed (gloo on
loopback), a real local disk and S3 (moto in server mode), real signals and SIGKILLs."""

from __future__ import annotations

import doctest
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

import prefect_spotgpu.checkpoint.flow as flow_module
import prefect_spotgpu.checkpoint.gang as gang_module
from conftest import free_port
from prefect_spotgpu.checkpoint import (
    Checkpointer,
    LocalStorage,
)
from prefect_spotgpu.checkpoint.flow import rank_from_environment
from prefect_spotgpu.checkpoint.storage import step_name
from prefect_spotgpu.protocol import JOB_ENV

HERE = Path(__file__).parent
SECRET = "moto-secret"
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_RANK", "MASTER_PORT")


def rank_env(rank: int, port: int, world_size: int = 2, **extra: str) -> dict:
    """The environment of rank ``rank``: torch.distributed's variables, nothing of ours but
    ``extra`` (no notice, ack or signing key from the test's own environment)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPOTGPU_") and k not in RANK_VARIABLES
    }
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(port), PYTHONUNBUFFERED="1", **extra)
    return env


def start_gang(script: str, args: list[str], tmp: Path, envs: list[dict] | None = None):
    """Start one process per rank; ``envs[r]`` adds to rank r's environment."""
    port = free_port()
    envs = envs or [{}, {}]
    procs = []
    for rank, extra in enumerate(envs):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), *args],
                env=rank_env(rank, port, len(envs), **extra),
                stdout=subprocess.PIPE,
                stderr=open(tmp / f"rank{rank}-{port}.err", "w"),  # noqa: SIM115
                text=True,
            )
        )
    return procs, [tmp / f"rank{r}-{port}.err" for r in range(len(envs))]


def run_ops(root: str, key: str, *ops: str, tmp: Path, envs=None, timeout=90):
    """Run ``shard_ops.py`` on two ranks; their JSON lines per rank, and their stderr."""
    procs, errs = start_gang("shard_ops.py", [root, key, *ops], tmp, envs)
    lines = []
    for proc, err in zip(procs, errs, strict=True):
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err.read_text()[-3000:]
        lines.append([json.loads(line) for line in out.splitlines()])
    return lines, [err.read_text() for err in errs]


def restored(lines) -> list[tuple]:
    return [(r["step"], r["value"]) for rank in lines for r in rank if r["op"] == "restore"]


# ---------------------------------------------------------------- plain data and arguments


def test_the_docstring_examples_hold():
    assert doctest.testmod(gang_module).failed == 0
    flow_examples = doctest.testmod(flow_module)
    assert flow_examples.attempted > 0 and flow_examples.failed == 0


@pytest.mark.parametrize(
    "environ, error",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
        ({"NODE_RANK": "2", "NNODES": "2"}, "NODE_RANK=2 is not a rank of NNODES=2"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ],
)
def test_a_malformed_rank_environment_is_refused_naming_the_variable(environ, error):
    with pytest.raises(ValueError, match=error):
        rank_from_environment(environ)


def test_world_size_one_is_the_plain_checkpointer_and_a_gang_needs_its_process_group(tmp_path):
    plain = Checkpointer(LocalStorage(tmp_path), "run", handle_sigusr1=False)
    assert type(plain) is Checkpointer and (plain.rank, plain.world_size) == (0, 1)
    plain.save({"x": 1}, 1)
    assert LocalStorage(tmp_path).steps("run") == [1]  # today's layout: <key>/<step>
    with pytest.raises(ValueError, match="rank must be 0"):
        Checkpointer(LocalStorage(tmp_path), "run", rank=1, handle_sigusr1=False)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        Checkpointer(LocalStorage(tmp_path), "run", rank=2, world_size=2, handle_sigusr1=False)
    with pytest.raises(ValueError, match="world_size"):
        Checkpointer(LocalStorage(tmp_path), "run", world_size=0, handle_sigusr1=False)
    with pytest.raises(ValueError, match="init_process_group"):  # none in this process
        Checkpointer(LocalStorage(tmp_path), "run", rank=1, world_size=2, handle_sigusr1=False)


# ---------------------------------------------------------------- commit and restore


@pytest.mark.slow
def test_a_gang_commits_one_shard_per_rank_and_restores_each_rank_its_own(tmp_path):
    root = tmp_path / "store"
    lines, _ = run_ops(str(root), "run", "save:1", "save:2", "restore", tmp=tmp_path)
    assert restored(lines) == [(2, 20.0), (2, 21.0)]
    base = root / "run"
    assert sorted(p.name for p in base.iterdir()) == ["gang", "rank-00000", "rank-00001"]
    gang = json.loads((base / "gang" / step_name(2) / "manifest.json").read_bytes())
    record = gang["manifest"]["extra"]["gang"]
    assert record["world_size"] == 2
    for rank, shard in enumerate(record["shards"]):
        raw = (base / f"rank-{rank:05d}" / step_name(2) / "manifest.json").read_bytes()
        assert shard["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
        assert shard["size"] == 4000
    # a world-size-1 checkpointer of the same key loads none of it, and says why
    with pytest.raises(ValueError, match=r"holds a gang's shards .* DistributedCheckpointer"):
        Checkpointer(LocalStorage(root), "run", handle_sigusr1=False).restore()


@pytest.mark.slow
def test_a_rank_killed_after_its_shard_leaves_a_torn_step_that_is_never_loaded(tmp_path):
    root, gate = tmp_path / "store", tmp_path / "gate"
    procs, errs = start_gang(
        "shard_ops.py", [str(root), "run", "save:1", f"gate:{gate}", "save:2"], tmp_path
    )
    for proc in procs:
        assert json.loads(proc.stdout.readline())["step"] == 1
    rank1_shard = root / "run" / "rank-00001" / step_name(2) / "manifest.json"
    deadline = time.monotonic() + 60
    while not rank1_shard.exists():  # rank 1's shard is durable; rank 0's waits at the gate
        assert time.monotonic() < deadline, errs[1].read_text()
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(timeout=10)
    gate.touch()  # rank 0 writes its shard, then finds its peer gone
    assert procs[0].wait(timeout=60) != 0
    assert (root / "run" / "rank-00000" / step_name(2) / "manifest.json").exists()
    assert LocalStorage(root).steps("run/gang") == [1]  # torn: no gang manifest

    lines, _ = run_ops(str(root), "run", "restore", "save:3", tmp=tmp_path)
    assert restored(lines) == [(1, 10.0), (1, 11.0)]
    for rank in (0, 1):  # the torn step's shards went at the next commit
        assert LocalStorage(root).steps(f"run/rank-{rank:05d}") == [3, 1]

    blob = root / "run" / "rank-00001" / step_name(3) / "data.bin"
    data = bytearray(blob.read_bytes())
    data[100] ^= 0x01
    blob.write_bytes(bytes(data))
    lines, err = run_ops(str(root), "run", "restore", tmp=tmp_path)
    assert restored(lines) == [(1, 10.0), (1, 11.0)]  # both ranks fall back together
    assert "gang checkpoint run step 3 is not usable on rank 1" in err[1]
    assert "checksum mismatch" in err[1]
    assert "gang checkpoint run step 3 is not usable on another rank" in err[0]


@pytest.mark.slow
def test_retention_counts_gang_steps_verified_on_every_rank(tmp_path):
    root = tmp_path / "store"
    keep_two = [{"SPOTGPU_TEST_KEEP": "2"}] * 2
    run_ops(str(root), "run", "save:1", "save:2", "save:3", tmp=tmp_path, envs=keep_two)
    shards = [LocalStorage(root).steps(f"run/rank-{rank:05d}") for rank in (0, 1)]
    assert LocalStorage(root).steps("run/gang") == [3, 2] and shards == [[3, 2], [3, 2]]
    blob = root / "run" / "rank-00001" / step_name(3) / "data.bin"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))
    # step 3 is unverified on rank 1 only: not counted, and (newer than a kept one) left alone
    _, err = run_ops(str(root), "run", "save:4", tmp=tmp_path, envs=keep_two)
    assert LocalStorage(root).steps("run/gang") == [4, 3, 2]
    assert "checksum mismatch" in err[1]
    run_ops(str(root), "run", "save:5", "restore", tmp=tmp_path, envs=keep_two)
    assert LocalStorage(root).steps("run/gang") == [5, 4]
    for rank in (0, 1):
        assert LocalStorage(root).steps(f"run/rank-{rank:05d}") == [5, 4]


@pytest.mark.slow
def test_a_notice_on_one_rank_is_answered_at_the_next_agreed_step_on_every_rank(tmp_path):
    envs = [{**e, "SPOTGPU_TEST_SYNC_EVERY": "3"} for e in notices(tmp_path, "k")]
    Path(envs[1][JOB_ENV.NOTICE_FILE]).write_text(json.dumps({"deadline": 99.0}))
    ops = ("maybe:1", "maybe:2", "maybe:3", "maybe:4")
    lines, _ = run_ops(str(tmp_path / "store"), "run", *ops, tmp=tmp_path, envs=envs)
    for rank in lines:  # steps 1 and 2: no agreement, no save; step 3: the final save
        assert [(r["step"], r["final"]) for r in rank] == [(None, None)] * 2 + [(3, True)] + [
            (None, None)
        ]
    for env in envs:
        assert json.loads(Path(env[JOB_ENV.ACK_FILE]).read_text())["step"] == 3
    assert LocalStorage(tmp_path / "store").steps("run/gang") == [3]


def notices(tmp_path: Path, tag: str) -> list[dict]:
    return [
        {
            JOB_ENV.NOTICE_FILE: str(tmp_path / f"{tag}-notice{r}.json"),
            JOB_ENV.ACK_FILE: str(tmp_path / f"{tag}-ack{r}.json"),
            JOB_ENV.SAVED_FILE: str(tmp_path / f"{tag}-saved{r}.json"),
        }
        for r in (0, 1)
    ]


@pytest.mark.slow
def test_a_final_save_that_fails_on_one_rank_is_acknowledged_failed_on_every_rank(tmp_path):
    (tmp_path / "store1").write_text("not a directory")  # rank 1's storage fails for real
    envs = notices(tmp_path, "storage")
    Path(envs[1][JOB_ENV.NOTICE_FILE]).write_text(json.dumps({"deadline": 1.0}))
    lines, _ = run_ops(str(tmp_path / "store{rank}"), "run", "maybe:4", tmp=tmp_path, envs=envs)
    assert [r[0]["error"] for r in lines] == ["GangCheckpointFailed", "NotADirectoryError"]
    for env in envs:
        ack = json.loads(Path(env[JOB_ENV.ACK_FILE]).read_text())
        assert ack["failed"] is True and ack["cause"] == "storage"
        assert not Path(env[JOB_ENV.SAVED_FILE]).exists()
    assert LocalStorage(tmp_path / "store0").steps("run/gang") == []

    envs = notices(tmp_path, "job")  # a rank whose state cannot be built: the job's failure
    Path(envs[0][JOB_ENV.NOTICE_FILE]).write_text("{}")
    lines, _ = run_ops(str(tmp_path / "job"), "run", "broken:4", tmp=tmp_path, envs=envs)
    assert [r[0]["error"] for r in lines] == ["GangCheckpointFailed", "RuntimeError"]
    for env in envs:
        ack = json.loads(Path(env[JOB_ENV.ACK_FILE]).read_text())
        assert ack["failed"] is True and ack["cause"] == "job"


@pytest.mark.slow
def test_storage_that_is_not_shared_fails_the_first_save_not_the_restore(tmp_path):
    envs = [{"SPOTGPU_TEST_EVERY": "0.000001"}] * 2
    root = str(tmp_path / "node{rank}")  # each rank its own disk: rank 0 cannot read rank 1's
    ops = ("maybe:1", "wait", "maybe:2", "wait")  # each written in the background
    lines, err = run_ops(root, "run", *ops, tmp=tmp_path, envs=envs)
    assert [r["step"] for rank in lines for r in rank] == [None] * 8
    assert "every rank must save to storage that every rank can read" in err[0]
    assert "training goes on" in err[1]  # periodic: logged on every rank, retried
    assert err[1].count("periodic gang checkpoint of run") == 2


# ---------------------------------------------------------------- S3


@pytest.fixture
def s3(s3_endpoint, request):
    """A fresh bucket, its client, and the ranks' environment for it."""
    name = f"gang-{abs(hash(request.node.name)) % 10**8}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key=SECRET,
    )
    client.create_bucket(Bucket=name)
    env = {
        "SPOTGPU_TEST_S3_ENDPOINT": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": SECRET,
    }
    return name, client, env


@pytest.mark.slow
def test_a_signed_gang_on_s3_commits_restores_and_refuses_another_key(s3, tmp_path):
    bucket, client, env = s3
    url = f"s3://{bucket}/runs"
    signed = [{**env, JOB_ENV.CHECKPOINT_SIGNING_KEY: "key-a"}] * 2
    lines, _ = run_ops(url, "run", "save:1", "save:2", "restore", tmp=tmp_path, envs=signed)
    assert restored(lines) == [(2, 20.0), (2, 21.0)]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert f"runs/run/gang/{step_name(2)}/manifest.json" in keys
    for rank in (0, 1):
        assert f"runs/run/rank-{rank:05d}/{step_name(2)}/manifest.json" in keys
    gang = json.loads(
        client.get_object(Bucket=bucket, Key=f"runs/run/gang/{step_name(2)}/manifest.json")[
            "Body"
        ].read()
    )
    assert "hmac_sha256" in gang and gang["manifest"]["format"] == "spotgpu-checkpoint/4"

    prefix = f"runs/run/rank-00000/{step_name(2)}/"
    (blob,) = [k for k in keys if k.startswith(prefix) and not k.endswith("manifest.json")]
    data = bytearray(client.get_object(Bucket=bucket, Key=blob)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=blob, Body=bytes(data))
    lines, err = run_ops(url, "run", "restore", tmp=tmp_path, envs=signed)
    assert restored(lines) == [(1, 10.0), (1, 11.0)]
    assert "step 2 is not usable on rank 0" in err[0]

    other = [{**env, JOB_ENV.CHECKPOINT_SIGNING_KEY: "key-b"}] * 2
    lines, err = run_ops(url, "run", "restore", tmp=tmp_path, envs=other)
    assert restored(lines) == [(None, None), (None, None)]
    assert "UntrustedCheckpoint" in err[1]
    assert SECRET not in err[0] + err[1]


# ---------------------------------------------------------------- exact resume of DDP

STEPS = 40


def start_training(url: str, tag: str, tmp: Path, envs: list[dict]):
    port = free_port()
    procs = []
    for rank, extra in enumerate(envs):
        log = tmp / f"{tag}{rank}.log"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "shard_train.py"), url, str(log), str(STEPS)],
                env=rank_env(rank, port, **extra),
                stderr=open(tmp / f"{tag}{rank}-{port}.err", "w"),  # noqa: SIM115
            )
        )
    return procs


def finish(procs, timeout=180) -> None:
    for proc in procs:
        assert proc.wait(timeout=timeout) == 0


def losses(tmp: Path, tag: str) -> list[list[str]]:
    return [(tmp / f"{tag}{rank}.log").read_text().splitlines() for rank in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[list[str]]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    finish(start_training(str(tmp / "store"), "a", tmp, [{}, {}]))
    curves = losses(tmp, "a")
    assert [len(c) for c in curves] == [STEPS, STEPS] and curves[0] != curves[1]
    return curves


def gang_manifest(storage_kind: str, where, step: int) -> tuple[dict, float]:
    """The gang manifest of ``step`` and when it was written."""
    if storage_kind == "local":
        path = where / "exact-resume" / "gang" / step_name(step) / "manifest.json"
        return json.loads(path.read_bytes()), path.stat().st_mtime
    bucket, client = where
    got = client.get_object(
        Bucket=bucket, Key=f"runs/exact-resume/gang/{step_name(step)}/manifest.json"
    )
    return json.loads(got["Body"].read()), got["LastModified"].timestamp()


@pytest.mark.slow
@pytest.mark.parametrize("storage_kind", ["local", "s3"])
def test_a_noticed_ddp_gang_saves_at_one_step_and_resumes_bitwise(
    storage_kind, uninterrupted, request, tmp_path
):
    envs = notices(tmp_path, "b")
    if storage_kind == "local":
        url, where = str(tmp_path / "store"), tmp_path / "store"
    else:
        bucket, client, env = request.getfixturevalue("s3")
        url, where = f"s3://{bucket}/runs", (bucket, client)
        envs = [{**e, **env} for e in envs]
    procs = start_training(url, "b", tmp_path, envs)
    notice_at = random.Random().randint(5, 30)
    rank1_log = tmp_path / "b1.log"
    deadline = time.monotonic() + 120
    while not (rank1_log.exists() and len(rank1_log.read_text().splitlines()) > notice_at):
        assert time.monotonic() < deadline and procs[1].poll() is None, "training stalled"
        time.sleep(0.005)
    if storage_kind == "local":  # one member noticed first: SIGUSR1 to rank 1 only
        os.kill(procs[1].pid, signal.SIGUSR1)
    else:  # or the notice file of rank 0 (the engine) only
        Path(envs[0][JOB_ENV.NOTICE_FILE]).write_text(json.dumps({"deadline": time.time() + 300}))
    finish(procs)
    stopped = losses(tmp_path, "b")
    assert len(stopped[0]) == len(stopped[1]) < STEPS, "the notice should have stopped both"
    final_step = len(stopped[0]) - 1
    manifest, committed_at = gang_manifest(storage_kind, where, final_step)
    assert manifest["manifest"]["extra"]["final"] is True
    for env in envs:  # both acked the same step, after the gang manifest existed
        ack = json.loads(Path(env[JOB_ENV.ACK_FILE]).read_text())
        assert ack["step"] == final_step and ack["durable"] is True
        assert ack["saved_at"] >= committed_at - 0.001
        saved = json.loads(Path(env[JOB_ENV.SAVED_FILE]).read_text())
        assert saved["step"] == final_step and saved["final"] is True

    for env in envs:  # as the agent does before it starts a job
        for name in (JOB_ENV.NOTICE_FILE, JOB_ENV.ACK_FILE, JOB_ENV.SAVED_FILE):
            Path(env[name]).unlink(missing_ok=True)
    finish(start_training(url, "b", tmp_path, envs))
    assert losses(tmp_path, "b") == uninterrupted, f"diverged after a notice at ~{notice_at}"


@pytest.mark.slow
def test_the_gang_benchmark_reports_its_figures(tmp_path):
    procs, errs = start_gang("shard_bench.py", [str(tmp_path / "gang"), "4"], tmp_path)
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errs[0].read_text()[-2000:]
    gang = json.loads(outputs[0])
    single = subprocess.run(
        [sys.executable, str(HERE / "shard_bench.py"), str(tmp_path / "single"), "4"],
        env={
            **{k: v for k, v in rank_env(0, 0).items() if k not in RANK_VARIABLES},
            "SPOTGPU_BENCH_GANG_SIZE": "2",
        },
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    alone = json.loads(single.stdout)
    assert gang["world_size"] == 2 and alone["world_size"] == 1
    assert alone["bytes_per_rank"] == 2 * gang["bytes_per_rank"]  # the same total bytes
    assert 0 < gang["max_us"] < 100_000 and gang["save_seconds"] > 0  # gross failures only


@pytest.mark.slow
def test_a_gang_of_another_size_is_told_how_to_resume_never_started_over(tmp_path):
    """Saved by 2 ranks, restored by 3: every rank refuses, naming the fixes (the progress is
    there: starting over would silently throw it away)."""
    root = tmp_path / "store"
    run_ops(str(root), "run", "save:1", "save:2", tmp=tmp_path)
    procs, errs = start_gang("shard_ops.py", [str(root), "run", "restore"], tmp_path, [{}] * 3)
    for proc, err in zip(procs, errs, strict=True):
        proc.communicate(timeout=90)
        assert proc.returncode != 0
        said = err.read_text()
        assert "gang checkpoint run step 2 was saved by 2 ranks and this gang has 3" in said
        assert "node_count=2" in said and "DistributedCheckpointer" in said
