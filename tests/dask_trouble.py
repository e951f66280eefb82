"""Trouble for a spot Dask cluster on a ``LocalStack``: nodes reclaimed (a notice) and an agent
killed with SIGKILL (with its jobs: a lost node), at random moments as outputs appear. Used by
``tests/test_dask_cluster.py`` and ``benchmarks/fanout_dask.py``."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable


class Trouble(threading.Thread):
    """For each ``(what, (low, high))`` of ``plan`` (``what``: ``reclaim`` or ``kill``), waits
    until ``progress()`` reaches a random point of the stretch, then hits a node that runs an
    allocation; a reclaimed node is live again ``back_seconds`` later, a killed agent is
    started again once the market has lost its node (past its heartbeat timeout)."""

    def __init__(self, stack, progress: Callable[[], int], plan, *, seed: int = 7,
                 back_seconds: float = 1.5, gpus: int = 2) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.stack, self.progress, self.plan = stack, progress, plan
        self.rng, self.back_seconds, self.gpus = random.Random(seed), back_seconds, gpus
        self.done = threading.Event()
        self.log: list[tuple[float, str, int, int]] = []  # (time, what, node, progress)
        self.error: BaseException | None = None
        self.restarts: list[threading.Thread] = []

    def busy_nodes(self) -> list[int]:
        allocations = self.stack.market().get("/allocations?active=true").json()
        return sorted({a["node_id"] for a in allocations if a["status"] == "running"})

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the test reports it
            self.error = exc

    def _run(self) -> None:
        owner = self.stack.market(self.stack.owner_key)
        for what, (low, high) in self.plan:
            target = self.rng.randint(low, high)
            while self.progress() < target and not self.done.is_set():
                time.sleep(0.02)
            nodes = self.busy_nodes()
            if self.done.is_set() or not nodes:
                break
            node = self.rng.choice(nodes)
            name = self.stack.nodes[node]
            self.log.append((time.time(), what, node, self.progress()))
            if what == "reclaim":
                owner.patch(f"/nodes/{node}", json={"state": "reclaimed"}).raise_for_status()
                time.sleep(self.back_seconds)
                owner.patch(f"/nodes/{node}", json={"state": "live"}).raise_for_status()
            else:
                jobs = self.stack.job_pids(name)
                self.stack.kill(f"agent-{name}")
                for pid in jobs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                back = threading.Thread(target=self._restart, args=(owner, node, name))
                back.start()  # the work goes on meanwhile (and so may the next trouble)
                self.restarts.append(back)
        for back in self.restarts:
            back.join()

    def _restart(self, owner, node: int, name: str) -> None:
        try:
            self._lost(owner, node)
            self.stack.start_agent(name, gpus=self.gpus)
        except BaseException as exc:
            self.error = exc

    def _lost(self, owner, node: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = {n["id"]: n["state"] for n in owner.get("/nodes").json()}
            if states.get(node) != "live":
                return
            time.sleep(0.2)
