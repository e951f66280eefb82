"""A gang in containers across hosts, end to end (docs/users/gangs.md#in-containers): a real
Prefect server, the real market service, **three** real agents with ``--runner docker`` and
job networks of their own (``--job-subnet``), a ``spot-gpu`` worker, and
``flows/pretrain.py`` (DDP over gloo, a gang checkpoint) deployed in a job image built by the
repository's recipe (``docker/job.Dockerfile`` on a Python image with this host's CPU torch).

Topology: the three nodes' job networks are three Docker bridges (``10.88.21.0/24``,
``.22.``, ``.23.``) that reach each other only through this host's forwarding, as GPU hosts
whose subnets the data centre routes: Docker isolates one bridge from another, and each
agent's firewall (``agent/runners/job_network.py``) lets its gang's peers through, at their
own addresses, and nothing else. The Prefect server runs in a network namespace of the test's
own, behind a veth pair: the buyer's server, elsewhere, since a container on a job network
reaches none of its host's services. (One engine and one kernel stand for the hosts: the
routing between them is this host's, not a fabric's.)

The owner reclaims rank 1's node mid-run: both members save their shard (in containers),
stop, the run is ``Preempted`` and resumes on the survivor plus the third node, rank 0 in a
container at its new address, and completes with exactly the losses of an uninterrupted
two-rank run on the command line in the same image (bit for bit: the flow's corpus is the
image's Python standard library, not this host's).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import docker_engine
from conftest import wait_for
from helpers import namespace_elsewhere, prefect_client
from prefect_spotgpu.cli.stack import LocalStack
from test_gang_e2e import (
    STEPS,
    acknowledgement,
    all_ended,
    logged_step,
    loss_table,
    reclaim,
    running_gang,
    start_run,
    the_end,
    timeline,
)

pytestmark = pytest.mark.slow
SUBNETS = {"node-a": "10.88.21.0/24", "node-b": "10.88.22.0/24", "node-c": "10.88.23.0/24"}
AWAY = ("sgtest-prefect", "10.99.8.1", "10.99.8.2")  # namespace, this host's end, the server's


@pytest.fixture(scope="module")
def away():
    """A machine elsewhere for the Prefect server."""
    name, here, there = AWAY
    with namespace_elsewhere(name, here, there):
        yield name, there


@pytest.fixture(scope="module")
def torch_flow_image(job_image) -> str:
    try:
        return docker_engine.torch_flow_image()
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the torch flow image did not build: {exc.stderr}", pytrace=False)


@pytest.fixture(scope="module")
def uninterrupted(torch_flow_image):
    """The losses of a two-rank run never stopped: the command line, both ranks in one
    container of the flow image (no network but its loopback), started now, read when the
    test needs them."""
    import docker

    out = Path(tempfile.mkdtemp(prefix="spotgpu-uninterrupted-"))
    ranks = " & ".join(
        f"RANK={rank} python {docker_engine.FLOWS}/pretrain.py --steps {STEPS} "
        f"--checkpoints /out/store-{rank} --result /out/result.json > /out/rank{rank}.out 2>&1"
        for rank in (0, 1)
    )
    container = docker.from_env().containers.run(
        torch_flow_image,
        ["sh", "-c", f"{ranks}; wait"],
        environment={
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        },
        volumes={str(out): {"bind": "/out", "mode": "rw"}},
        network_mode="none",
        detach=True,
    )

    def losses() -> list[float]:
        assert container.wait(timeout=300)["StatusCode"] == 0, container.logs()
        logs = [(out / f"rank{r}.out").read_text() for r in (0, 1)]
        assert (out / "result.json").exists(), logs
        return json.loads((out / "result.json").read_text())["losses"]

    yield losses
    container.remove(force=True)
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(torch_flow_image, away):
    home = Path(tempfile.mkdtemp(prefix="spotgpu-gang-docker-"))
    home.chmod(0o711)  # the job users traverse it to their directories
    namespace, address = away
    try:
        with LocalStack(home, heartbeat_timeout_seconds=3) as stack:
            stack.start_prefect_server(host=address, netns=namespace)
            stack.start_market()
            entry = {"reference": torch_flow_image, "framework": "PyTorch (CPU, test)",
                     "runs_flows": True}  # fmt: skip
            answer = stack.market(stack.admin_key).put("/images/torch-flow", json=entry)
            assert answer.status_code == 201, answer.text
            stack.nodes = {
                stack.start_agent(name, runner="docker", job_subnet=subnet): name
                for name, subnet in SUBNETS.items()
            }
            defaults = {"gpu_count": 2, "node_count": 2, "max_price": 1.5, "image": "torch-flow"}
            pool = stack.create_pool("gang-docker", defaults=defaults)
            stack.deployment = stack.deploy(
                "pretrain.py:pretrain", Path(docker_engine.FLOWS), "gang-docker", pool
            )
            stack.start_worker(pool)
            yield stack
    finally:
        docker_engine.remove_job_containers()
        for subnet in SUBNETS.values():
            net = subnet.replace("/", "-")
            subprocess.run(["docker", "network", "rm", f"spotgpu-jobs-{net}"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def prefect(stack):
    with prefect_client(stack.prefect_api_url) as client:
        yield client


def test_a_gang_in_containers_on_two_hosts_resumes_after_a_reclaim_with_the_same_losses(
    stack,
    prefect,
    uninterrupted,
):
    started = time.time()
    run_id = start_run(prefect, stack)
    first = running_gang(stack, prefect, run_id)
    assert len({a["node_id"] for a in first}) == 2
    containers = {a["id"]: _container(a["id"]) for a in first}
    addresses = [_address(containers[a["id"]]) for a in first]  # each on its host's subnet
    assert [a.rsplit(".", 2)[-2] for a in addresses] == [
        SUBNETS[stack.nodes[a["node_id"]]].split(".")[2] for a in first
    ]
    env = _env(containers[first[1]["id"]])
    assert env["MASTER_ADDR"] == addresses[0] and env["WORLD_SIZE"] == "2", env
    wait_for(lambda: logged_step(prefect, run_id) >= 50, 180, "training before the reclaim", 0.2)
    reclaim(stack, first[1]["node_id"])

    acks = [acknowledgement(stack, a) for a in first]
    assert acks[0]["step"] == acks[1]["step"] and all(a["durable"] for a in acks), acks
    saved_at = acks[0]["step"]
    assert 50 <= saved_at < STEPS - 1
    final = wait_for(lambda: the_end(prefect, run_id), 300, "the run's end")
    assert final.is_completed(), final
    names = [s.name for s in prefect.read_flow_run_states(run_id)]
    assert "Preempted" in names and names[-1] == "Completed", names

    allocations = all_ended(stack, prefect, run_id)
    second = sorted((a for a in allocations if a["id"] > max(x["id"] for x in first)),
                    key=lambda a: a["rank"])  # fmt: skip
    survivor, lost = first[0]["node_id"], first[1]["node_id"]
    third = (set(stack.nodes) - {survivor, lost}).pop()
    assert [(a["rank"], a["node_id"], a["status"]) for a in second] == [
        (0, survivor, "finished"),
        (1, third, "finished"),
    ]
    losses = loss_table(prefect, run_id)
    assert [x.hex() for x in losses] == [x.hex() for x in uninterrupted()]  # bit for bit
    wait_for(  # every member's rules go with it (the run's end reaches its agents after the market)
        lambda: "spotgpu-alloc-" not in _iptables_rules(), 60, "every member's rules gone"
    )
    print("\n".join(["", f"saved at step {saved_at}; first attempt at {addresses}",
                     *timeline(stack, prefect, run_id, started)]))  # fmt: skip


def _container(allocation_id: int):
    import docker

    client = docker.from_env()
    return wait_for(
        lambda: next(iter(client.containers.list(
            filters={"label": f"io.spotgpu.allocation-id={allocation_id}"})), None),
        60,
        f"allocation {allocation_id}'s container",
    )  # fmt: skip


def _address(container) -> str:
    container.reload()
    (network,) = container.attrs["NetworkSettings"]["Networks"].values()
    return network["IPAddress"]


def _env(container) -> dict[str, str]:
    return dict(v.split("=", 1) for v in container.attrs["Config"]["Env"])


def _iptables_rules() -> str:
    return subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True).stdout
