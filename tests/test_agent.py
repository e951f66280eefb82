"""The node agent: discovery and runner units, and two real agents against a real service."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ADMIN_KEY, one_database
from conftest import wait_for as wait
from helpers import assignment, stop_agent
from prefect_spotgpu.agent.discovery import DiscoveryError, discover_nvml, parse_declared
from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.runners import (
    DockerRunner,
    JobFault,
    JobRequest,
    ProcessRunner,
    get_runner,
)
from prefect_spotgpu.protocol import REPORT_DETAIL_CHARS

HERE = Path(__file__).parent


# ---------------------------------------------------------------- discovery (NVML seam)


class FakeNvml:
    """The narrow seam: pynvml's functions for a host without NVIDIA GPUs."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, names, fail=False):
        self.names, self.fail = names, fail

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return b"560.35.03"

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h]

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=143771 * 1024 * 1024, used=0)

    def nvmlDeviceGetMigMode(self, h):
        return (0, 0)

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return 0

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0x4

    NVML_TEMPERATURE_GPU = 0

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40 + h, memory=10)

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_000  # milliwatts

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 61


def test_heartbeat_telemetry_reads_each_gpu():
    from prefect_spotgpu.agent.discovery import telemetry_nvml

    assert telemetry_nvml(FakeNvml(["NVIDIA H200", "NVIDIA H200"])) == [
        {"index": i, "utilization": 40 + i, "memory_used_mb": 0, "power_w": 350.0,
         "temperature_c": 61}
        for i in range(2)
    ]  # fmt: skip


def test_nvml_names_are_normalised_to_market_models():
    gpus = discover_nvml(FakeNvml(["NVIDIA H200", "NVIDIA H200"]))
    assert [g.model for g in gpus] == ["H200", "H200"]
    assert gpus[0].driver == "560.35.03" and gpus[0].memory_mb == 143771
    assert gpus[1].uuid == "GPU-00000001" and gpus[0].throttle_reasons == ["sw_power_cap"]


def test_discovery_fails_clearly():
    with pytest.raises(DiscoveryError, match="--gpus MODEL:COUNT"):
        discover_nvml(FakeNvml([], fail=True))
    with pytest.raises(DiscoveryError, match="not a known GPU model"):
        discover_nvml(FakeNvml(["NVIDIA A100-SXM4-40GB"]))
    with pytest.raises(DiscoveryError, match="one GPU model"):
        discover_nvml(FakeNvml(["NVIDIA H200", "NVIDIA GeForce RTX 4090"]))


def test_declared_inventories():
    gpus = parse_declared("a100 80g:2")
    assert [(g.index, g.model) for g in gpus] == [(0, "A100-80G"), (1, "A100-80G")]
    for bad in ("A100-80G", "A100-80G:x", "A100-80G:0", "B200:1", ":2"):
        with pytest.raises(DiscoveryError):
            parse_declared(bad)


# ---------------------------------------------------------------- runners


def request(tmp_path, command, **kw):
    return JobRequest(
        allocation_id=7,
        epoch=2,
        bid_id=3,
        command=command,
        env={"A": "1"},
        gpu_indices=[1, 3],
        workdir=tmp_path / "alloc-7",
        checkpoint_url=str(tmp_path / "ckpt"),
        checkpoint_key="bid-3",
        tenant_id=5,
        **kw,
    )


AS_ME = JobUsers(str(os.getuid()))  # jobs as the test's user: they run its interpreter


