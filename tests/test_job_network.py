"""Job networks against a real engine and the real firewall: who reaches a container.

Two Docker runners with job networks of their own (``10.88.11.0/24`` and ``10.88.12.0/24``)
stand for two GPU hosts: their bridges route to each other only through this host's
forwarding, where Docker isolates one bridge from another and the runners' rules
(``agent/runners/job_network.py``) let a gang's members through. A network namespace of the
test's own, on a veth pair, is a machine elsewhere (the buyer's Prefect API, object storage).
Every probe is a real TCP connection made inside a container (``docker exec``) or inside that
namespace; a refused one waits out a short timeout (the firewall drops, it does not answer).
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import wait_for
from helpers import namespace_elsewhere
from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.runners import JobRequest
from prefect_spotgpu.agent.runners.docker import DockerRunner
from prefect_spotgpu.agent.runners.job_network import (
    FILTER_CHAIN,
    INPUT_CHAIN,
    NAT_CHAIN,
    JobNetwork,
)
from prefect_spotgpu.agent.runners.runner import GangPlace

pytestmark = pytest.mark.slow
HOST_A, HOST_B = "10.88.11.0/24", "10.88.12.0/24"
RANK0, RANK1 = "10.88.11.2", "10.88.12.2"
PORT = 29500
ELSEWHERE = ("sgtest-away", "10.99.7.1", "10.99.7.2")  # namespace, this host's end, its end

ECHO = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT})); s.listen()
while True:
    c, a = s.accept(); c.sendall(a[0].encode()); c.close()
"""
PROBE = """
import socket, sys
s = socket.socket(); s.settimeout(1.5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
except OSError as e:
    print("refused", type(e).__name__); raise SystemExit
s.settimeout(0.5)
try:
    print("reached", s.recv(64).decode())
except OSError:
    print("reached")
"""


