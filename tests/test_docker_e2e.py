"""End to end with real containers: a real Prefect server, the market, two agents with
``--runner docker`` and a ``spot-gpu`` worker; the flow runs in a container of a Prefect job
image built in the test session (``conftest.flow_image``: no registry).

The owner reclaims the node mid-run: the final save happens inside the container, the run is
``Preempted``, and it resumes in a container on the other node and completes with the result
of an uninterrupted run. Containers reach the Prefect server at the host's address on Docker's
bridge (the server listens there, not on loopback).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from uuid import UUID

import docker
import pytest

import docker_engine
from conftest import wait_for
from helpers import prefect_client
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
from prefect_spotgpu.cli.stack import LocalStack
from spot_flow import count

STEPS = 60
MISSING = "spotgpu-test/no-such-image:1"
"""In the operator's catalogue (as ``broken``), on no node and not in the registry that its
reference names (the session's: it answers that it has no such image)."""
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(flow_image, registry):
    home = Path(tempfile.mkdtemp(prefix="spotgpu-docker-e2e-"))
    home.chmod(0o711)  # the job users traverse it to their directories
    try:
        with LocalStack(home, heartbeat_timeout_seconds=3) as stack:
            stack.start_prefect_server(host=docker_engine.bridge_gateway())
            stack.start_market()
            stack.flow_image = flow_image
            stack.missing = f"{registry.address}/{MISSING}"
            catalogue = stack.market(stack.admin_key)
            for name, reference in (("test-flow", flow_image), ("broken", stack.missing)):
                entry = {"reference": reference, "framework": "Prefect + NumPy (test)",
                         "runs_flows": True}  # fmt: skip
                assert catalogue.put(f"/images/{name}", json=entry).status_code == 201
            stack.nodes = {
                stack.start_agent(name, runner="docker"): name for name in ("node-a", "node-b")
            }
            defaults = {"gpu_count": 2, "max_price": 1.5, "image": "test-flow"}
            pool = stack.create_pool("spot-docker", defaults=defaults)
            stack.deployment = stack.deploy(
                "spot_flow.py:spot_count", Path(docker_engine.FLOWS), "docker-e2e", pool
            )
            stack.start_worker(pool)
            yield stack
    finally:
        docker_engine.remove_job_containers()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def prefect(stack):
    with prefect_client(stack.prefect_api_url) as client:
        yield client


def progress_of(stack) -> list[dict]:
    """The run's progress, in its tenant's checkpoint directory on the host."""
    entries = []
    for path in (stack.home / "node-checkpoints").glob("tenant-*/progress.jsonl"):
        entries += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return entries


def test_a_reclaimed_containerised_run_saves_resumes_in_a_container_and_completes(
    stack, prefect, tmp_path
):
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment),
        parameters={
            "steps": STEPS,
            "step_seconds": 0.1,
            "progress": "/spotgpu/checkpoints/progress.jsonl",
        },
    )
    created = time.time()

    def running_allocation():
        current = prefect.read_flow_run(run.id)
        return current.state.is_running() and current.labels.get("spotgpu.allocation")

    first = int(wait_for(running_allocation, 120, "the run Running in a container", 0.2))
    running_at = time.time()
    wait_for(lambda: sum("step" in e for e in progress_of(stack)) >= 10, 60, "progress")
    market = stack.market()
    first_node = market.get(f"/allocations/{first}").json()["node_id"]
    containers = docker.from_env().containers.list(
        ignore_removed=True, filters={"label": f"io.spotgpu.allocation-id={first}"}
    )
    assert len(containers) == 1  # the flow run's engine is in a container
    reclaimed_at = time.time()
    owner = stack.market(stack.owner_key)
    assert owner.patch(f"/nodes/{first_node}", json={"state": "reclaimed"}).is_success

    def over():  # (a stopped engine's Crashed is not: the worker reschedules it)
        state = prefect.read_flow_run(run.id).state
        return (state.is_completed() or state.is_failed() or state.is_cancelled()) and state

    final = wait_for(over, 180, "Completed")
    assert final.is_completed(), final
    names = [s.name for s in prefect.read_flow_run_states(run.id)]
    assert "Preempted" in names and names[-1] == "Completed", names
    current = prefect.read_flow_run(run.id)
    second = int(current.labels["spotgpu.allocation"])
    assert current.run_count == 2 and second != first
    assert market.get(f"/allocations/{second}").json()["node_id"] != first_node

    entries = progress_of(stack)
    starts = [e for e in entries if "start" in e]
    assert [int(s["alloc"]) for s in starts] == [first, second]
    saved = [e for e in entries if "saved" in e]
    assert starts[1]["start"] == saved[0]["saved"] + 1  # exactly after the final save
    reference = Checkpointer(LocalStorage(tmp_path / "reference"), "ref", every=1e9)
    assert [e["done"] for e in entries if "done" in e] == [count(reference, STEPS, 0.0, None)]
    # offered again for the module's next test
    assert owner.patch(f"/nodes/{first_node}", json={"state": "live"}).is_success
    print(
        json.dumps(
            {
                "created_to_running_in_container_s": round(running_at - created, 2),
                "reclaim_to_final_save_in_container_s": round(saved[0]["t"] - reclaimed_at, 3),
                "reclaim_to_resumed_in_container_s": round(starts[1]["t"] - reclaimed_at, 3),
                "reclaim_to_completed_s": round(time.time() - reclaimed_at, 2),
            }
        )
    )


