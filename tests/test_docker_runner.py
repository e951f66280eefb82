"""The Docker runner against a real engine: jobs as real containers of a real image.

The engine is Debian's ``docker.io`` on this host (``conftest.job_image`` starts ``dockerd``
if none runs and builds the job image from a debootstrap'd base: no registry). Each test runs
the agent's own runner (``DockerRunner``) as the agent does: start, notice, poll, stop and
reconcile, and reads what the job saw from inside its container.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import docker
import pytest

from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.runners import JobFault, JobRequest
from prefect_spotgpu.agent.runners.docker import (
    DockerRunner,
    ImageUnavailable,
    _alive,
    container_name,
)
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
TENANT = 5

INSIDE = """
import json, os
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines()
              if ":\\t" in line)
mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
report = {
    "uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid(),
    "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
    "mounts": mounts, "env": {k: v for k, v in os.environ.items() if k.startswith("SPOTGPU_")},
    "docker_sock": os.path.exists("/var/run/docker.sock"),
}
open("/spotgpu/report.json", "w").write(json.dumps(report))
"""


def request(tmp_path: Path, alloc: int, command: list[str], image: str, **kw) -> JobRequest:
    return JobRequest(
        allocation_id=alloc,
        epoch=1,
        bid_id=alloc + 100,
        command=command,
        env={"CUDA_VISIBLE_DEVICES": "", "JOB_LOG": "/spotgpu/job.log", **kw.pop("env", {})},
        gpu_indices=kw.pop("gpu_indices", [0]),
        workdir=tmp_path / "state" / f"alloc-{alloc}",
        checkpoint_url="ckpt",
        checkpoint_key=f"bid-{alloc + 100}",
        image=image,
        tenant_id=TENANT,
        **kw,
    )


@pytest.fixture
def runner(tmp_path, job_image) -> DockerRunner:
    # the declared GPU index is given by NVIDIA_VISIBLE_DEVICES only: this host has no
    # NVIDIA container toolkit, and Docker refuses a device request without one
    return DockerRunner(
        users=JobUsers("auto"), checkpoint_root=tmp_path / "checkpoints", gpu_devices=False
    )


def wait_exit(runner: DockerRunner, handle, seconds: float = 60.0) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        code = runner.poll(handle)
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"the container of allocation {handle.request.allocation_id} runs on")


def job_log(req: JobRequest) -> list[dict]:
    path = req.workdir / "job.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_log(req: JobRequest, what: str, seconds: float = 30.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [e for e in job_log(req) if what in e]
        if found:
            return found[-1]
        time.sleep(0.02)
    raise AssertionError(f"the job never logged {what!r}: {job_log(req)[-3:]}")


def test_a_job_runs_confined_as_pid_1_of_its_own_container(tmp_path, runner, job_image):
    req = request(tmp_path, 11, ["python3", "-c", INSIDE], job_image)
    handle = runner.start(req)
    assert wait_exit(runner, handle) == 0
    seen = json.loads((req.workdir / "report.json").read_text())
    assert seen["pid"] == 1  # the notice's SIGUSR1 reaches the job, no wrapper
    assert seen["uid"] != 0 and seen["gid"] != 0
    assert int(seen["cap_eff"], 16) == 0 and seen["no_new_privs"] == "1"
    assert not seen["docker_sock"]
    host_paths = [m for m in seen["mounts"] if m.startswith("/spotgpu")]
    assert sorted(host_paths) == ["/spotgpu", "/spotgpu/checkpoints"]
    assert seen["env"]["SPOTGPU_ALLOCATION_ID"] == "11"
    assert seen["env"]["SPOTGPU_NOTICE_FILE"] == "/spotgpu/notice.json"
    assert seen["env"]["SPOTGPU_CHECKPOINT_URL"] == "/spotgpu/checkpoints"
    container = runner.client.containers.get(handle.ref)
    assert container.attrs["HostConfig"]["PidsLimit"] == runner.pids_limit
    assert container.labels["io.spotgpu.allocation-id"] == "11"
    runner.stop(handle, grace=1)


def test_a_notice_reaches_the_job_in_its_container_within_a_second_and_it_saves(
    tmp_path, runner, job_image
):
    source = (HERE / "agent_job.py").read_text()
    req = request(tmp_path, 12, ["python3", "-c", source, "100000"], job_image)
    began = time.time()
    handle = runner.start(req)
    started = wait_log(req, "start")
    wait_log(req, "step")
    deadline = time.monotonic() + 30  # a periodic checkpoint (every 0.5 s) before the notice
    while not req.saved_file.exists():
        assert time.monotonic() < deadline, "no periodic checkpoint"
        time.sleep(0.02)
    noticed_at = time.time()
    runner.notice(handle, deadline=noticed_at + 300)
    signalled = wait_log(req, "signal")
    latency = signalled["signal"] - noticed_at
    deadline = time.monotonic() + 30
    while not req.ack_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    acked_after = time.time() - noticed_at
    assert req.ack_file.exists(), "the final save was never acknowledged"
    print(
        json.dumps(
            {
                "container_start_to_job_seconds": round(started["t"] - began, 3),
                "notice_to_sigusr1_in_container_seconds": round(latency, 4),
                "notice_to_durable_final_save_seconds": round(acked_after, 3),
            }
        )
    )
    assert 0 <= latency < 1.0  # the bound: SIGUSR1 inside within 1 s of the notice
    runner.stop(handle, grace=5)
    with pytest.raises(docker.errors.NotFound):
        runner.client.containers.get(handle.ref)
    # the final save is durable on the host, in the tenant's directory, and restores
    storage = LocalStorage(tmp_path / "checkpoints" / f"tenant-{TENANT}")
    restored = Checkpointer(storage, req.checkpoint_key).restore()
    last_step = max(e["step"] for e in job_log(req) if "step" in e)
    assert restored is not None and restored.step == last_step


def test_stop_is_sigterm_then_sigkill_after_the_grace(tmp_path, runner, job_image):
    stubborn = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open('/spotgpu/up', 'w').close()\n"
        "time.sleep(3600)\n"
    )
    req = request(tmp_path, 13, ["python3", "-c", stubborn], job_image)
    handle = runner.start(req)
    deadline = time.monotonic() + 30
    while not (req.workdir / "up").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    began = time.monotonic()
    runner.stop(handle, grace=2)
    took = time.monotonic() - began
    assert 2 <= took < 15, took  # it waited the grace, then killed it
    assert not runner.client.containers.list(
        ignore_removed=True, all=True, filters={"id": handle.ref}
    )


def test_a_crashing_job_reports_its_exit_code_and_a_clean_one_zero(tmp_path, runner, job_image):
    crash = runner.start(request(tmp_path, 14, ["python3", "-c", "raise SystemExit(3)"], job_image))
    fine = runner.start(request(tmp_path, 15, ["python3", "-c", "pass"], job_image))
    assert wait_exit(runner, crash) == 3
    assert wait_exit(runner, fine) == 0
    for handle in (crash, fine):
        runner.stop(handle, grace=1)


def test_an_image_that_does_not_exist_fails_at_once_naming_it(tmp_path, runner, job_image):
    req = request(tmp_path, 16, ["python3", "-c", "pass"], "spotgpu-test/no-such-image:1")
    began = time.monotonic()
    with pytest.raises(ImageUnavailable, match="'spotgpu-test/no-such-image:1'"):
        runner.start(req)
    assert time.monotonic() - began < 30  # never a hang


def test_reconcile_stops_the_container_of_an_allocation_that_ended_while_the_agent_was_down(
    tmp_path, runner, job_image
):
    req = request(tmp_path, 17, ["python3", "-c", "import time; time.sleep(3600)"], job_image)
    handle = runner.start(req)
    restarted = DockerRunner(
        users=JobUsers("auto"), checkpoint_root=tmp_path / "checkpoints", gpu_devices=False
    )  # a new agent process: it knows the allocation only from the market
    assert restarted.reconcile(17, req.workdir) is True
    assert not runner.client.containers.list(
        ignore_removed=True, all=True, filters={"id": handle.ref}
    )
    assert restarted.reconcile(17, req.workdir) is False
    # a start after a crash of the agent finds the name free again
    again = runner.start(req)
    assert runner.client.containers.get(again.ref).name == container_name(17)
    runner.stop(again, grace=1)


def test_reconcile_is_no_error_when_a_listed_container_goes_before_it_is_removed(
    tmp_path, runner, job_image, monkeypatch
):
    """The engine lists a container that is gone a moment later (its job's own ``stop``, a
    second reconcile): the agent's reconcile must not fail on it. The race is made certain by
    removing each container right after the engine has listed it, before docker-py reads it
    again (its full list inspects each one) or the runner removes it."""
    req = request(tmp_path, 9019, ["python3", "-c", "import time; time.sleep(3600)"], job_image)
    handle = runner.start(req)
    restarted = DockerRunner(
        users=JobUsers("auto"), checkpoint_root=tmp_path / "checkpoints", gpu_devices=False
    )
    engine_list = restarted.client.api.containers

    def listed_then_gone(*args, **kwargs):
        listed = engine_list(*args, **kwargs)
        for container in listed:
            runner.client.api.remove_container(container["Id"], force=True)
        return listed

    monkeypatch.setattr(restarted.client.api, "containers", listed_then_gone)
    assert restarted.reconcile(9019, req.workdir) is True  # it was there when listed
    assert not runner.client.containers.list(
        ignore_removed=True, all=True, filters={"id": handle.ref}
    )


def test_the_container_output_goes_to_the_agents_log(tmp_path, runner, job_image, caplog):
    caplog.set_level("INFO", logger="prefect_spotgpu.agent.jobs")
    req = request(
        tmp_path, 18, ["python3", "-c", "print('hello from the job', flush=True)"], job_image
    )
    handle = runner.start(req)
    assert wait_exit(runner, handle) == 0
    deadline = time.monotonic() + 10
    while "hello from the job" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "allocation 18 | hello from the job" in caplog.text
    runner.stop(handle, grace=1)


def test_a_container_gone_before_its_pid_was_read_is_not_alive():
    """A job that exits at once leaves ``State.Pid`` 0; ``os.kill(0, 0)`` asks about the
    agent's own process group and succeeds, so such a job looked alive for ever."""
    assert _alive(0) is False and _alive(-1) is False
    assert _alive(os.getpid()) is True