def sh(command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(shlex.split(command), capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def elsewhere():
    """A machine elsewhere, listening on ``PORT`` (it answers with the address it saw)."""
    name, here, there = ELSEWHERE
    with namespace_elsewhere(name, here, there):
        server = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", ECHO])
        yield there
        server.kill()


@pytest.fixture(scope="module")
def host_service():
    """A service of this host's own, on every address (the agent's metrics, a database)."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            with contextlib.suppress(OSError):
                server.accept()[0].close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def hosts(tmp_path, job_image):
    """Two runners, each with a job network of its own; their containers, networks and
    rules removed afterwards."""
    made = {
        net: DockerRunner(
            users=JobUsers("auto"),
            checkpoint_root=tmp_path / f"c{i}",
            gpu_devices=False,
            job_subnet=net,
        )
        for i, net in enumerate((HOST_A, HOST_B))
    }
    handles = []
    yield made, handles, job_image
    for handle in handles:
        for runner in made.values():
            with contextlib.suppress(Exception):
                runner.stop(handle, grace=0)
                break
    for runner in made.values():
        drop_network(runner)


def drop_network(runner: DockerRunner) -> None:
    """The network and every rule of it (standing and per job), as if never made."""
    network = runner.job_network
    with contextlib.suppress(Exception):
        runner.client.networks.get(network.name).remove()
    subnet, bridge = str(network.subnet), network.bridge
    for table, chain in (("filter", FILTER_CHAIN), ("filter", INPUT_CHAIN), ("nat", NAT_CHAIN)):
        for line in sh(f"iptables -w -t {table} -S {chain}", check=False).stdout.splitlines():
            words = shlex.split(line)
            if words[:1] == ["-A"] and (subnet in words or bridge in words or
                                        any(w.startswith(subnet.rsplit(".", 1)[0] + ".")
                                            for w in words)):  # fmt: skip
                sh(f"iptables -w -t {table} -D {shlex.join(words[1:])}", check=False)


def start(runner, handles, tmp_path, image, alloc, address, command, gang=None):
    request = JobRequest(
        allocation_id=alloc,
        epoch=1,
        bid_id=alloc + 100,
        command=command,
        env={"CUDA_VISIBLE_DEVICES": ""},
        gpu_indices=[0],
        workdir=tmp_path / "state" / f"alloc-{alloc}",
        image=image,
        tenant_id=alloc,  # each a tenant of its own
        gang=gang,
        job_address=address,
    )
    handle = runner.start(request)
    handles.append(handle)
    return handle


def probe(runner, handle, address: str, port: int = PORT) -> str:
    """What a connection from inside the container of ``handle`` to ``address:port`` got."""
    container = runner.client.containers.get(handle.ref)
    code, out = container.exec_run(["python3", "-c", PROBE, address, str(port)])
    assert code == 0, out
    return out.decode().strip()


def rules() -> str:
    return (
        sh(f"iptables -w -S {FILTER_CHAIN}").stdout
        + sh(f"iptables -w -t nat -S {NAT_CHAIN}").stdout
    )


def test_a_gangs_members_reach_each_other_across_hosts_and_nothing_else_reaches_them(
    hosts, tmp_path, elsewhere, host_service
):
    (a, b), handles, image = list(hosts[0].values()), hosts[1], hosts[2]
    peers = (RANK0, RANK1)
    place = {"world_size": 2, "master_addr": RANK0, "master_port": PORT, "gpus_per_node": 1,
             "lead_allocation": 1, "peers": list(peers)}  # fmt: skip
    rank0 = start(a, handles, tmp_path, image, 1, RANK0, ["python3", "-c", ECHO],
                  GangPlace.from_assignment({**place, "rank": 0}))  # fmt: skip
    rank1 = start(b, handles, tmp_path, image, 2, RANK1, ["sleep", "300"],
                  GangPlace.from_assignment({**place, "rank": 1}))  # fmt: skip
    stranger = start(b, handles, tmp_path, image, 3, "10.88.12.3", ["sleep", "300"])
    neighbour = start(a, handles, tmp_path, image, 4, "10.88.11.3", ["sleep", "300"])

    # its peer on the other host reaches it, at its own address (not masqueraded)
    assert wait_for(lambda: probe(b, rank1, RANK0) == f"reached {RANK1}", 20, "rank 1 -> rank 0")
    # another tenant's job, on the other host or on its own, does not
    assert probe(b, stranger, RANK0).startswith("refused")
    assert probe(a, neighbour, RANK0).startswith("refused")
    # a machine elsewhere does not either (nothing but its peers and replies reach a job)
    outside = sh(f"ip netns exec {ELSEWHERE[0]} {sys.executable} -c {shlex.quote(PROBE)} "
                 f"{RANK0} {PORT}").stdout  # fmt: skip
    assert outside.startswith("refused"), outside
    # the job reaches nothing of this host: not its bridge's gateway, not Docker's bridge
    for address in (a.job_network.gateway, "172.17.0.1", ELSEWHERE[1]):
        assert probe(a, rank0, address, host_service).startswith("refused"), address
    # and it does reach the world outside (masqueraded as this host: a machine elsewhere)
    assert probe(a, rank0, elsewhere) == f"reached {ELSEWHERE[1]}"
    assert probe(b, stranger, elsewhere) == f"reached {ELSEWHERE[1]}"

    # a stopped member's rules go with it
    assert "spotgpu-alloc-2" in rules()
    b.stop(rank1, grace=0)
    handles.remove(rank1)
    assert "spotgpu-alloc-2" not in rules() and "spotgpu-alloc-1" in rules()


def test_an_address_taken_again_admits_only_its_new_holders_peers(hosts, tmp_path):
    """An agent killed before it stopped its job leaves the job's rules behind: the next
    holder of the address does not inherit them (another tenant's container would reach it
    as the old gang's peer)."""
    (a, b), handles, image = list(hosts[0].values()), hosts[1], hosts[2]
    stale = "10.88.11.4"
    old_peer = start(b, handles, tmp_path, image, 5, "10.88.12.5", ["sleep", "300"])
    a.job_network.ensure(a.client)
    a.job_network.admit(6, stale, [stale, "10.88.12.5"])  # the killed agent's gang member
    assert "spotgpu-alloc-6" in rules()
    start(a, handles, tmp_path, image, 7, stale, ["python3", "-c", ECHO])  # a one-node job
    assert "spotgpu-alloc-6" not in rules()
    assert probe(b, old_peer, stale).startswith("refused")


def test_a_job_network_refuses_what_is_not_its_own(hosts, tmp_path):
    (a, _), _, image = list(hosts[0].values()), hosts[1], hosts[2]
    request = JobRequest(1, 1, 101, ["true"], {}, [0], tmp_path / "w", image=image,
                         tenant_id=1, job_address="10.88.12.9")  # fmt: skip
    with pytest.raises(ValueError, match=r"outside this node's 10\.88\.11\.0/24"):
        a.container_spec(request)
    with pytest.raises(ValueError, match="no address on the node's job network"):
        a.container_spec(JobRequest(1, 1, 101, ["true"], {}, [0], tmp_path / "w", image=image,
                                    tenant_id=1))  # fmt: skip
    plain = DockerRunner(users=JobUsers("auto"), gpu_devices=False, default_image=image)
    member = GangPlace(1, 2, "10.0.0.7", 20010, 1, 41)
    with pytest.raises(ValueError, match="--job-subnet"):
        plain.start(JobRequest(1, 1, 101, ["true"], {}, [0], tmp_path / "w", gang=member))


def test_a_network_of_that_name_with_another_subnet_is_named_not_reused():
    class Engine:  # (the engine's answer for an existing network, as docker-py gives it)
        class networks:
            @staticmethod
            def get(name):
                return type("N", (), {"attrs": {"IPAM": {"Config": [{"Subnet": "10.1.0.0/16"}]}}})

    network = JobNetwork(HOST_A, run=lambda *a, **k: None)
    with pytest.raises(RuntimeError, match=r"docker network rm spotgpu-jobs-10\.88\.11\.0-24"):
        network.ensure(Engine())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))


def test_the_operators_page_names_the_network_and_bridge_a_subnet_gets():
    page = (Path(__file__).parent.parent / "docs/operators/gpu-hosts.md").read_text()
    network = JobNetwork("10.88.7.0/24", run=lambda *a, **k: None)
    assert f"`{network.name}`" in page and f"`{network.bridge}`" in page
    for chain in (FILTER_CHAIN, INPUT_CHAIN):
        assert f"`{chain}`" in page
