"""A gang's members on real agents get torch.distributed's standard environment
(docs/users/gangs.md): rank 0's advertised address, the gang's port, their ranks; the
agent's values win over the tenant's; a malformed gang from the market is refused, never run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import one_database
from conftest import wait_for as wait
from prefect_spotgpu.agent.runners import DockerRunner, JobRequest, ProcessRunner
from prefect_spotgpu.agent.runners.runner import GangPlace
from prefect_spotgpu.protocol import GANG_ENV_NAMES as TORCH_DISTRIBUTED_NAMES
from test_agent import AS_ME, a_market, make_agent, owner_agent, start_agent, stop_agents

GOOD = {"rank": 1, "world_size": 2, "master_addr": "10.0.0.7", "master_port": 20010,
        "gpus_per_node": 2, "lead_allocation": 41}  # fmt: skip


GOOD_ENV = {
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "20010",
    "WORLD_SIZE": "2",
    "RANK": "1",
    "NODE_RANK": "1",
    "NNODES": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "SPOTGPU_GPUS_PER_NODE": "2",
    "SPOTGPU_GANG_LEAD_ALLOCATION": "41",
}
"""What a member placed by ``GOOD`` sees."""


def request(tmp_path: Path, gang: GangPlace | None) -> JobRequest:
    return JobRequest(1, 1, 10, ["true"], {}, [0], tmp_path, gang=gang)


def test_a_member_gets_torchrun_variables_and_a_one_node_job_none(tmp_path):
    env = request(tmp_path, GangPlace.from_assignment(GOOD)).job_variables(
        workdir="/w", checkpoint_url=None
    )
    assert {k: env[k] for k in TORCH_DISTRIBUTED_NAMES} == GOOD_ENV
    alone = request(tmp_path, GangPlace.from_assignment(None))
    assert not set(TORCH_DISTRIBUTED_NAMES) & set(
        alone.job_variables(workdir="/w", checkpoint_url=None)
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rank": 2}, "gang.rank"),
        ({"rank": -1}, "gang.rank"),
        ({"rank": True}, "gang.rank"),
        ({"world_size": 0}, "gang.world_size"),  # (1: a gang gone on smaller, alone)
        ({"world_size": 65}, "gang.world_size"),
        ({"master_port": 0}, "gang.master_port"),
        ({"master_port": "29500"}, "gang.master_port"),
        ({"master_addr": "10.0.0.7\nEVIL=1"}, "gang.master_addr"),
        ({"master_addr": "a/b"}, "gang.master_addr"),
        ({"master_addr": None}, "gang.master_addr"),
        ({"master_addr": "10.0.0.7\n"}, "gang.master_addr"),
        ({"master_addr": "a" * 254}, "gang.master_addr"),
        ({"master_addr": "169.254.169.254"}, "gang.master_addr '169.254.169.254' is a link-local"),
        ({"master_addr": "fe80::1"}, "gang.master_addr 'fe80::1' is a link-local"),
        ({"master_addr": "224.0.0.1"}, "gang.master_addr"),
        ({"gpus_per_node": 0}, "gang.gpus_per_node"),
        ({"gpus_per_node": 17}, "gang.gpus_per_node"),
        ({"gpus_per_node": 2.0}, "gang.gpus_per_node"),
        ({"lead_allocation": 0}, "gang.lead_allocation"),
        ({"lead_allocation": None}, "gang.lead_allocation"),
    ],
)
def test_a_malformed_gang_from_the_market_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        GangPlace.from_assignment({**GOOD, **change})
    with pytest.raises(ValueError, match="gang must be an object"):
        GangPlace.from_assignment(["rank", 0])


@pytest.mark.parametrize(
    ("option", "env", "why"),
    [
        (["--advertise-address", "evil/host"], {}, "not an IP address or a host name"),
        (["--advertise-address", "a" * 254], {}, "not an IP address or a host name"),
        ([], {"SPOTGPU_AGENT_ADVERTISE_ADDRESS": "10.0.0.7 -x"}, "not an IP address"),
        (["--advertise-address", "169.254.169.254"], {}, "link-local"),
        (["--advertise-address", "0.0.0.0"], {}, "no node can have"),
    ],
)
def test_a_bad_advertise_address_is_refused_before_anything_starts(tmp_path, option, env, why):
    result = subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start", "--gpus", "A100-80G:1",
         "--market", "http://127.0.0.1:9", "--state-dir", str(tmp_path), *option],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
        "SPOTGPU_AGENT_TOKEN": "x", "HOME": str(tmp_path), "COLUMNS": "200", **env},
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "--advertise-address" in out and why in out, out
    assert not list(tmp_path.iterdir())  # nothing started: not even the state directory


SHOW_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def run_to_the_end(runner: ProcessRunner, req: JobRequest) -> dict[str, str]:
    """Run a real process job that writes its whole environment to a file; that file."""
    out = req.workdir.parent / f"env-{req.allocation_id}.json"
    handle = runner.start(replace(req, command=[sys.executable, "-c", SHOW_ENV, str(out)]))
    try:
        wait(lambda: handle.poll() is not None, 20, "the job ended")
        assert handle.poll() == 0, (req.workdir / "job.log").read_text()
    finally:
        runner.stop(handle, grace=0)
    return json.loads(out.read_text())


def test_a_real_process_job_sees_the_agents_gang_variables_not_the_tenants(tmp_path):
    tenant = {"MASTER_ADDR": "evil.example", "MASTER_PORT": "1", "RANK": "7", "MINE": "kept"}
    member = JobRequest(
        1, 1, 10, ["x"], tenant, [0], tmp_path / "alloc-1",
        gang=GangPlace.from_assignment(GOOD),
    )  # fmt: skip
    env = run_to_the_end(ProcessRunner(users=AS_ME), member)
    assert {k: env.get(k) for k in TORCH_DISTRIBUTED_NAMES} == GOOD_ENV
    assert env["MINE"] == "kept"  # the tenant's other variables are the tenant's
    alone = JobRequest(2, 1, 11, ["x"], {"MINE": "kept"}, [0], tmp_path / "alloc-2")
    env = run_to_the_end(ProcessRunner(users=AS_ME), alone)
    assert env["MINE"] == "kept" and not set(TORCH_DISTRIBUTED_NAMES) & set(env)


def test_a_container_member_gets_the_same_variables_over_its_tenants(tmp_path):
    member = JobRequest(
        1, 1, 10, ["python"], {"MASTER_ADDR": "evil.example", "WORLD_SIZE": "99"}, [0],
        tmp_path / "alloc-1", image="pytorch/pytorch:2.4", gang=GangPlace.from_assignment(GOOD),
    )  # fmt: skip
    env = DockerRunner(client=object()).container_spec(member)["environment"]
    assert (env["MASTER_ADDR"], env["WORLD_SIZE"], env["RANK"]) == ("10.0.0.7", "2", "1")
    alone = JobRequest(
        2, 1, 11, ["python"], {}, [0], tmp_path / "alloc-2", image="pytorch/pytorch:2.4"
    )
    env = DockerRunner(client=object()).container_spec(alone)["environment"]
    assert not set(TORCH_DISTRIBUTED_NAMES) & set(env)


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_an_agent_reports_a_malformed_gang_failed_saying_why(service, tmp_path):
    owner, buyer = service.tenant(), service.tenant()
    _, agent = make_agent(service, owner, tmp_path, runner=ProcessRunner(users=AS_ME))
    agent.register()
    bid = buyer.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0, "region": "eu-west",
              "job": {"command": ["sleep", "60"]}},
    ).json()  # fmt: skip
    (alloc,) = wait(lambda: list(agent.assignments().values()), 20, "the allocation")
    agent.start(alloc.id, alloc.model_copy(update={"gang": {**GOOD, "rank": 5}}))  # broken
    assert agent.jobs == {} and agent.gpu_book.free_count() == 1  # never started; GPU free

    def ended():
        page = buyer.get(f"/bids/{bid['id']}/events", params={"after": 0, "timeout": 1})
        return [e for e in page.json()["events"] if e["kind"] == "preempted"]

    try:
        (event,) = wait(ended, 20, "the allocation reported failed")
        assert event["payload"]["reason"] == "job failed on the node"
        assert event["payload"]["detail"] == (
            "the market's gang is malformed: gang.rank must be an integer in [0, 1]"
        )
    finally:
        buyer.post(f"/bids/{bid['id']}/cancel")
        agent.shutdown()


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_the_agent_registers_its_advertised_address(service, tmp_path):
    owner = service.tenant()
    service.grant_provider(owner)
    agent = owner_agent(service, owner, tmp_path / "state")
    agent.address = "node-7.example"
    agent.register()  # (no heartbeat yet: the registration carried it)
    (node,) = owner.get("/nodes").json()
    assert node["address"] == "node-7.example"


MEMBER = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    out = pathlib.Path(sys.argv[1])
    names = sys.argv[2].split(",")
    mine = out / f"rank-{os.environ['RANK']}.json"
    mine.with_suffix(".tmp").write_text(json.dumps({n: os.environ.get(n) for n in names}))
    mine.with_suffix(".tmp").rename(mine)  # whole or not there: the test reads it at once
    deadline = time.time() + 30  # both members have started before either ends the gang
    while len(list(out.glob("rank-*.json"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    """
)


