"""An agent that stops never runs a job twice (docs/operators/systemd.md): asked to stop
(SIGTERM, Ctrl-C's SIGINT) it takes its node back, its job saves and stops within
``--grace-seconds`` and the run resumes elsewhere from that save, with no compensation (nothing
was lost); killed (SIGKILL), its guard kills its job at once; restarted at once, it offers its
node again. Real agents, a real market process, a real checkpointing job; never two live
processes of one run (by pid, and by the job's own log: once a later attempt has started, no
earlier one writes again)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import wait_for as wait
from test_agent import a_market, job_bid, last_step, read_log, start_agent, stop_agents

pytestmark = pytest.mark.slow

GRACE = 10  # the agents' --grace-seconds here


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def attempts_in_turn(log: list[dict]) -> list[int]:
    """The allocations that wrote the job's log, in turn; fails if an earlier attempt wrote
    after a later one had started (two copies of the run alive at once)."""
    order: list[int] = []
    for entry in log:
        alloc = entry["alloc"]
        if alloc not in order:
            order.append(alloc)
        assert alloc == order[-1], f"allocation {alloc} ran after {order[-1]} started: {entry}"
    return order


@dataclass
class RunOnTwoAgents:
    """A long checkpointing run on one of two real agents (``name``), at its 10th step."""

    server: object
    admin: object
    owner_key: str
    buyer: object
    agents: dict
    bid: dict
    log: Path
    first: dict  # the job's first "start" line (its allocation and pid)
    alloc: dict  # its allocation
    name: str  # the agent it runs on
    options: tuple[str, ...] = ()  # more of the agents' command line

    def start_agent(self, name: str, as_name: str | None = None) -> None:
        self.agents[as_name or name] = start_agent(
            self.server, self.owner_key, name, self.log.parent, "--grace-seconds", str(GRACE),
            *self.options,
        )  # fmt: skip

    def started_after(self, *allocs: int) -> dict:
        """The first "start" line of an allocation other than ``allocs``, once there is one."""
        return wait(
            lambda: [e for e in read_log(self.log) if "start" in e and e["alloc"] not in allocs],
            60,
            f"the run resumed after {allocs}",
        )[0]

    def progress(self, alloc: int, steps: int = 5) -> None:
        wait(lambda: sum(e.get("alloc") == alloc for e in read_log(self.log)) > steps, 30, "")


def a_run_on_one_of_two_agents(
    tmp_path, heartbeat_timeout: float = 3, options: tuple[str, ...] = ()
) -> RunOnTwoAgents:
    server, admin, owner_key, buyer_key = a_market(tmp_path, heartbeat_timeout=heartbeat_timeout)
    run = RunOnTwoAgents(server, admin, owner_key, server.client(buyer_key), {}, {},
                         tmp_path / "job.jsonl", {}, {}, "", options)  # fmt: skip
    for name in ("a", "b"):
        run.start_agent(name)
    nodes = wait(lambda: len(r := admin.get("/nodes").json()) == 2 and r, 30, "agents")
    run.bid = job_bid(run.buyer, 100000, run.log, tmp_path / "ckpt")
    run.first = wait(lambda: [e for e in read_log(run.log) if "start" in e], 30, "job start")[0]
    wait(lambda: sum("step" in e for e in read_log(run.log)) >= 10, 30, "progress")
    (run.alloc,) = run.buyer.get(f"/bids/{run.bid['id']}/allocations").json()
    run.name = {n["id"]: n["name"] for n in nodes}[run.alloc["node_id"]]
    return run


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_agents_job_saves_stops_and_resumes_elsewhere(tmp_path, stop_signal):
    run = a_run_on_one_of_two_agents(tmp_path)
    first, alloc, buyer = run.first, run.alloc, run.buyer
    try:
        stopped_at = time.time()
        run.agents[run.name].send_signal(stop_signal)
        run.agents[run.name].wait(timeout=GRACE + 15)
        exited = time.time() - stopped_at
        assert not running(first["pid"]), "the job outlived its agent"
        assert exited < GRACE + 5  # within its grace (and the last report)
        ended = buyer.get(f"/allocations/{alloc['id']}").json()
        assert ended["status"] == "preempted", ended
        assert ended["end_reason"] == "final save acknowledged", ended
        assert run.admin.get(f"/nodes/{alloc['node_id']}").json()["state"] == "reclaimed"
        second = run.started_after(first["alloc"])
        # from the final save: no step lost, none done twice
        assert second["start"] == last_step(read_log(run.log), first["alloc"]) + 1 > 10
        assert second["t"] - stopped_at < 15, "resumed at once, not at a deadline"
        run.progress(second["alloc"])
        assert attempts_in_turn(read_log(run.log)) == [first["alloc"], second["alloc"]]
        entries = buyer.get("/ledger").json()["entries"]
        assert not [e for e in entries if e["kind"] == "compensation"]  # nothing was lost
        # the agent starts again: its node is offered again, as it was
        run.start_agent(run.name, "again")
        node = f"/nodes/{alloc['node_id']}"
        wait(lambda: run.admin.get(node).json()["state"] == "live", 30, "the node offered")
        buyer.post(f"/bids/{run.bid['id']}/cancel")
    finally:
        stop_agents(run.agents, run.server, tmp_path)


def test_a_killed_or_quickly_restarted_agent_never_leaves_two_copies_of_a_run(tmp_path):
    run = a_run_on_one_of_two_agents(tmp_path)
    first = run.first
    try:
        # SIGKILL: the guard kills the job before the market can place the run elsewhere
        killed_at = time.time()
        run.agents[run.name].send_signal(signal.SIGKILL)
        run.agents[run.name].wait(timeout=10)
        wait(lambda: not running(first["pid"]), 3, "the job killed by the agent's guard")
        assert time.time() - killed_at < 3  # the market's heartbeat timeout
        second = run.started_after(first["alloc"])
        assert second["start"] > 0  # from its last periodic save
        run.progress(second["alloc"])
        # the survivor's agent: SIGTERM, and at once a new agent on its state directory
        other = next(n for n in run.agents if n != run.name)
        run.agents[other].send_signal(signal.SIGTERM)
        run.start_agent(other, f"{other}-again")
        run.agents[other].wait(timeout=GRACE + 15)
        assert not running(second["pid"])
        # the first node's agent comes back too: the run goes on, one copy at a time
        run.start_agent(run.name, f"{run.name}-again")
        third = run.started_after(first["alloc"], second["alloc"])
        run.progress(third["alloc"])
        order = attempts_in_turn(read_log(run.log))
        assert order[:3] == [first["alloc"], second["alloc"], third["alloc"]]
        live = [e["pid"] for e in read_log(run.log) if "start" in e and running(e["pid"])]
        assert len(live) == 1, live
        run.buyer.post(f"/bids/{run.bid['id']}/cancel")
    finally:
        stop_agents(run.agents, run.server, tmp_path)