CHILD = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open("child.pid.tmp", "w").write(str(child.pid))
os.replace("child.pid.tmp", "child.pid")  # (whole: the test reads it once it is there)
signal.signal(signal.SIGUSR1, lambda *a: open("got-usr1", "w").write("1"))
print(os.environ["CUDA_VISIBLE_DEVICES"], os.environ["SPOTGPU_NOTICE_FILE"], flush=True)
while True:
    time.sleep(0.01)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_process_runner_signals_the_main_process_only_and_stops_the_group(tmp_path):
    runner = ProcessRunner(users=AS_ME)  # (isolated jobs: test_agent_isolation.py)
    req = request(tmp_path, [sys.executable, "-c", CHILD])
    handle = runner.start(req)
    deadline = time.monotonic() + 10
    while not (req.workdir / "child.pid").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child = int((req.workdir / "child.pid").read_text())
    runner.notice(handle, deadline=time.time() + 300)
    while not (req.workdir / "got-usr1").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert running(child)  # the child (no handler) survived: SIGUSR1 went to the main only
    assert json.loads(req.notice_file.read_text())["allocation_id"] == 7
    runner.stop(handle, grace=0.5)
    assert handle.poll() is not None
    wait(lambda: not running(child), 5, "the group going down with it")
    out = (req.workdir / "job.log").read_text()
    assert out.startswith("1,3 ") and "notice.json" in out


def test_the_process_runner_sigkills_at_no_grace_and_refuses_an_image_bid(tmp_path):
    """At a notice's end the job gets no SIGTERM (its engine would write Crashed); a bid that
    asks for an image is never run on the host with its image ignored."""
    runner = ProcessRunner(users=AS_ME)
    told = "import signal,time,pathlib\nsignal.signal(signal.SIGTERM, lambda *a: pathlib.Path('term').touch())\npathlib.Path('up').touch()\ntime.sleep(60)\n"  # noqa: E501
    req = request(tmp_path, [sys.executable, "-c", told])
    handle = runner.start(req)
    deadline = time.monotonic() + 10
    while not (req.workdir / "up").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    runner.stop(handle, grace=0)
    assert handle.poll() == -signal.SIGKILL
    assert not (req.workdir / "term").exists()
    imaged = request(tmp_path / "2", [sys.executable, "-c", "pass"], image="pytorch/pytorch:2.4")
    with pytest.raises(JobFault, match="only a Docker node"):
        runner.start(imaged)


def test_the_docker_runner_builds_the_container_spec(tmp_path):
    runner = DockerRunner(client=object(), checkpoint_root=tmp_path / "roots", gpu_devices=True)
    spec = runner.container_spec(
        request(tmp_path, ["python", "-m", "prefect.engine"], image="pytorch/pytorch:2.4")
    )
    assert spec["image"] == "pytorch/pytorch:2.4" and spec["init"] is False
    assert spec["command"] == ["python", "-m", "prefect.engine"]
    device = spec["device_requests"][0]
    assert device["DeviceIDs"] == ["1", "3"] and device["Capabilities"] == [["gpu"]]
    env = spec["environment"]
    assert env["SPOTGPU_NOTICE_FILE"] == "/spotgpu/notice.json"
    assert env["SPOTGPU_SAVED_FILE"] == "/spotgpu/saved.json"
    assert env["SPOTGPU_CHECKPOINT_URL"] == "/spotgpu/checkpoints"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert spec["volumes"] == {
        str(tmp_path / "alloc-7"): {"bind": "/spotgpu", "mode": "rw"},
        str(tmp_path / "roots" / "tenant-5"): {"bind": "/spotgpu/checkpoints", "mode": "rw"},
    }  # (hostile checkpoint URLs: test_agent_isolation.py)
    assert spec["labels"]["io.spotgpu.allocation-id"] == "7"
    with pytest.raises(ValueError, match="image"):
        runner.container_spec(request(tmp_path, ["x"]))
    with pytest.raises(ValueError, match="valid runners: docker, process"):
        get_runner("k8s")


# ---------------------------------------------------------------- two real agents


def start_agent(server, key, name, tmp_path, *options: str, job_user: str | None = None):
    """A real agent (``options``: more of its command line); its jobs run as the test's user
    unless ``job_user`` says (they use the test's interpreter and write to ``tmp_path``;
    isolated jobs are test_agent_isolation.py's and the docker tests')."""
    log = open(tmp_path / f"agent-{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect_spotgpu.cli",
            "agent",
            "start",
            "--market",
            server.url,
            "--job-user",
            job_user or str(os.getuid()),
            "--gpus",
            "A100-80G:2",
            "--name",
            name,
            "--region",
            "eu-west",
            "--reserve-price",
            "0.9",
            "--state-dir",
            str(tmp_path / f"state-{name}"),
            "--heartbeat-seconds",
            "1",
            "--grace-seconds",
            "2",
            *options,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "SPOTGPU_AGENT_TOKEN": key},
    )
    proc.logfile = log
    return proc


