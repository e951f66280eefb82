"""A ``prefect worker start --type spot-gpu`` process told to stop (SIGTERM, SIGINT) exits within
seconds, also while it follows a run and while Prefect does not answer it, and leaves the run to
the next worker: the bid stays open, the job runs on, and the next worker adopts the run.

Real parts (docs/operators/architecture.md#design-8): the Prefect test server, the market service,
a node agent and the workers as processes, real signals. The workers reach Prefect through a TCP
relay (``Gate``) that a test can cut, as a network partition would; the jobs reach Prefect directly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit
from uuid import UUID

import pytest

from conftest import wait_for
from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
from prefect_spotgpu.cli.stack import LocalStack
from spot_flow import count
from test_worker_e2e import bid_of, hurry, progress_of, running_allocation, steps_done

HERE = Path(__file__).parent
POOL = "spot-shutdown"
STEPS = 400  # 40 s of work: still running when the next worker has started
EXIT_SECONDS = 10.0  # generous: it takes about 1 s, at most about 4.5 s (its last words to
# Prefect are bounded by RELEASE_SECONDS + FLUSH_SECONDS); it took 108 s cut off from Prefect

pytestmark = pytest.mark.slow


class Gate:
    """A TCP relay to the Prefect API. ``cut()``: connections are accepted and then nothing
    answers (a network partition: calls hang until their timeouts); ``restore()`` undoes it."""

    def __init__(self, api_url: str) -> None:
        parts = urlsplit(api_url)
        self.target = (parts.hostname, parts.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}{parts.path}"
        self.open = True
        self.lock = threading.Lock()
        self.relayed: set[socket.socket] = set()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if not self.open:
                    self.held.append(client)
                    continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.relayed |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                _drop(end)
            with self.lock:
                self.relayed -= {source, sink}

    def cut(self) -> None:
        with self.lock:
            self.open = False
            relayed = list(self.relayed)
        for end in relayed:  # open connections break; new ones hang
            _drop(end)

    def restore(self) -> None:
        with self.lock:
            self.open = True
            held, self.held = self.held, []
        for end in held:
            _drop(end)

    def close(self) -> None:
        self.cut()
        self.listener.close()


def _drop(end: socket.socket) -> None:
    with contextlib.suppress(OSError):
        end.shutdown(socket.SHUT_RDWR)
    end.close()


@pytest.fixture(scope="module")
def gate(prefect_api_url):
    gate = Gate(prefect_api_url)
    yield gate
    gate.close()


@pytest.fixture(scope="module")
def stack(prefect_api_url, gate, tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    with LocalStack(home, gate.url, heartbeat_timeout_seconds=10) as stack:
        stack.start_market()
        stack.start_agent("node-a", gpus=4)
        stack.create_pool(POOL, defaults={"gpu_count": 2, "max_price": 1.5})
        stack.deployment = stack.deploy("spot_flow.py:spot_count", HERE, "shutdown", POOL)
        stack.direct_api_url = prefect_api_url
        yield stack


def start_run(prefect, stack, tmp_path) -> tuple[UUID, Path]:
    """A run whose job reaches Prefect directly (not through the gate)."""
    progress = tmp_path / "progress.jsonl"
    run = prefect.create_flow_run_from_deployment(
        UUID(stack.deployment),
        parameters={"steps": STEPS, "step_seconds": 0.1, "progress": str(progress)},
        job_variables={"env": {"PREFECT_API_URL": stack.direct_api_url}},
    )
    return run.id, progress


def follow(prefect, stack, tmp_path, name: str) -> tuple[UUID, Path, int]:
    """A run Running on an allocation, followed by the worker process ``name``."""
    run_id, progress = start_run(prefect, stack, tmp_path)
    allocation = running_allocation(prefect, run_id)
    wait_for(lambda: steps_done(progress) >= 5, 60, "progress")
    bid = bid_of(stack, prefect, run_id)["id"]
    wait_for(lambda: f"Following bid {bid}" in stack.log(name, 100_000), 30, "the worker follows")
    return run_id, progress, allocation


def stop(stack, name: str, sig: int) -> tuple[float, int | None]:
    """Send ``sig`` to the worker process (not its group: as a service manager does) and wait
    for it to exit; the seconds it took and its exit status (None: still running after 60 s,
    then killed)."""
    process: subprocess.Popen = stack.processes[name]
    started = time.monotonic()
    os.kill(process.pid, sig)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stack.kill(name)
        code = None
    seconds = time.monotonic() - started
    print(f"worker {name}: {signal.Signals(sig).name} -> exit status {code} after {seconds:.1f} s")
    return seconds, code


def worker_name(name: str) -> str:
    return f"{name}-{os.getpid()}"  # as LocalStack.start_worker names it


def assert_left_running(stack, prefect, run_id, progress, allocation) -> None:
    """Nothing was cancelled: the bid is open, the job runs on with no worker, the run is
    still Running."""
    assert bid_of(stack, prefect, run_id)["status"] == "open"
    assert stack.market().get(f"/allocations/{allocation}").json()["status"] == "running"
    assert prefect.read_flow_run(run_id).state.is_running()
    done = steps_done(progress)
    wait_for(lambda: steps_done(progress) > done + 5, 30, "the job going on without a worker")


def assert_completed_once(stack, prefect, name, run_id, progress, allocation) -> None:
    """The run, adopted by the worker ``name``, completes on its first allocation, with the
    uninterrupted result, and that worker follows it to its end."""
    # adopted: the rest of the run need not pace. At once, so the run often ends while the
    # worker takes it over (a worker that then proposed Pending knocked it back from Completed)
    hurry(progress)
    wait_for(lambda: prefect.read_flow_run(run_id).state.is_completed(), 120, "Completed", 0.2)
    ended = f"Flow run ended Completed on allocation {allocation}"
    wait_for(lambda: ended in stack.log(name, 100_000), 90, "the worker seeing the run end")
    run = prefect.read_flow_run(run_id)
    assert run.run_count == 1 and run.labels["spotgpu.allocation"] == str(allocation)
    starts = [e for e in progress_of(progress) if "start" in e]
    assert [s["alloc"] for s in starts] == [str(allocation)]  # never restarted
    reference = Checkpointer(LocalStorage(progress.parent / "reference"), "ref", every=1e9)
    assert [e["done"] for e in progress_of(progress) if "done" in e] == [
        count(reference, STEPS, 0.0, None)
    ]
    bids = [
        b
        for b in stack.market().get("/bids", params={"limit": 1000}).json()
        if (b["labels"] or {}).get("prefect.flow-run-id") == str(run_id)
    ]
    assert len(bids) == 1  # no duplicate bid


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])  # SIGINT: the test below
def test_a_signalled_worker_exits_within_seconds_and_the_next_worker_adopts_its_run(
    stack, prefect, tmp_path, sig
):
    first, second = f"first-{sig.name}", f"second-{sig.name}"
    stack.start_worker(POOL, name=first)
    run_id, progress, allocation = follow(prefect, stack, tmp_path, first)

    seconds, code = stop(stack, first, sig)
    assert code == 0 and seconds < EXIT_SECONDS, (seconds, code, stack.log(first))
    assert "left to the next worker" in stack.log(first)
    assert_left_running(stack, prefect, run_id, progress, allocation)
    labels = prefect.read_flow_run(run_id).labels
    assert labels["spotgpu.released-by"] == labels["prefect.worker.name"] == worker_name(first)

    # a worker of another name adopts it at its start, not 3 heartbeats (90 s) later
    stack.start_worker(POOL, name=second)
    wait_for(
        lambda: f"Adopting flow run {run_id}" in stack.log(second, 100_000), 30, "the adoption"
    )
    assert_completed_once(stack, prefect, second, run_id, progress, allocation)
    seconds, code = stop(stack, second, sig)  # idle now
    assert code == 0 and seconds < EXIT_SECONDS, (seconds, code, stack.log(second))


def test_a_worker_that_prefect_does_not_answer_still_exits_within_seconds(
    stack, prefect, gate, tmp_path
):
    """Cut off from Prefect, the worker cannot release its run nor send its last logs and
    events (Prefect's own exit would wait on their retries for minutes); it gives up on them
    after a few seconds. Restarted under its name, it adopts the run at once."""
    stack.start_worker(POOL, name="cut-off")
    run_id, progress, allocation = follow(prefect, stack, tmp_path, "cut-off")
    gate.cut()
    try:
        wait_for(lambda: len(gate.held) > 0, 30, "a call to Prefect hanging at the cut")
        seconds, code = stop(stack, "cut-off", signal.SIGINT)  # Ctrl-C, where SIGTERM is above
    finally:
        gate.restore()
    assert code == 0 and seconds < EXIT_SECONDS, (seconds, code, stack.log("cut-off"))
    assert_left_running(stack, prefect, run_id, progress, allocation)

    stack.start_worker(POOL, name="cut-off")  # restarted by its service manager
    wait_for(
        lambda: f"Adopting flow run {run_id}" in stack.log("cut-off", 100_000), 30, "the adoption"
    )
    assert_completed_once(stack, prefect, "cut-off", run_id, progress, allocation)
    seconds, code = stop(stack, "cut-off", signal.SIGTERM)  # idle now
    assert code == 0 and seconds < EXIT_SECONDS, (seconds, code, stack.log("cut-off"))
