"""Flows decorated for spot GPUs (``@spot_gpu``, ``prefect_spotgpu.decorators``), end to
end: a real Prefect server, the real market, two real agents, and a plain
Python script that calls the flow. No pool worker runs unless a test starts one: the call's
own worker follows the run, across a reclaim, to its result. Also: what the decorator refuses
at decoration time, and the bundle executor refusing a bundle changed in storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID, uuid4

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.states import Pending

from conftest import wait_for
from prefect_spotgpu import spot_gpu
from prefect_spotgpu.bundles import bundle_name
from prefect_spotgpu.bundles.execute import BundleRefused, read_bundle
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
from prefect_spotgpu.checkpoint.objects import LocalObjects
from prefect_spotgpu.cli.stack import LocalStack
from prefect_spotgpu.protocol import LABELS
from spot_flow import count
from test_cli import spotgpu

HERE = Path(__file__).parent
POOL = "spot-decorated"
STEPS = 60


# ---------------------------------------------------------------- at decoration time


@pytest.mark.parametrize(
    ("variables", "says"),
    [
        ({"gpu_modle": "A100-80G"}, "unknown spot-gpu job variable(s) gpu_modle"),
        (
            {"gpu_model": "A100"},
            "job variable gpu_model: gpu_model 'A100' is not a known GPU model; known models: ",
        ),
        ({"gpu_count": 0}, "job variable gpu_count: Input should be greater than or equal to 1"),
        ({"max_price": "cheap"}, "job variable max_price:"),
        ({"image": "../../etc"}, "job variable image"),
        ({"gpu_hours": 4}, "gpu_hours needs a deadline"),
    ],
)
def test_job_variables_are_checked_when_the_flow_is_decorated(variables, says):
    with pytest.raises(ValueError) as refused:
        spot_gpu(work_pool="p", **variables)
    assert says in str(refused.value)
    if "not a known GPU model" in says:
        assert "A100-80G" in str(refused.value) and "H100-80G" in str(refused.value)


def test_a_decorated_flow_is_still_a_flow_with_its_variables():
    @spot_gpu(work_pool="p", gpu_model="H100", max_price=2.5)
    @flow(name="shaped")
    def shaped(x: int) -> int:
        return x

    assert shaped.name == "shaped" and shaped.work_pool == "p"
    assert shaped.job_variables == {"gpu_model": "H100", "max_price": 2.5}
    assert shaped.fn(3) == 3
    assert type(shaped.with_options(name="other")).__name__ == "SpotGPUFlow"


def test_an_api_set_in_memory_only_is_refused_naming_what_to_set(monkeypatch):
    """The bundle upload is a child process: it finds the Prefect API in the environment or
    the profile, never in this process's memory. Calling a decorated flow with an API set only
    in memory is refused before anything is created, naming the variable (no os.environ
    write makes it work behind the caller's back)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    @spot_gpu(work_pool="p")
    @flow(name="in-memory")
    def in_memory() -> int:
        return 1

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        for call in (in_memory, in_memory.submit, in_memory.submit_to_work_pool):
            with pytest.raises(RuntimeError, match="set PREFECT_API_URL in the environment"):
                call()
    assert "PREFECT_API_URL" not in os.environ


# ---------------------------------------------------------------- the bundle on the node


def test_a_bundle_changed_in_storage_is_never_run(tmp_path):
    """The attack: a party that can write the run's storage (a shared directory) swaps the
    bundle for its own code between upload and execution. The digest the caller recorded on
    the flow run (which only the caller's Prefect credentials can set) no longer matches."""
    objects = LocalObjects(tmp_path)
    honest = json.dumps({"function": "honest", "flow_run": {"id": str(uuid4())}}).encode()
    objects.put(bundle_name("k"), honest)
    import hashlib

    digest = hashlib.sha256(honest).hexdigest()
    assert read_bundle(str(tmp_path), "k", digest)["function"] == "honest"
    objects.put(bundle_name("k"), honest.replace(b"honest", b"hostile"))
    with pytest.raises(BundleRefused, match="is not the one its caller uploaded"):
        read_bundle(str(tmp_path), "k", digest)
    with pytest.raises(BundleRefused, match=r"has no spotgpu\.bundle-sha256 label"):
        read_bundle(str(tmp_path), "k", None)
    with pytest.raises(BundleRefused, match="could not be read"):
        read_bundle(str(tmp_path), "missing", digest)
    with pytest.raises(ValueError, match="must be relative"):
        objects.get("../outside")


def test_the_executor_fails_the_run_with_the_reason_when_its_bundle_was_changed(
    prefect_api_url, tmp_path
):
    """The real executor process, given the worker's go: it reads a tampered bundle, sets the
    flow run Failed saying why, exits 0, and never runs the hostile code."""

    @flow(name="victim")
    def victim() -> None: ...

    marker = tmp_path / "hostile-ran"
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(victim, state=Pending())
        client.update_flow_run_labels(
            run.id, {LABELS.ALLOCATION: "7", LABELS.BUNDLE_SHA256: "0" * 64}
        )
    LocalObjects(tmp_path).put(
        bundle_name("k"), json.dumps({"function": f"touch {marker}"}).encode()
    )
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api_url,
        "PREFECT__FLOW_RUN_ID": str(run.id),
        "SPOTGPU_ALLOCATION_ID": "7",
        "SPOTGPU_LAUNCH_TIMEOUT": "30",
    }
    done = subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.bundles.execute", "--url", str(tmp_path),
         "--key", "k"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    assert state.is_failed() and "is not the one its caller uploaded" in state.message
    assert not marker.exists()


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def stack(prefect_api_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("decorated")
    with LocalStack(home, prefect_api_url, heartbeat_timeout_seconds=3) as stack:
        stack.start_market()
        stack.nodes = {stack.start_agent(name): name for name in ("node-a", "node-b")}
        stack.create_pool(POOL, defaults={"gpu_count": 1, "max_price": 1.0})
        yield stack


def call_script(stack, tmp_path, *more: str) -> subprocess.Popen:
    progress = tmp_path / "progress.jsonl"
    return subprocess.Popen(
        [sys.executable, str(HERE / "decorated_flow.py"), POOL, str(progress), str(STEPS), *more],
        cwd=HERE,
        env={**os.environ, "PREFECT_API_URL": stack.prefect_api_url, "PYTHONPATH": str(HERE)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def progress_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outcome(process: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result line; stderr:\n{err[-3000:]}"
    return json.loads(lines[-1]) | {"stderr": err}


@pytest.mark.slow
def test_a_decorated_flow_called_from_a_script_returns_its_result_across_a_reclaim(stack, tmp_path):
    started = time.monotonic()
    caller = call_script(stack, tmp_path)
    progress = tmp_path / "progress.jsonl"
    wait_for(lambda: sum("step" in e for e in progress_of(progress)) >= 10, 120, "progress")
    first = int(next(e["alloc"] for e in progress_of(progress) if "start" in e))
    node = stack.market().get(f"/allocations/{first}").json()["node_id"]
    reclaimed_at = time.monotonic() - started
    owner = stack.market(stack.owner_key)
    assert owner.patch(f"/nodes/{node}", json={"state": "reclaimed"}).status_code == 200
    try:
        answer = outcome(caller)
    finally:
        owner.patch(f"/nodes/{node}", json={"state": "live"})
    reference = count(
        Checkpointer(LocalStorage(tmp_path / "ref"), "ref", every=1e9), STEPS, 0.0, None
    )
    assert answer.get("result") == reference, answer["stderr"][-3000:]

    starts = [e for e in progress_of(progress) if "start" in e]
    saves = [e["saved"] for e in progress_of(progress) if "saved" in e]
    assert len(starts) == 2 and starts[1]["start"] == saves[-1] + 1 >= 10  # the final save's
    assert int(starts[1]["alloc"]) != first
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[UUID(r) for r in _run_ids(stack, first)])
            )
        )
        run = runs[0]
        names = [s.name for s in client.read_flow_run_states(run.id)]
    assert run.run_count == 2 and names[-1] == "Completed"
    assert names.index("Preempted") < len(names) - 1, names
    assert LABELS.BUNDLE_SHA256 in run.labels
    print(
        json.dumps(
            {
                "decorated_call_timeline_s": {
                    "reclaimed_at": round(reclaimed_at, 1),
                    "returned_at": round(time.monotonic() - started, 1),
                    "states": names,
                }
            }
        )
    )


def _run_ids(stack, allocation: int) -> list[str]:
    bid = stack.market().get(f"/allocations/{allocation}").json()["bid_id"]
    labels = stack.market().get(f"/bids/{bid}").json()["labels"]
    return [labels[LABELS.FLOW_RUN]]


@pytest.mark.slow
def test_a_decorated_flow_that_raises_is_a_failed_run_and_raises_in_the_caller(stack, tmp_path):
    answer = outcome(call_script(stack, tmp_path, "--raise"))
    assert "the flow raised on purpose" in answer.get("error", ""), answer["stderr"][-3000:]


def test_without_a_running_worker_submit_to_work_pool_says_what_to_start(stack):
    @spot_gpu(work_pool=POOL)
    @flow(name="nobody-takes-it")
    def orphan() -> int:
        return 1

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"prefect worker start --pool {POOL} --type spot-gpu"):
        orphan.submit_to_work_pool()
    assert time.monotonic() - t0 < 10  # at once, never a hang