def a_market(tmp_path, heartbeat_timeout: float | None = None):
    """The market service as its own process, an owner allowed to provide GPUs and a buyer:
    ``(server, admin client, owner's key, buyer's key)``."""
    from test_service_processes import Server

    if heartbeat_timeout is not None:
        os.environ["SPOTGPU_HEARTBEAT_TIMEOUT_SECONDS"] = str(heartbeat_timeout)
    try:
        server = Server(f"sqlite:///{tmp_path / 'm.db'}", tmp_path)
    finally:
        os.environ.pop("SPOTGPU_HEARTBEAT_TIMEOUT_SECONDS", None)
    admin = server.client(ADMIN_KEY)
    owner = admin.post("/tenants", json={"name": "owner"}).json()
    granted = admin.put(f"/tenants/{owner['id']}/provider", json={"provider": True})
    assert granted.status_code == 200, granted.text
    buyer_key = admin.post("/tenants", json={"name": "buyer"}).json()["api_key"]
    return server, admin, owner["api_key"], buyer_key


def stop_agents(agents: dict, server, tmp_path) -> None:
    """Stop the agents (SIGTERM, then SIGKILL), the market, and any job left behind."""
    for proc in agents.values():
        stop_agent(proc, timeout=10)
    server.stop()
    for pid_file in tmp_path.glob("state-*/alloc-*/pid"):  # no job outlives the test
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def read_log(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_step(events: list[dict], alloc: int) -> int:
    """The last step ``agent_job.py`` logged on allocation ``alloc``: the one its final save
    holds, since the job saves on the step it sees the notice and then waits to be stopped."""
    return max(e["step"] for e in events if e["alloc"] == alloc and "step" in e)


def post_job(buyer, job: dict) -> dict:
    """A bid for 2 x A100-80G in eu-west, at most 1.5, that runs ``job``: the new bid."""
    response = buyer.post(
        "/bids",
        json={
            "gpu_model": "A100-80G",
            "gpu_count": 2,
            "max_price": 1.5,
            "region": "eu-west",
            "job": job,
        },
    )
    assert response.status_code == 201, response.text
    return response.json()


def job_bid(buyer, steps: int, log, ckpt_dir, **env: str) -> dict:
    """A bid running ``agent_job.py STEPS``, logging to ``log``, checkpoints in ``ckpt_dir``
    (``env``: more of the job's environment, e.g. ``SLOW_FINAL_SAVE``)."""
    return post_job(
        buyer,
        {
            "command": [sys.executable, str(HERE / "agent_job.py"), str(steps)],
            "env": {"JOB_LOG": str(log), **env},
            "checkpoint_url": str(ckpt_dir),
        },
    )


@pytest.mark.slow
def test_two_agents_a_reclaim_and_a_resume_from_the_checkpoint(tmp_path):
    server, admin, owner_key, buyer_key = a_market(tmp_path, heartbeat_timeout=3)
    agents = {n: start_agent(server, owner_key, n, tmp_path) for n in ("a", "b")}
    try:
        nodes = wait(lambda: len(r := admin.get("/nodes").json()) == 2 and r, 30, "agents")
        by_id = {n["id"]: n["name"] for n in nodes}
        assert all(n["declared"] and n["state"] == "live" for n in nodes)
        job_log = tmp_path / "job.jsonl"
        buyer = server.client(buyer_key)
        bid = job_bid(buyer, 120, job_log, tmp_path / "ckpt")
        first = wait(lambda: [e for e in read_log(job_log) if "start" in e], 30, "job start")[0]
        assert first["start"] == 0 and first["gpus"] == "0,1"
        assert first["threads"] == str(len(os.sched_getaffinity(0)))  # 2 of 2 GPUs: every core
        wait(lambda: sum("step" in e for e in read_log(job_log)) >= 20, 30, "progress")
        allocs = buyer.get(f"/bids/{bid['id']}/allocations").json()
        victim_node = allocs[0]["node_id"]
        other_node = next(i for i in by_id if i != victim_node)
        owner = server.client(owner_key)
        owner.patch(f"/nodes/{victim_node}", json={"state": "reclaimed"})
        events = []

        def noticed():
            events.extend(
                buyer.get(
                    f"/bids/{bid['id']}/events",
                    params={"after": max([0] + [e["id"] for e in events]), "timeout": 1},
                ).json()["events"]
            )
            return [e for e in events if e["kind"] == "noticed"]

        notice = wait(noticed, 15, "notice")[0]
        signal_at = wait(
            lambda: [e["signal"] for e in read_log(job_log) if "signal" in e],
            10,
            "SIGUSR1 in the job",
        )[0]
        preempted = wait(
            lambda: noticed() and [e for e in events if e["kind"] == "preempted"], 30, "preempted"
        )[0]
        second = wait(
            lambda: [e for e in read_log(job_log) if "start" in e and e["alloc"] != first["alloc"]],
            30,
            "the job on the other node",
        )[0]
        # resumed from the final save at the first node's last step: not from 0, no step lost
        assert second["start"] == last_step(read_log(job_log), first["alloc"]) + 1 >= 20
        done = wait(lambda: [e for e in read_log(job_log) if "done" in e], 60, "job done")[0]
        assert done["done"] == sum(range(120))  # the same result as an uninterrupted run
        assert done["alloc"] == second["alloc"]
        wait(
            lambda: buyer.get(f"/bids/{bid['id']}").json()["status"] == "finished",
            15,
            "bid finished",
        )
        statuses = {
            a["node_id"]: a["status"] for a in buyer.get(f"/bids/{bid['id']}/allocations").json()
        }
        assert statuses == {victim_node: "preempted", other_node: "finished"}
        notice_to_signal = signal_at - notice["payload"]["at"]
        stop_to_running = second["t"] - preempted["payload"]["at"]
        # a lost agent: a long job runs on the surviving node; SIGKILL its agent
        long_bid = job_bid(buyer, 100000, tmp_path / "long.jsonl", tmp_path / "ckpt")
        orphan_alloc = wait(
            lambda: [e["alloc"] for e in read_log(tmp_path / "long.jsonl") if "start" in e],
            30,
            "the long job",
        )[0]
        orphan_pid = int(
            (tmp_path / f"state-{by_id[other_node]}" / f"alloc-{orphan_alloc}" / "pid").read_text()
        )
        survivor = agents[by_id[other_node]]
        killed_at = time.time()
        survivor.send_signal(signal.SIGKILL)
        survivor.wait(timeout=10)
        wait(lambda: not running(orphan_pid), 5, "the agent's guard killing its job")
        job_gone = time.time() - killed_at
        wait(lambda: admin.get(f"/nodes/{other_node}").json()["state"] == "lost", 30, "lost node")
        detection = time.time() - killed_at
        # the job was gone before the market could place its run elsewhere
        assert job_gone < detection
        assert buyer.get(f"/allocations/{orphan_alloc}").json()["status"] == "preempted"
        agents["again"] = start_agent(server, owner_key, by_id[other_node], tmp_path)
        wait(
            lambda: admin.get(f"/nodes/{other_node}").json()["state"] == "live",
            30,
            "the node live again",
        )
        buyer.post(f"/bids/{long_bid['id']}/cancel")
        report = {
            "notice_to_signal_s": round(notice_to_signal, 3),
            "stop_to_running_on_reserved_node_s": round(stop_to_running, 3),
            "lost_agent_detection_s": round(detection, 3),
            "job_gone_after_agent_killed_s": round(job_gone, 3),
            "heartbeat_timeout_s": 3,
        }
        print(json.dumps(report))
        assert notice_to_signal <= 1.0, report
        assert stop_to_running <= 5.0, report
        assert detection <= 3 + 5, report
    finally:
        stop_agents(agents, server, tmp_path)


def make_agent(service, owner, tmp_path, gpus=1, runner=None):
    from prefect_spotgpu.agent.agent import Agent

    node, _ = service.node(owner, gpus=gpus, reserve=0.5)
    agent = Agent(
        market=service.base_url,
        token=node["token"],
        runner=runner or ProcessRunner(),
        gpus=parse_declared(f"A100-80G:{gpus}"),
        declared=True,
        state_dir=tmp_path / "agent",
        name=node["name"],
        heartbeat_seconds=1,
        grace_seconds=1,
    )
    return node, agent


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_notice_of_a_job_never_started_here_is_answered_at_once(service, tmp_path):
    """An allocation placed on the node and noticed before the agent started its job (its
    node reclaimed the moment it was placed: both events in one batch, its assignment already
    noticed): the agent never starts it and answers the notice now, so the bid moves on at
    once, not at the notice's deadline five minutes later."""
    owner, buyer = service.tenant(), service.tenant(credit=50.0)
    node, agent = make_agent(service, owner, tmp_path)
    agent.register()
    order = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0,
             "job": {"command": ["sleep", "600"]}}  # fmt: skip
    placed = buyer.post("/bids", json=order)
    assert placed.status_code == 201, placed.text
    allocations = f"/bids/{placed.json()['id']}/allocations"
    (alloc,) = wait(lambda: buyer.get(allocations).json(), 20, "the allocation")
    service.client(owner.headers["Authorization"].split()[1]).patch(
        f"/nodes/{node['id']}", json={"state": "reclaimed"}
    )
    noticed = wait(
        lambda: (a := buyer.get(allocations).json()[0])["status"] == "noticed" and a, 20, "notice"
    )
    agent.notice(alloc["id"], time.time() + 300, noticed["epoch"])  # no job here: nothing yet
    workdir, sent = tmp_path / "agent" / f"alloc-{alloc['id']}", []
    workdir.mkdir(parents=True)  # as if a job of it ran here, under an earlier agent:
    answering = agent.reporter.report_later
    agent.reporter.report_later = lambda *report: sent.append(report)
    agent.start(alloc["id"])  # reconcile answers that one, by its acknowledgement
    assert sent == []
    workdir.rmdir()
    agent.reporter.report_later = answering
    agent.start(alloc["id"])  # the allocated event, read after it: its assignment is noticed
    ended = wait(
        lambda: (a := buyer.get(allocations).json()[0])["status"] != "noticed" and a, 10, "answer"
    )
    assert ended["status"] == "preempted" and agent.jobs == {}
    assert agent.gpu_book.free_count() == 1


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_job_that_cannot_start_gives_its_gpus_back(service, tmp_path):
    owner = service.tenant()
    _, agent = make_agent(service, owner, tmp_path, gpus=2)
    agent.register()
    agent.start(999, assignment(999, gpu_count=2, job={"command": ["/nonexistent/command"]}))
    assert agent.gpu_book.free_count() == 2 and agent.gpu_book.held() == {} and agent.jobs == {}


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_job_that_finishes_during_its_notice_is_reported_finished(service, tmp_path):
    import threading

    owner, buyer = service.tenant(), service.tenant()
    node, agent = make_agent(service, owner, tmp_path)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        b = buyer.post(
            "/bids",
            json={
                "gpu_model": "A100-80G",
                "gpu_count": 1,
                "max_price": 1.0,
                "job": {"command": ["sh", "-c", "trap '' USR1; sleep 1.5; exit 0"]},
            },
        ).json()
        wait(lambda: agent.jobs, 10, "the job running")
        owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
        wait(
            lambda: buyer.get(f"/bids/{b['id']}").json()["status"] == "finished",
            20,
            "the bid finished",
        )
        allocs = buyer.get(f"/bids/{b['id']}/allocations").json()
        assert [a["status"] for a in allocs] == ["finished"]
        assert not [
            e for e in buyer.get("/ledger").json()["entries"] if e["kind"] == "compensation"
        ]
    finally:
        agent.shutdown()
        thread.join(timeout=10)


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_job_that_exits_non_zero_reports_its_exit_code_and_last_line(service, tmp_path):
    import threading

    owner, buyer = service.tenant(), service.tenant()
    _, agent = make_agent(service, owner, tmp_path, runner=ProcessRunner(users=AS_ME))
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        script = "echo working; echo \"No module named 'prefect_spotgpu'\" >&2; echo; exit 3"
        bid = buyer.post(
            "/bids",
            json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0,
                  "job": {"command": ["sh", "-c", script]}},
        ).json()  # fmt: skip

        def ended():
            page = buyer.get(f"/bids/{bid['id']}/events", params={"after": 0, "timeout": 1})
            return [e for e in page.json()["events"] if e["kind"] == "preempted"]

        (event,) = wait(ended, 20, "the failed job's allocation ended")
        assert event["payload"]["reason"] == "job failed on the node"
        assert event["payload"]["detail"] == (
            "exit code 3, last output: No module named 'prefect_spotgpu'"
        )
    finally:
        agent.shutdown()
        thread.join(timeout=10)


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_an_allocation_waits_for_gpus_a_stopping_job_still_holds(service, tmp_path):
    owner = service.tenant()
    node, agent = make_agent(service, owner, tmp_path, gpus=1)
    agent.register()
    buyer = service.tenant()
    bid = buyer.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, "region": "eu-west",
              "job": {"command": ["sleep", "60"]}},
    ).json()  # fmt: skip
    (alloc,) = wait(lambda: [a for a in agent.assignments().values()], 20, "the allocation")
    stopping = -1  # the GPU is still held by a job being stopped
    assert agent.gpu_book.take(stopping, 1, now=0).indices == (0,)
    agent.start(alloc.id)
    assert agent.jobs == {} and agent.gpu_book.waiting() == [alloc.id]
    assert buyer.get(f"/allocations/{alloc.id}").json()["status"] == "running"  # not failed
    agent.gpu_book.give_back(stopping)  # the stop is done: the loop's next retry starts it
    agent.start(alloc.id)
    try:
        assert alloc.id in agent.jobs and agent.gpu_book.waiting() == []
        assert agent.gpu_book.held() == {alloc.id: (0,)}
    finally:
        buyer.post(f"/bids/{bid['id']}/cancel")
        agent.stop(alloc.id, reason="test over")
    assert node["id"] == alloc.node_id


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_checkpoints_are_reported_and_a_failed_final_save_names_its_cause(service, tmp_path):
    import threading

    owner, buyer = service.tenant(), service.tenant()
    node, agent = make_agent(service, owner, tmp_path, gpus=2, runner=ProcessRunner(users=AS_ME))
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        job_log = tmp_path / "job.jsonl"
        storage_fails = buyer.post(
            "/bids",
            json={
                "gpu_model": "A100-80G",
                "gpu_count": 1,
                "max_price": 1.0,
                "job": {
                    "command": [sys.executable, str(HERE / "agent_job.py"), "100000"],
                    "env": {"JOB_LOG": str(job_log), "BREAK_STORAGE_ON_NOTICE": "1"},
                    "checkpoint_url": str(tmp_path / "ckpt"),
                },
            },
        ).json()
        job_crashes = buyer.post(
            "/bids",
            json={
                "gpu_model": "A100-80G",
                "gpu_count": 1,
                "max_price": 1.0,
                "job": {
                    "command": ["sh", "-c", "trap 'exit 3' USR1; while :; do sleep 0.05; done"]
                },
            },
        ).json()

        def allocation(bid):
            allocs = buyer.get(f"/bids/{bid['id']}/allocations").json()
            return allocs[0] if allocs else None

        # periodic saves (every 0.5 s) reach the market as checkpoints
        reported = wait(
            lambda: (a := allocation(storage_fails)) and a["last_checkpoint_at"] and a,
            30,
            "a periodic checkpoint reported",
        )
        assert reported["status"] == "running" and reported["last_checkpoint_at"] <= time.time()
        owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
        ended = {
            name: wait(
                lambda bid=bid: (a := allocation(bid)) and a["status"] == "preempted" and a,
                30,
                f"the {name} allocation ended",
            )
            for name, bid in (("storage", storage_fails), ("job", job_crashes))
        }
        assert ended["storage"]["final_save"] == ended["job"]["final_save"] == "failed"
        # the market compensates the storage's failure, not the job's crash
        entries = buyer.get("/ledger").json()["entries"]
        compensations = [e for e in entries if e["kind"] == "compensation"]
        assert [e["allocation_id"] for e in compensations] == [ended["storage"]["id"]], entries
        assert "storage" in compensations[0]["reason"]
    finally:
        agent.shutdown()
        thread.join(timeout=10)
        for handle in list(agent.jobs.values()):
            agent.runner.stop(handle, grace=0)


