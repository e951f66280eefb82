"""Jobs are hostile (docs/operators/architecture.md#design-7): each test is an attack on the node,
made for real — real processes as real users, real signals, a real market — and what it must not
get.

The process-runner attacks need root (the agent isolates jobs only when it runs as root) and an
interpreter other users can run (the test's own may live in root's closed home).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import one_database, wait_for
from helpers import stop_agent
from prefect_spotgpu.agent.credentials import (
    NodeRecord,
    load_cursor,
    save_cursor,
    save_record,
)
from prefect_spotgpu.agent.isolation import (
    JobUsers,
    job_marker,
    job_processes,
    read_job_file,
    uids_in_use,
    unreachable,
    write_job_file,
)
from prefect_spotgpu.agent.runners import DockerRunner, JobRequest, ProcessRunner
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage, S3Storage
from test_agent import running

UID_BASE = JobUsers("auto", euid=0).uid_base  # this process's (per test worker: conftest)

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="jobs are isolated only under root")


def reachable_python() -> str | None:
    """An interpreter a job's uid can run: the test's own, or the system's."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(candidate)
        if path.exists() and unreachable(path) is None and unreachable(path.resolve()) is None:
            return candidate
    return None


PYTHON = reachable_python()
NEEDS_PYTHON = pytest.mark.skipif(PYTHON is None, reason="no interpreter other users can run")