def test_stop_with_no_grace_is_sigkill_only_so_the_engine_writes_no_crashed_state(
    tmp_path, runner, job_image
):
    """The end of a notice: a SIGTERM would let Prefect's engine write Crashed on the run."""
    told = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: open('/spotgpu/sigterm', 'w').close())\n"
        "open('/spotgpu/up', 'w').close()\n"
        "time.sleep(3600)\n"
    )
    req = request(tmp_path, 17, ["python3", "-c", told], job_image)
    handle = runner.start(req)
    deadline = time.monotonic() + 30
    while not (req.workdir / "up").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    began = time.monotonic()
    runner.stop(handle, grace=0)
    assert time.monotonic() - began < 10
    assert not runner.client.containers.list(
        ignore_removed=True, all=True, filters={"id": handle.ref}
    )  # removed: its process is gone, and wrote what it would have written
    assert not (req.workdir / "sigterm").exists()  # it never heard a SIGTERM


def test_a_bid_without_an_image_runs_in_the_nodes_default_image_or_fails_naming_the_option(
    tmp_path, job_image
):
    bare = DockerRunner(users=JobUsers("auto"), checkpoint_root=tmp_path / "c", gpu_devices=False)
    req = request(tmp_path, 18, ["python3", "-c", "pass"], None)
    with pytest.raises(JobFault, match="--default-image"):
        bare.start(req)
    default = DockerRunner(
        users=JobUsers("auto"),
        checkpoint_root=tmp_path / "c",
        gpu_devices=False,
        default_image=job_image,
    )
    assert default.container_spec(req)["image"] == job_image
    handle = default.start(req)
    assert wait_exit(default, handle) == 0
    default.stop(handle, grace=0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