def test_a_pool_without_bundle_storage_is_refused_with_the_command_to_fix_it(stack):
    @spot_gpu(work_pool="no-such-pool")
    @flow(name="nowhere")
    def nowhere() -> int:
        return 1

    with pytest.raises(RuntimeError, match="`spotgpu pool setup no-such-pool`") as refused:
        nowhere()
    # the command it names works as written (here with the stack's own block names)
    command = str(refused.value).split("`")[1].split()
    assert command[:3] == ["spotgpu", "pool", "setup"]
    made = spotgpu(
        *command[1:], "--market-block", f"{POOL}-market", "--storage-block", f"{POOL}-checkpoints",
        env={**os.environ, "PREFECT_API_URL": stack.prefect_api_url},
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    assert "created work pool 'no-such-pool' of type spot-gpu" in made.stdout


@pytest.mark.slow
def test_ctrl_c_in_the_caller_cancels_the_run_and_its_bid(stack, tmp_path):
    caller = call_script(stack, tmp_path, "--steps-long")
    progress = tmp_path / "progress.jsonl"
    wait_for(lambda: sum("step" in e for e in progress_of(progress)) >= 3, 120, "progress")
    allocation = int(next(e["alloc"] for e in progress_of(progress) if "start" in e))
    caller.send_signal(signal.SIGINT)
    _, err = caller.communicate(timeout=60)
    market = stack.market()
    bid = market.get(f"/allocations/{allocation}").json()["bid_id"]
    wait_for(
        lambda: market.get(f"/bids/{bid}").json()["status"] == "cancelled", 30, "bid cancelled"
    )
    run_id = UUID(market.get(f"/bids/{bid}").json()["labels"][LABELS.FLOW_RUN])
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
    assert state.is_cancelled() and "Ctrl-C" in state.message, err[-3000:]
    ended = wait_for(
        lambda: (a := market.get(f"/allocations/{allocation}").json())["ended_at"] and a,
        30,
        "the job stopped",
    )
    assert ended["status"] == "finished"


@pytest.mark.slow
def test_submit_returns_at_once_and_the_pools_worker_serves_submit_to_work_pool(stack):
    @spot_gpu(work_pool=POOL, gpu_count=1)
    @flow(name="add")
    def add(x: int, y: int) -> int:
        return x + y

    t0 = time.monotonic()
    here = add.submit(1, 2)  # followed by a worker in this process
    assert time.monotonic() - t0 < 30 and not here.state.is_final()
    stack.start_worker(POOL, name="pool-worker")
    try:
        there = add.submit_to_work_pool(3, 4)  # taken by the pool's worker
        assert here.result(timeout=180) == 3
        assert there.result(timeout=180) == 7
    finally:
        stack.kill("pool-worker", signal.SIGTERM)