@pytest.fixture
def sandbox():
    """A directory job users can traverse (pytest's own tmp_path is closed to them)."""
    base = Path(tempfile.mkdtemp(prefix="spotgpu-isolation-"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


HOSTILE = r"""
import json, os, subprocess, sys, time
from pathlib import Path

targets = json.loads(sys.argv[1])
report = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
          "env": dict(os.environ), "attempts": {}}

def attempt(name, action):
    try:
        report["attempts"][name] = "got: " + repr(action())[:300]
    except OSError as exc:
        report["attempts"][name] = type(exc).__name__

attempt("agent environ", lambda: Path(f"/proc/{targets['agent']}/environ").read_bytes())
attempt("node.json", lambda: Path(targets["node_json"]).read_text())
attempt("state dir", lambda: os.listdir(targets["state_dir"]))
attempt("other tenant's checkpoints", lambda: os.listdir(targets["other_checkpoints"]))
own = Path(os.environ["SPOTGPU_CHECKPOINT_URL"])
attempt("own checkpoints", lambda: (own / "probe").write_text("mine"))
secrets = []
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(s.encode() in environ for s in targets["secrets"]):
            secrets.append(int(pid))
report["secrets_seen_in"] = secrets
escaped = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # leaves the group
report["escaped"] = escaped.pid
Path("report.json.tmp").write_text(json.dumps(report))
os.replace("report.json.tmp", "report.json")
time.sleep(1000)
"""

PROCESS_ENV = {
    "PATH",
    "HOME",
    "LANG",
    "PREFECT_HOME",
    "CUDA_VISIBLE_DEVICES",
    "SPOTGPU_ALLOCATION_ID",
    "SPOTGPU_ALLOCATION_EPOCH",
    "SPOTGPU_BID_ID",
    "SPOTGPU_NOTICE_FILE",
    "SPOTGPU_ACK_FILE",
    "SPOTGPU_SAVED_FILE",
    "SPOTGPU_CHECKPOINT_KEY",
    "SPOTGPU_CHECKPOINT_URL",
}
"""A process job's whole environment, besides the variables of its own bid."""


def job(state: Path, alloc: int, tenant: int, command: list[str], **kw) -> JobRequest:
    return JobRequest(
        allocation_id=alloc,
        epoch=1,
        bid_id=alloc + 100,
        command=command,
        env=kw.pop("env", {}),
        gpu_indices=[alloc % 2],
        workdir=state / f"alloc-{alloc}",
        checkpoint_key=f"bid-{alloc + 100}",
        tenant_id=tenant,
        **kw,
    )


# ---------------------------------------------------------------- the process runner, as root


@AS_ROOT
@NEEDS_PYTHON
def test_a_hostile_process_job_sees_no_secret_and_cannot_escape_its_stop(sandbox, monkeypatch):
    monkeypatch.setenv("SPOTGPU_AGENT_TOKEN", "sgk_the-owners-key")  # the agent's own variable
    state, root = sandbox / "state", sandbox / "checkpoints"
    state.mkdir(mode=0o711)
    save_record(state, NodeRecord("http://market", 1, "sgn_the-node-token"))
    runner = ProcessRunner(users=JobUsers("auto"), checkpoint_root=root, interpreter=PYTHON)
    victim = runner.start(
        job(
            state,
            11,
            2,
            ["sh", "-c", "sleep 600"],
            env={"VICTIM_SECRET": "s3cr3t-of-tenant-2"},
            checkpoint_url="/ckpt",
        )
    )
    script = sandbox / "hostile.py"
    script.write_text(HOSTILE)
    script.chmod(0o644)
    targets = {
        "agent": os.getpid(),
        "node_json": str(state / "node.json"),
        "state_dir": str(state),
        "other_checkpoints": str(root / "tenant-2"),
        "secrets": ["s3cr3t-of-tenant-2", "sgk_", "sgn_"],
    }
    hostile_job = job(
        state,
        12,
        3,
        [PYTHON, str(script), json.dumps(targets)],
        env={"MINE": "1"},
        checkpoint_url="/var/run/docker.sock",  # a local path: becomes its tenant's directory
    )
    hostile = runner.start(hostile_job)
    try:
        report_file = hostile_job.workdir / "report.json"
        report = wait_for(lambda: read_job_file(report_file), 30, "the hostile job's report")
        log = (hostile_job.workdir / "job.log").read_text()
        assert report.get("uid"), log
        # its own user, its tenant's group, no other group
        assert (report["uid"], report["gid"]) == (UID_BASE + 12, UID_BASE + 3)
        assert set(report["groups"]) <= {UID_BASE + 3}
        # a clean environment: nothing of the agent's
        env = report["env"]
        assert set(env) == PROCESS_ENV | {"MINE"}, set(env) ^ (PROCESS_ENV | {"MINE"})
        assert not [v for v in env.values() if "sgk_" in v or "sgn_" in v]
        assert env["HOME"] == str(hostile_job.workdir)
        assert env["PREFECT_HOME"] == f"{hostile_job.workdir}/.prefect"
        assert env["SPOTGPU_CHECKPOINT_URL"] == str(root / "tenant-3")
        assert env["SPOTGPU_SAVED_FILE"] == f"{hostile_job.workdir}/saved.json"
        # nothing of the agent's or another tenant's to read
        assert report["attempts"] == {
            "agent environ": "PermissionError",
            "node.json": "PermissionError",
            "state dir": "PermissionError",
            "other tenant's checkpoints": "PermissionError",
            "own checkpoints": "got: 4",
        }
        assert report["secrets_seen_in"] == []
        assert running(report["escaped"])
        # the directories it was given
        work = hostile_job.workdir.stat()
        assert (work.st_uid, stat.S_IMODE(work.st_mode)) == (UID_BASE + 12, 0o700)
        mine = (root / "tenant-3").stat()
        assert (mine.st_uid, mine.st_gid) == (0, UID_BASE + 3)
        assert stat.S_IMODE(mine.st_mode) == 0o2770
        # the stop: its group and every process of its uid, the escaped one included
        runner.stop(hostile, grace=0.5)
        assert hostile.poll() is not None
        wait_for(lambda: not running(report["escaped"]), 5, "the escaped process killed")
        assert job_processes(hostile.user, job_marker(hostile_job.workdir)) == []
        assert hostile_job.workdir.stat().st_uid == 0  # retired: a later uid-mate reads nothing
        assert victim.poll() is None  # another tenant's job is not touched
    finally:
        runner.stop(hostile, grace=0)
        runner.stop(victim, grace=0)
    assert victim.poll() is not None


@AS_ROOT
def test_reconciliation_kills_a_stale_job_that_left_its_group(sandbox):
    state = sandbox / "state"
    state.mkdir(mode=0o711)
    runner = ProcessRunner(
        users=JobUsers("auto"), checkpoint_root=sandbox / "checkpoints", interpreter=PYTHON
    )
    request = job(state, 21, 4, ["sh", "-c", "setsid sleep 600 & sleep 600"])
    handle = runner.start(request)
    escaped = wait_for(
        lambda: [
            p
            for p in job_processes(handle.user, job_marker(request.workdir))
            if p != handle.pid and _is_leader(p)
        ],
        10,
        "the escaped process",
    )
    # a restarted agent knows only the allocation and the recorded pid
    fresh = ProcessRunner(
        users=JobUsers("auto"), checkpoint_root=sandbox / "checkpoints", interpreter=PYTHON
    )
    assert fresh.kill_stale(21, handle.pid, request.workdir)
    handle.process.wait(timeout=5)
    wait_for(lambda: not any(running(p) for p in escaped), 5, "every process of the job")


def _is_leader(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except ProcessLookupError:
        return False


def test_a_job_cannot_plant_links_for_the_agent_to_follow(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("do not overwrite")
    workdir = tmp_path / "alloc-1"
    workdir.mkdir()
    (workdir / "notice.json").symlink_to(secret)
    (workdir / "saved.json").symlink_to(secret)
    os.mkfifo(workdir / "notice.json.ack")  # reading it would block for ever
    write_job_file(workdir / "notice.json", '{"deadline": 1}')
    assert secret.read_text() == "do not overwrite"
    assert json.loads((workdir / "notice.json").read_text()) == {"deadline": 1}
    assert read_job_file(workdir / "saved.json") == {"invalid": True}
    assert read_job_file(workdir / "notice.json.ack") == {"invalid": True}
    (workdir / "big.json").write_text(json.dumps({"x": "y" * 100_000}))
    assert read_job_file(workdir / "big.json") == {"invalid": True}
    assert read_job_file(workdir / "absent.json") is None


def test_job_users_as_root_and_not():
    auto = JobUsers("auto", euid=0)
    assert auto.isolated
    first, second = (auto.for_job(allocation_id=a, tenant_id=9) for a in (5, 6))
    assert first.uid != second.uid and first.gid == second.gid == UID_BASE + 9
    assert first.dedicated and not first.root
    assert not JobUsers("root", euid=0).isolated
    nobody = JobUsers("nobody", euid=0)
    assert nobody.isolated and not nobody.for_job(allocation_id=5, tenant_id=9).dedicated
    assert not JobUsers("auto", euid=1000, egid=1000).isolated
    with pytest.raises(ValueError, match="only an agent running as root"):
        JobUsers("nobody", euid=1000, egid=1000)
    with pytest.raises(ValueError, match="no such user"):
        JobUsers("no-such-user-here", euid=0)


def test_the_docstring_examples_run():
    import doctest

    from prefect_spotgpu.agent import isolation, reports

    for module in (isolation, reports):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed


# ---------------------------------------------------------------- the container spec


HOSTILE_URLS = [
    "/var/run/docker.sock",
    "/var/run",
    "file:///",
    "file:///var/run/docker.sock",
    "FILE:///etc",
    "file://localhost/etc/shadow",
    "/",
    "../",
    "../../etc",
    "ckpt",
    "./ckpt/../../..",
    "~/.ssh",
]


def docker_runner(root: Path, **kw) -> DockerRunner:
    return DockerRunner(client=object(), users=JobUsers("auto", euid=0), checkpoint_root=root, **kw)


@pytest.mark.parametrize("url", HOSTILE_URLS)
def test_a_container_mounts_no_host_path_a_tenant_names(tmp_path, url):
    state = tmp_path / "state"
    root = tmp_path / "checkpoints"
    for hostile in (url, str(state), str(state / "node.json"), f"file://{state}"):
        request = job(state, 7, 5, ["train"], image="pytorch/pytorch:2.4", checkpoint_url=hostile)
        spec = docker_runner(root, pids_limit=512, memory="64g").container_spec(request)
        assert spec["volumes"] == {
            str(state / "alloc-7"): {"bind": "/spotgpu", "mode": "rw"},
            str(root / "tenant-5"): {"bind": "/spotgpu/checkpoints", "mode": "rw"},
        }
        assert spec["environment"]["SPOTGPU_CHECKPOINT_URL"] == "/spotgpu/checkpoints"
        assert spec["user"] == f"{UID_BASE + 7}:{UID_BASE + 5}"
        assert spec["security_opt"] == ["no-new-privileges"]
        assert spec["cap_drop"] == ["ALL"]
        assert spec["privileged"] is False
        assert (spec["pids_limit"], spec["mem_limit"]) == (512, "64g")
        assert "ulimits" not in spec  # above the host's they fail; the pids limit bounds forks


@pytest.mark.parametrize(
    "url", ["unix:///var/run/docker.sock", "http://169.254.169.254/", "docker://x", "npipe://x"]
)
def test_a_container_refuses_any_other_kind_of_checkpoint_url(tmp_path, url):
    request = job(tmp_path, 7, 5, ["train"], image="img", checkpoint_url=url)
    with pytest.raises(ValueError, match="refused"):
        docker_runner(tmp_path / "checkpoints").container_spec(request)


def test_a_container_passes_s3_through_and_keeps_its_own_variables_in_their_place(tmp_path):
    env = {
        "SPOTGPU_NOTICE_FILE": "/var/run/docker.sock",
        "SPOTGPU_ALLOCATION_ID": "999",
        "SPOTGPU_CHECKPOINT_URL": "/var/run/docker.sock",
        "WANDB_MODE": "offline",
    }
    s3 = job(tmp_path, 7, 5, ["x"], image="img", env=env, checkpoint_url="s3://bucket/runs")
    spec = docker_runner(tmp_path / "checkpoints").container_spec(s3)
    assert list(spec["volumes"]) == [str(tmp_path / "alloc-7")]
    environment = spec["environment"]
    assert environment["SPOTGPU_CHECKPOINT_URL"] == "s3://bucket/runs"
    assert environment["SPOTGPU_NOTICE_FILE"] == "/spotgpu/notice.json"
    assert environment["SPOTGPU_ALLOCATION_ID"] == "7" and environment["WANDB_MODE"] == "offline"
    assert environment["HOME"] == "/spotgpu"
    none = job(tmp_path, 7, 5, ["x"], image="img", env=env)
    spec = docker_runner(tmp_path / "checkpoints").container_spec(none)
    assert list(spec["volumes"]) == [str(tmp_path / "alloc-7")]
    assert "SPOTGPU_CHECKPOINT_URL" not in spec["environment"]
    assert "mem_limit" not in spec and spec["pids_limit"] == 4096


def test_a_container_never_runs_as_root(tmp_path):
    request = job(tmp_path, 7, 5, ["x"], image="img")
    as_root = DockerRunner(client=object(), users=JobUsers("root", euid=0))
    with pytest.raises(ValueError, match="never runs as root"):
        as_root.container_spec(request)
    local = job(tmp_path, 7, 5, ["x"], image="img", checkpoint_url="/ckpt")
    with pytest.raises(ValueError, match="--checkpoint-root"):
        DockerRunner(client=object(), users=JobUsers("auto", euid=0)).container_spec(local)


# ---------------------------------------------------------------- the checkpointer's reports


def test_every_durable_save_is_recorded_and_a_failed_final_save_says_storage(tmp_path):
    notice, ack, saved = tmp_path / "notice.json", tmp_path / "notice.ack", tmp_path / "saved"
    storage = LocalStorage(tmp_path / "ckpt")
    clock = [0.0]
    ckpt = Checkpointer(
        storage,
        "run-1",
        every=10,
        notice_file=notice,
        ack_file=ack,
        saved_file=saved,
        handle_sigusr1=False,
        clock=lambda: clock[0],
    )
    assert ckpt.maybe_save({"w": 0}, 0) is None and not saved.exists()
    for step in (1, 2):
        clock[0] += 11
        before = time.time()
        assert ckpt.maybe_save({"w": step}, step) is None  # staged; written in the background
        assert ckpt.wait().step == step  # durable, and reported
        record = json.loads(saved.read_text())
        assert record["step"] == step and record["final"] is False
        assert before <= record["saved_at"] <= time.time()
    # the storage breaks for real: its key's directory becomes a file
    shutil.rmtree(tmp_path / "ckpt" / "run-1")
    (tmp_path / "ckpt" / "run-1").write_text("not a directory")
    notice.write_text(json.dumps({"deadline": time.time() + 300}))
    with pytest.raises(FileExistsError):
        ckpt.maybe_save({"w": 3}, 3)
    answer = json.loads(ack.read_text())
    assert answer["failed"] is True and answer["cause"] == "storage"
    assert answer["error"].startswith("FileExistsError: ") and len(answer["error"]) <= 200
    assert json.loads(saved.read_text())["step"] == 2  # the last durable save stays recorded
    assert ckpt.notice_received and ckpt.maybe_save({"w": 4}, 4) is None


def test_a_final_save_to_unreachable_s3_says_storage_and_a_job_bug_says_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    storage = S3Storage(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="y",
        max_attempts=1,
    )
    notice, ack = tmp_path / "notice.json", tmp_path / "notice.ack"
    notice.write_text(json.dumps({"deadline": time.time() + 300}))
    ckpt = Checkpointer(
        storage, "run-1", notice_file=notice, ack_file=ack, saved_file=tmp_path / "saved"
    )
    with pytest.raises(Exception, match=r"127\.0\.0\.1"):
        ckpt.maybe_save({"w": 1}, 1)
    answer = json.loads(ack.read_text())
    assert (answer["failed"], answer["cause"]) == (True, "storage")
    assert "EndpointConnectionError" in answer["error"], answer
    assert not (tmp_path / "saved").exists()
    # the job's own error (its state cannot be built) is not the storage's: no acknowledgement
    ack.unlink()
    ckpt = Checkpointer(LocalStorage(tmp_path / "ckpt"), "run-2", notice_file=notice, ack_file=ack)

    def broken_state():
        raise RuntimeError("a bug in the flow")

    with pytest.raises(RuntimeError, match="a bug"):
        ckpt.maybe_save(broken_state, 1)
    assert not ack.exists()


def test_stopping_a_job_never_kills_another_agents_job_of_the_same_allocation_id(sandbox):
    """Every market counts allocations from 1: two agents on one host (two markets, or the
    demo beside a test) may both run an allocation 1 under one shared uid. Stopping one
    (and reconciling it) must leave the other alone."""
    runner = ProcessRunner(users=JobUsers(str(os.getuid())))  # jobs share the agent's uid
    jobs = []
    for name in ("agent-a", "agent-b"):
        state = sandbox / name
        state.mkdir()
        jobs.append(runner.start(job(state, 1, 3, ["sleep", "600"])))
    mine, theirs = jobs
    try:
        mine_now = job_processes(mine.user, job_marker(mine.request.workdir))
        assert set(mine_now) == {mine.pid, mine.job_pid}  # its keeper and the job
        runner.stop(mine, grace=0.2)
        assert mine.poll() is not None
        assert not runner.kill_stale(1, theirs.pid, mine.request.workdir)  # a stale pid of mine
        time.sleep(0.2)
        assert theirs.poll() is None, "another agent's allocation 1 was killed"
    finally:
        runner.stop(theirs, grace=0)


@AS_ROOT
def test_a_zombie_does_not_hold_its_uid():
    """A dead job's zombie (never reaped: a PID 1 that does not wait, or a parent that has
    not yet) must not make the next allocation with that uid fail as 'in use'."""
    uid = UID_BASE + 99_000
    zombie = subprocess.Popen(["/bin/true"], user=uid, group=uid, extra_groups=[])
    wait_for(
        lambda: Path(f"/proc/{zombie.pid}/stat").read_text().split(")")[-1].split()[0] == "Z",
        10,
        "the zombie",
    )
    try:
        assert uid not in uids_in_use()
        live = subprocess.Popen(["sleep", "30"], user=uid, group=uid, extra_groups=[])
        try:
            assert uid in uids_in_use()
        finally:
            live.kill()
            live.wait()
    finally:
        zombie.wait()


# ---------------------------------------------------------------- the agent's credentials


def test_the_cursor_belongs_to_its_node(tmp_path):
    save_record(tmp_path, NodeRecord("http://a", 1, "sgn_1"))
    assert stat.S_IMODE((tmp_path / "node.json").stat().st_mode) == 0o600
    save_cursor(tmp_path, "http://a", 1, 41)
    assert load_cursor(tmp_path, "http://a", 1) == 41
    assert load_cursor(tmp_path, "http://a", 2) == 0  # another node's cursor
    assert load_cursor(tmp_path, "http://b", 1) == 0  # another market's
    save_record(tmp_path, NodeRecord("http://a", 1, "sgn_1-rotated"))  # same node: kept
    assert load_cursor(tmp_path, "http://a", 1) == 41
    save_record(tmp_path, NodeRecord("http://b", 7, "sgn_7"))  # another node: dropped
    assert not (tmp_path / "cursor").exists()
    (tmp_path / "cursor").write_text("41")  # an older agent's bare number: whose?
    assert load_cursor(tmp_path, "http://b", 7) == 0


def cli_agent(service, key, state: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(state.parent / f"agent-{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start"),
            *("--market", service.base_url, "--gpus", "A100-80G:2", "--name", name),
            *("--region", "eu-west", "--reserve-price", "0.5", "--heartbeat-seconds", "1"),
            *("--state-dir", str(state), "--grace-seconds", "1", *extra),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "SPOTGPU_AGENT_TOKEN": key},
    )
    proc.logfile = log
    return proc


@AS_ROOT
@NEEDS_PYTHON
@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_an_agent_started_by_the_cli_keeps_its_key_from_argv_and_from_its_jobs(service, sandbox):
    owner, buyer = service.tenant(), service.tenant()
    service.grant_provider(owner)
    owner_key = owner.headers["Authorization"].removeprefix("Bearer ")
    state = sandbox / "state"
    # the test's own interpreter may lie under root's home (0700), which the agent refuses
    # (test_agent_preflight.py): its job users get one they can run
    agent = cli_agent(service, owner_key, state, "iso-node", "--job-python", PYTHON)
    try:
        nodes = wait_for(lambda: owner.get("/nodes").json(), 30, "the node registered")
        cmdline = Path(f"/proc/{agent.pid}/cmdline").read_bytes()
        assert owner_key.encode() not in cmdline and b"sgk_" not in cmdline
        # the agent writes node.json once the market has answered its registration
        record = wait_for(lambda: read_job_file(state / "node.json"), 10, "node.json")
        assert record["token"].startswith("sgn_") and record["node_id"] == nodes[0]["id"]
        assert stat.S_IMODE((state / "node.json").stat().st_mode) == 0o600
        assert record["token"].encode() not in Path(f"/proc/{agent.pid}/cmdline").read_bytes()
        script = sandbox / "hostile.py"
        script.write_text(HOSTILE)
        script.chmod(0o644)
        targets = {
            "agent": agent.pid,  # the job's parent
            "node_json": str(state / "node.json"),
            "state_dir": str(state),
            "other_checkpoints": str(state / "checkpoints" / "tenant-999"),
            "secrets": [owner_key, record["token"], "sgk_", "sgn_"],
        }
        bid = buyer.post(
            "/bids",
            json={
                "gpu_model": "A100-80G",
                "gpu_count": 1,
                "max_price": 1.0,
                "job": {
                    "command": [PYTHON, str(script), json.dumps(targets)],
                    "checkpoint_url": "file:///var/run/docker.sock",
                },
            },
        ).json()
        (alloc,) = wait_for(
            lambda: buyer.get(f"/bids/{bid['id']}/allocations").json(), 20, "allocated"
        )
        workdir = state / f"alloc-{alloc['id']}"
        report = wait_for(lambda: read_job_file(workdir / "report.json"), 30, "the report")
        assert not [v for v in report["env"].values() if "sgk_" in v or "sgn_" in v]
        assert report["uid"] == UID_BASE + alloc["id"]
        attempts = report["attempts"]
        assert attempts["agent environ"] == "PermissionError"
        assert attempts["node.json"] == "PermissionError"
        assert attempts["state dir"] == "PermissionError"
        assert attempts["own checkpoints"] == "got: 4"
        tenant = buyer.get(f"/bids/{bid['id']}").json()["tenant_id"]
        assert report["env"]["SPOTGPU_CHECKPOINT_URL"] == str(
            state / "checkpoints" / f"tenant-{tenant}"
        )
        assert report["secrets_seen_in"] == []
        buyer.post(f"/bids/{bid['id']}/cancel")  # the agent stops the job: all of it
        wait_for(lambda: not running(report["escaped"]), 20, "the escaped process killed")
    except BaseException:
        print(Path(agent.logfile.name).read_text())  # what the agent saw, in pytest's report
        raise
    finally:
        stop_agent(agent)
        for pid_file in state.glob("alloc-*/pid"):
            ProcessRunner(users=JobUsers("auto")).kill_stale(
                int(pid_file.parent.name.removeprefix("alloc-")),
                int(pid_file.read_text()),
                pid_file.parent,
            )


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_the_agents_key_comes_from_a_file_or_the_environment_never_argv(service, tmp_path):
    owner = service.tenant()
    service.grant_provider(owner)
    owner_key = owner.headers["Authorization"].removeprefix("Bearer ")
    refused = subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start", "--token", owner_key],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--token" in refused.stderr  # no such option
    key_file = tmp_path / "owner.key"
    key_file.write_text(owner_key + "\n")
    key_file.chmod(0o600)
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "SPOTGPU_AGENT_TOKEN"}
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start"),
            *("--market", service.base_url, "--gpus", "A100-80G:1", "--name", "from-file"),
            *("--region", "eu-west", "--reserve-price", "0.5", "--state-dir", str(state)),
            *("--job-user", str(os.getuid()), "--token-file", str(key_file)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: owner.get("/nodes").json(), 30, "the node registered")
        assert owner_key.encode() not in Path(f"/proc/{agent.pid}/cmdline").read_bytes()
        record = wait_for(lambda: read_job_file(state / "node.json"), 10, "node.json")
        assert record["token"].startswith("sgn_")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)


def test_the_job_uid_base_comes_from_the_agents_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv("SPOTGPU_JOB_UID_BASE", "500000")
    assert JobUsers("auto", euid=0).for_job(allocation_id=7, tenant_id=3).uid == 500_007
    assert JobUsers("auto", uid_base=200_000, euid=0).uid_base == 200_000  # the option wins
    monkeypatch.setenv("SPOTGPU_JOB_UID_BASE", "lots")
    with pytest.raises(ValueError, match="SPOTGPU_JOB_UID_BASE must be a whole number"):
        JobUsers("auto", euid=0)
    monkeypatch.setenv("SPOTGPU_JOB_UID_BASE", "10")
    with pytest.raises(ValueError, match="job uid base must be in"):
        JobUsers("auto", euid=0)