@pytest.mark.slow
def test_two_agents_start_a_gang_with_rank_0s_address(tmp_path):
    server, admin, owner_key, buyer_key = a_market(tmp_path)
    addresses = {"a": "127.0.0.11", "b": "127.0.0.12"}
    agents = {
        n: start_agent(server, owner_key, n, tmp_path, "--advertise-address", addresses[n])
        for n in addresses
    }
    try:
        nodes = wait(
            lambda: (
                len(r := admin.get("/nodes").json()) == 2 and all(n.get("address") for n in r) and r
            ),
            30,
            "two agents with their addresses",
        )
        address_of = {n["id"]: n["address"] for n in nodes}
        assert sorted(address_of.values()) == sorted(addresses.values())
        out = tmp_path / "out"
        out.mkdir()
        buyer = server.client(buyer_key)
        bid = buyer.post(
            "/bids",
            json={
                "gpu_model": "A100-80G", "gpu_count": 2, "max_price": 1.5, "region": "eu-west",
                "node_count": 2,
                "job": {
                    "command": [sys.executable, "-c", MEMBER, str(out),
                                ",".join(TORCH_DISTRIBUTED_NAMES)],
                    "env": {"MASTER_ADDR": "evil.example", "RANK": "7"},  # the agent's win
                },
            },
        )  # fmt: skip
        assert bid.status_code == 201, bid.text
        assert bid.json()["node_count"] == 2 and len(bid.json()["members"]) == 2
        seen = wait(
            lambda: len(files := sorted(out.glob("rank-*.json"))) == 2 and files, 60, "both ranks"
        )
        envs = {int(json.loads(f.read_text())["RANK"]): json.loads(f.read_text()) for f in seen}
        allocs = buyer.get(f"/bids/{bid.json()['id']}/allocations").json()
        (rank0,) = [a for a in allocs if a["rank"] == 0]
        rank0_node = rank0["node_id"]
        port = envs[0]["MASTER_PORT"]
        for rank, env in envs.items():
            assert env == {
                "MASTER_ADDR": address_of[rank0_node],
                "MASTER_PORT": port,
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "NODE_RANK": str(rank),
                "NNODES": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "SPOTGPU_GPUS_PER_NODE": "2",
                "SPOTGPU_GANG_LEAD_ALLOCATION": str(rank0["id"]),
            }
        assert int(port) == 20000 + bid.json()["id"] % 12000
    finally:
        stop_agents(agents, server, tmp_path)