def test_an_image_that_does_not_exist_fails_the_run_naming_it_at_once(stack, prefect):
    """The run fails naming the image; the node it was tried on keeps taking work (the
    registry's "no such image" is the image's fault: one broken catalogue entry must not
    drain, one after another, every node it is tried on)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    missing = stack.missing
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment), parameters={"steps": 5}, job_variables={"image": "broken"}
    )
    began = time.time()

    def over():
        state = prefect.read_flow_run(run.id).state
        return state.is_final() and not state.is_crashed() and state

    final = wait_for(over, 90, "the run's end")
    assert final.is_failed() and repr(missing) in final.message, final
    assert time.time() - began < 60  # never a hang

    def logged():  # (the worker sends its logs to Prefect in batches)
        logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        return [log.message for log in logs if missing in log.message]

    assert "could not be pulled" in wait_for(logged, 30, "the reason in the run's log")[0]
    bid_id = prefect.read_flow_run(run.id).labels["spotgpu.bid"]
    assert stack.market().get(f"/bids/{bid_id}").json()["status"] == "cancelled"
    tried = {a["node_id"] for a in stack.market().get(f"/bids/{bid_id}/allocations").json()}
    owner = stack.market(stack.owner_key)

    def all_live() -> bool:
        return {owner.get(f"/nodes/{n}").json()["state"] for n in tried} == {"live"}

    assert tried and wait_for(all_live, 15, "the nodes it was tried on live")


def test_an_image_outside_the_catalogue_is_refused_before_any_bid_with_the_list(stack, prefect):
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment),
        parameters={"steps": 5},
        job_variables={"image": "ghcr.io/attacker/miner:1"},
    )

    def over():
        state = prefect.read_flow_run(run.id).state
        return state.is_final() and state

    final = wait_for(over, 60, "the run's end")
    assert "not in the market's image catalogue" in final.message, final
    assert "known images: process, broken, huggingface" in final.message, final
    assert "test-flow" in final.message
    assert "spotgpu.bid" not in (prefect.read_flow_run(run.id).labels or {})  # nothing was bid


def test_a_run_whose_image_a_node_must_pull_shows_the_pull_in_its_log(stack, prefect, registry):
    """The flow image plus a layer only the registry has: the node pulls it, the pull's
    progress reaches the run's log through the market (pulling events), and the run completes."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    flow_image = stack.flow_image
    pulled = docker_engine.push_pull_image(
        registry, flow_image, name="spotgpu-test/flow-pull:1", ballast_bytes=16_000_000
    )
    try:
        entry = {
            "reference": pulled,
            "framework": "Prefect + NumPy (test, from a registry)",
            "runs_flows": True,
        }
        assert stack.market(stack.admin_key).put("/images/pulled", json=entry).status_code == 201
        run = prefect.create_flow_run_from_deployment(
            UUID(stack.deployment), parameters={"steps": 5}, job_variables={"image": "pulled"}
        )

        def over():
            state = prefect.read_flow_run(run.id).state
            return state.is_final() and state

        final = wait_for(over, 180, "the run's end")
        assert final.is_completed(), final

        def pull_lines():
            logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            lines = [log.message for log in logs if f"pulled {pulled} in " in log.message]
            return lines and [log.message for log in logs if pulled in log.message]

        lines = wait_for(pull_lines, 30, "the pull in the run's log")
        assert lines[-1].startswith("Node ") and "new layer" in lines[-1], lines
        print(json.dumps({"pull_lines_in_the_run_log": lines}))
    finally:
        docker_engine.forget_image(pulled)