def owner_agent(service, owner, state_dir, name="node-x"):
    from prefect_spotgpu.agent.agent import Agent

    return Agent(
        market=service.base_url,
        token=owner.headers["Authorization"].removeprefix("Bearer "),
        runner=ProcessRunner(users=AS_ME),
        gpus=parse_declared("A100-80G:1"),
        declared=True,
        state_dir=state_dir,
        name=name,
        region="eu-west",
        reserve_price=0.5,
    )


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_registering_keeps_a_node_token_and_a_cursor_of_that_node_only(service, tmp_path):
    from prefect_spotgpu.agent.credentials import NodeRecord, save_cursor, save_record

    owner = service.tenant()
    service.grant_provider(owner)
    state = tmp_path / "state"
    state.mkdir()
    save_record(state, NodeRecord("http://another-market", 1, "sgn_elsewhere"))
    save_cursor(state, "http://another-market", 1, 12345)  # that market's events, not ours
    agent = owner_agent(service, owner, state)
    agent.register()
    assert agent.token is None  # the owner's key is not kept
    record = json.loads((state / "node.json").read_text())
    assert record["market"] == service.base_url and record["node_id"] == agent.node_id
    assert record["token"].startswith("sgn_")
    assert agent.cursor == 0
    again = owner_agent(service, owner, state)  # a restart: the kept token, no registration
    again.register()
    assert again.node_id == agent.node_id and len(owner.get("/nodes").json()) == 1


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_second_registration_of_a_name_issues_a_new_token(service, tmp_path):
    owner = service.tenant()
    service.grant_provider(owner)
    first = owner_agent(service, owner, tmp_path / "first")
    first.register()
    old = json.loads((tmp_path / "first" / "node.json").read_text())["token"]
    second = owner_agent(service, owner, tmp_path / "second")  # the host, its state lost
    second.register()
    new = json.loads((tmp_path / "second" / "node.json").read_text())["token"]
    assert second.node_id == first.node_id and new != old
    assert service.client(old).get("/nodes/me").status_code == 401  # revoked
    assert service.client(new).get("/nodes/me").json()["id"] == second.node_id
    # the first host's agent comes back with the owner's key: its token is refused, so it
    # asks for a new one (the second's stops working: one host per node)
    first.token = owner.headers["Authorization"].removeprefix("Bearer ")
    first.register()
    assert service.client(new).get("/nodes/me").status_code == 401


@pytest.mark.slow
def test_a_job_that_cannot_start_is_reported_failed_with_one_bounded_line_of_why(tmp_path):
    server, admin, owner_key, buyer_key = a_market(tmp_path)
    agent = start_agent(server, owner_key, "a", tmp_path)
    try:
        wait(lambda: admin.get("/nodes").json(), 30, "the agent registered")
        buyer = server.client(buyer_key)
        missing = "/no/such/interpreter-" + "x" * 400  # its error names it: over the limit
        bid = post_job(buyer, {"command": [missing]})

        def ended():
            page = buyer.get(f"/bids/{bid['id']}/events", params={"after": 0, "timeout": 1})
            return [e for e in page.json()["events"] if e["kind"] == "preempted"]

        (event,) = wait(ended, 30, "the allocation ended")
        assert event["payload"]["reason"] == "job failed on the node"
        detail = event["payload"]["detail"]
        assert detail.startswith("the job could not start: ") and "/no/such/interpreter-" in detail
        assert len(detail) == REPORT_DETAIL_CHARS  # cut to what the market takes, not refused
    finally:
        agent.terminate()
        agent.wait(timeout=15)
        agent.logfile.close()
        server.stop()
