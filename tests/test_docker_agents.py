"""Two real agents with ``--runner docker``: a reclaim mid-run, the final save inside the
container, and the resume in a container on the other node from that checkpoint.

The market service and both agents are real processes (``spotgpu server start``, ``spotgpu
agent start --runner docker --job-user auto``, as root, sharing one ``--checkpoint-root``);
the job is ``agent_job.py`` run by the image's python3 in the session's job image
(``conftest.job_image``: a real Docker engine, no registry).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import docker_engine
from conftest import wait_for as wait
from test_agent import a_market, last_step, post_job, start_agent

HERE = Path(__file__).parent
STEPS = 120
pytestmark = pytest.mark.slow


def start_docker_agent(server, key: str, name: str, home: Path, *options) -> subprocess.Popen:
    """A real agent whose jobs are containers, as users of their own."""
    checkpoints = ("--checkpoint-root", str(home / "checkpoints"))
    return start_agent(
        server, key, name, home, "--runner", "docker", *checkpoints, *options, job_user="auto"
    )


def stop_everything(agents: list[subprocess.Popen], server) -> None:
    """Stop the agents (SIGTERM, then SIGKILL), the market, and every job container left."""
    for agent in agents:
        agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
        agent.logfile.close()
    server.stop()
    docker_engine.remove_job_containers()


def job_logs(tmp_path: Path) -> list[dict]:
    """Every allocation's job log (each container writes its own, in its ``/spotgpu``)."""
    events = []
    for path in sorted(tmp_path.glob("state-*/alloc-*/job.log")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events


def test_a_reclaimed_container_saves_and_resumes_in_a_container_on_the_other_node(
    sandbox, job_image
):
    tmp_path = sandbox
    server, admin, owner_key, buyer_key = a_market(tmp_path, heartbeat_timeout=3)
    entry = {"reference": job_image, "framework": "Python 3 + NumPy (test job image)"}
    assert admin.put("/images/test-job", json=entry).status_code == 201  # the operator's
    buyer = server.client(buyer_key)
    agents = [start_docker_agent(server, owner_key, n, tmp_path) for n in ("a", "b")]
    try:
        wait(lambda: len(admin.get("/nodes").json()) == 2, 30, "both agents")
        source = (HERE / "agent_job.py").read_text()
        bid = post_job(
            buyer,
            {
                "command": ["python3", "-c", source, str(STEPS)],
                "image": "test-job",
                "env": {"JOB_LOG": "/spotgpu/job.log"},
                "checkpoint_url": "ckpt",
            },
        )
        first = wait(lambda: [e for e in job_logs(tmp_path) if "start" in e], 60, "start")[0]
        assert first["start"] == 0 and first["gpus"] == "0,1"
        assert first["threads"] == str(len(os.sched_getaffinity(0)))  # 2 of 2 GPUs: every core
        wait(lambda: sum("step" in e for e in job_logs(tmp_path)) >= 20, 30, "progress")
        victim = buyer.get(f"/bids/{bid['id']}/allocations").json()[0]["node_id"]
        reclaimed_at = time.time()
        server.client(owner_key).patch(f"/nodes/{victim}", json={"state": "reclaimed"})
        signal_at = wait(
            lambda: [e["signal"] for e in job_logs(tmp_path) if "signal" in e],
            15,
            "SIGUSR1 inside the container",
        )[0]
        second = wait(
            lambda: [
                e for e in job_logs(tmp_path) if "start" in e and e["alloc"] != first["alloc"]
            ],
            60,
            "the job in a container on the other node",
        )[0]
        # resumed from the final save at the first node's last step: not from 0, no step lost
        assert second["start"] == last_step(job_logs(tmp_path), first["alloc"]) + 1 >= 20
        done = wait(lambda: [e for e in job_logs(tmp_path) if "done" in e], 60, "done")[0]
        assert done["done"] == sum(range(STEPS))  # the uninterrupted run's result
        wait(
            lambda: buyer.get(f"/bids/{bid['id']}").json()["status"] == "finished",
            15,
            "bid finished",
        )
        statuses = sorted(a["status"] for a in buyer.get(f"/bids/{bid['id']}/allocations").json())
        assert statuses == ["finished", "preempted"]
        ended = [a for a in buyer.get(f"/bids/{bid['id']}/allocations").json()]
        assert any(a["final_save"] == "ok" for a in ended)
        print(
            json.dumps(
                {
                    "reclaim_to_sigusr1_in_container_s": round(signal_at - reclaimed_at, 3),
                    "reclaim_to_resumed_in_container_s": round(second["t"] - reclaimed_at, 3),
                }
            )
        )
        import docker

        client = docker.from_env()
        left = client.containers.list(
            ignore_removed=True, all=True, filters={"label": "io.spotgpu.bid-id"}
        )
        assert not [c for c in left if c.labels["io.spotgpu.bid-id"] == str(bid["id"])]

        # a lost agent: its guard removes the long job's container at once, before the market
        # finds the node lost; the agent comes back and the node is offered again
        survivor_node = next(n for n in admin.get("/nodes").json() if n["id"] != victim)
        long_bid = post_job(
            buyer,
            {"command": ["python3", "-c", "import time; time.sleep(3600)"], "image": "test-job"},
        )
        orphan = wait(
            lambda: client.containers.list(
                ignore_removed=True, filters={"label": f"io.spotgpu.bid-id={long_bid['id']}"}
            ),
            60,
            "the long job's container",
        )[0]
        index = ["a", "b"].index(survivor_node["name"])
        agents[index].kill()
        agents[index].wait(timeout=10)
        wait(
            lambda: (
                not client.containers.list(ignore_removed=True, all=True, filters={"id": orphan.id})
            ),
            10,
            "the container removed by the killed agent's guard",
        )
        wait(
            lambda: admin.get(f"/nodes/{survivor_node['id']}").json()["state"] == "lost",
            30,
            "the node lost",
        )
        agents.append(start_docker_agent(server, owner_key, survivor_node["name"], tmp_path))
        wait(
            lambda: admin.get(f"/nodes/{survivor_node['id']}").json()["state"] == "live",
            30,
            "the node offered again",
        )
        buyer.post(f"/bids/{long_bid['id']}/cancel")
    finally:
        stop_everything(agents, server)


def test_a_handed_over_container_is_adopted_by_the_next_agent(sandbox, job_image):
    """SIGUSR2 (an upgrade): the agent exits, its container runs on, and the next agent on its
    state directory adopts it: the same container, watched (its cancel removes it)."""
    import docker

    tmp_path = sandbox
    server, admin, owner_key, buyer_key = a_market(tmp_path, heartbeat_timeout=15)
    entry = {"reference": job_image, "framework": "Python 3 + NumPy (test job image)"}
    assert admin.put("/images/test-job", json=entry).status_code == 201
    buyer = server.client(buyer_key)
    handover = ("--handover-seconds", "10")
    agents = [start_docker_agent(server, owner_key, "a", tmp_path, *handover)]
    client = docker.from_env()
    try:
        wait(lambda: len(admin.get("/nodes").json()) == 1, 30, "the agent")
        ticking = (
            "import time\nfor i in range(7200):\n print('tick', i, flush=True); time.sleep(0.5)"
        )
        bid = post_job(buyer, {"command": ["python3", "-c", ticking], "image": "test-job"})
        label = {"label": f"io.spotgpu.bid-id={bid['id']}"}
        (container,) = wait(
            lambda: client.containers.list(ignore_removed=True, filters=label), 60, "container"
        )
        agents[0].send_signal(signal.SIGUSR2)
        assert agents[0].wait(timeout=15) == 0
        agents.append(start_docker_agent(server, owner_key, "a", tmp_path, *handover))
        wait(
            lambda: "adopted its job" in (tmp_path / "agent-a.log").read_text(),
            30,
            "the next agent adopting the container",
        )
        assert [c.id for c in client.containers.list(filters=label)] == [container.id]
        log = tmp_path / "agent-a.log"  # its output goes on in the new agent's log, not again
        wait(lambda: "| tick" in log.read_text(), 30, "the adopted container's output")
        assert "| tick 0" not in log.read_text()
        (alloc,) = buyer.get(f"/bids/{bid['id']}/allocations").json()
        assert alloc["status"] == "running"
        buyer.post(f"/bids/{bid['id']}/cancel")
        wait(
            lambda: not client.containers.list(ignore_removed=True, all=True, filters=label),
            30,
            "the adopted container removed at the cancel",
        )
    finally:
        stop_everything(agents, server)
