"""A Docker node's job network: each container's address, and who may reach it.

With ``--job-subnet`` (docs/operators/gpu-hosts.md#job-networks), every container of the node
runs on one Docker bridge network of that subnet, at the address the market gave its
allocation (``Assignment.job_address``). The operator routes each node's subnet to it from the
other GPU hosts, so a gang's members, on several hosts, reach each other at their job
addresses: the rendezvous on rank 0's (``MASTER_ADDR``) and the collectives' own ports,
whatever they are. The firewall this module writes keeps the rest out:

- **in**: a container is reached only from its gang's peers' addresses (``admit``) and by
  replies to its own connections; nothing else, another job on this host or another host's
  included (filter ``SPOTGPU-JOBS``, first in Docker's ``DOCKER-USER``);
- **this host**: a container reaches none of the host's own services, on any of its addresses
  (filter ``SPOTGPU-JOBS-IN``, first in ``INPUT``, for the network's bridge);
- **out**: anything else (the buyer's Prefect API, object storage, a registry), masqueraded
  as Docker does, except traffic to its peers, which keeps its address (nat
  ``SPOTGPU-JOBS``, first in ``POSTROUTING``) so that their firewall knows it.

Invariant: the rules that admit traffic to an address belong to the allocation that holds it
now. ``admit`` first removes every rule of that address (an earlier holder's, left by a killed
agent), and a stopped job's rules go with it (``forget``); each rule carries its allocation in
its comment (``spotgpu-alloc-ID``). Single writer: the node's agent, as root.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import shlex
import subprocess
import threading

logger = logging.getLogger("prefect_spotgpu.agent")

FILTER_CHAIN = "SPOTGPU-JOBS"
"""Who reaches a job (filter table, jumped to first from ``DOCKER-USER``)."""
INPUT_CHAIN = "SPOTGPU-JOBS-IN"
"""What a job reaches of this host: nothing (filter table, first in ``INPUT``)."""
NAT_CHAIN = "SPOTGPU-JOBS"
"""A job's traffic to its peers, not masqueraded (nat table, first in ``POSTROUTING``)."""
_JUMPS = (  # (table, chain, the chain it is jumped to from, first)
    ("filter", FILTER_CHAIN, "DOCKER-USER"),
    ("filter", INPUT_CHAIN, "INPUT"),
    ("nat", NAT_CHAIN, "POSTROUTING"),
)
NETWORK_LABEL = "io.spotgpu.job-network"
COMMENT = "spotgpu-alloc-{}"


class FirewallError(RuntimeError):
    """An ``iptables`` call failed: the message says which and why."""


def iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``iptables -w ARGS`` (it waits for the xtables lock Docker also takes)."""
    try:
        done = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise FirewallError("iptables is not installed: a job network needs it") from None
    if check and done.returncode != 0:
        raise FirewallError(f"iptables {' '.join(args)}: {done.stderr.strip()}")
    return done


class JobNetwork:
    """The job network of subnet ``subnet`` on one Docker engine, and its firewall rules."""

    def __init__(self, subnet: str, run=iptables) -> None:
        self.subnet = ipaddress.IPv4Network(subnet)
        self._run = run
        self._ready = False
        self._lock = threading.Lock()
        net = self.subnet
        self.name = f"spotgpu-jobs-{net.network_address}-{net.prefixlen}"
        self.bridge = f"sg{int(net.network_address):08x}{net.prefixlen}"  # (at most 15)
        self.gateway = str(net.network_address + 1)

    # ---------------------------------------------------------------- the network

    def ensure(self, client) -> None:
        """The network on ``client``'s engine (made the first time) and the firewall's chains
        and this network's standing rules; once per runner."""
        with self._lock:
            if self._ready:
                return
            self._network(client)
            self._chains()
            self._ready = True

    def _network(self, client) -> None:
        import docker

        try:
            network = client.networks.get(self.name)
        except docker.errors.NotFound:
            ipam = docker.types.IPAMConfig(
                pool_configs=[docker.types.IPAMPool(subnet=str(self.subnet), gateway=self.gateway)]
            )
            client.networks.create(
                self.name,
                driver="bridge",
                ipam=ipam,
                labels={NETWORK_LABEL: str(self.subnet)},
                options={
                    "com.docker.network.bridge.name": self.bridge,
                    "com.docker.network.bridge.enable_icc": "false",
                },
            )
            logger.info("job network %s (%s) made", self.name, self.subnet)
            return
        configs = (network.attrs.get("IPAM") or {}).get("Config") or []
        if [c.get("Subnet") for c in configs] != [str(self.subnet)]:
            raise FirewallError(
                f"the Docker network {self.name} exists with another subnet "
                f"({configs}): remove it (docker network rm {self.name})"
            )

    def _chains(self) -> None:
        net, bridge = str(self.subnet), self.bridge
        for table, chain, _ in _JUMPS:
            self._run("-t", table, "-N", chain, check=False)  # (there already: fine)
        self._jumps_first()
        replies = ("-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT")
        self._standing(FILTER_CHAIN, "-d", net, *replies, first=True)
        self._standing(FILTER_CHAIN, "-d", net, "-j", "DROP", first=False)
        self._standing(INPUT_CHAIN, "-i", bridge, *replies, first=True)
        self._standing(INPUT_CHAIN, "-i", bridge, "-j", "DROP", first=False)

    def _jumps_first(self) -> None:
        """Each chain first in its parent: Docker inserts its own rules at the top (its
        masquerade of a network it makes, for one), and the peers' traffic must be exempt
        before that."""
        for table, chain, parent in _JUMPS:
            listed = self._run("-t", table, "-S", parent).stdout.splitlines()
            rules = [line for line in listed if line.startswith("-A ")]
            if rules[:1] == [f"-A {parent} -j {chain}"]:
                continue
            while not self._run("-t", table, "-D", parent, "-j", chain, check=False).returncode:
                pass  # (every earlier jump to it, wherever it was)
            self._run("-t", table, "-I", parent, "1", "-j", chain)

    def _standing(self, chain: str, *rule: str, first: bool) -> None:
        """A rule that stays while the network does: replies first, drops last."""
        if self._run("-C", chain, *rule, check=False).returncode:
            self._run(*(("-I", chain, "1") if first else ("-A", chain)), *rule)

    def endpoint(self, client, address: str) -> dict:
        """The ``networking_config`` that puts a container at ``address`` on this network;
        ValueError for an address outside the subnet (the market's word, checked)."""
        if ipaddress.IPv4Address(address) not in self.subnet:
            raise ValueError(f"job address {address} is outside this node's {self.subnet}")
        config = client.api.create_endpoint_config(ipv4_address=address)
        return {self.name: config}

    # ---------------------------------------------------------------- a job's rules

    def admit(self, allocation_id: int, address: str, peers: list[str]) -> None:
        """Let ``peers`` (its gang's job addresses) reach the job at ``address``, and its
        traffic to them keep its address; an earlier holder's rules of ``address`` first go."""
        with self._lock:
            self._jumps_first()
            self._drop(  # (what reaches it, and its own traffic to its peers)
                lambda table, words: _names(words, "-d" if table == "filter" else "-s", address)
            )
            tag = ("-m", "comment", "--comment", COMMENT.format(allocation_id))
            for peer in peers:
                if peer == address:
                    continue
                ipaddress.IPv4Address(peer)  # (the market's word: an address, nothing else)
                self._run("-I", FILTER_CHAIN, "1", "-s", peer, "-d", address, *tag, "-j", "ACCEPT")
                self._run(
                    *("-t", "nat", "-A", NAT_CHAIN, "-s", address, "-d", peer),
                    *(*tag, "-j", "ACCEPT"),
                )

    def forget(self, allocation_id: int) -> None:
        """Remove a job's rules (it stopped, or an earlier agent's job was cleared)."""
        tag = COMMENT.format(allocation_id)
        with self._lock:
            self._drop(lambda table, words: tag in words)

    def _drop(self, matches) -> None:
        for table, chain in (("filter", FILTER_CHAIN), ("nat", NAT_CHAIN)):
            listed = self._run("-t", table, "-S", chain, check=False).stdout.splitlines()
            for line in listed:
                words = shlex.split(line)
                if words[:1] == ["-A"] and "--comment" in words and matches(table, words):
                    with contextlib.suppress(FirewallError):  # (gone meanwhile)
                        self._run("-t", table, "-D", *words[1:])


def _names(words: list[str], flag: str, address: str) -> bool:
    """Whether an ``iptables -S`` rule's ``flag`` (``-s``, ``-d``) is ``address``."""
    return any(
        w == flag and i + 1 < len(words) and words[i + 1] in (address, f"{address}/32")
        for i, w in enumerate(words)
    )
