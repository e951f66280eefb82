"""The job a spot-gpu flow run's bid carries: get ready, wait for the worker's go, then run
the engine.

The node's agent starts ``python -m prefect_spotgpu.launch`` for every allocation of the bid,
and for a migration target already at the notice (a warm replacement:
docs/users/checkpointing.md#warm-replacement). While it waits until the Prefect worker has
handed this allocation the flow run (the flow run is Pending and its ``spotgpu.allocation``
label names this allocation), a thread gets the flow ready as the engine would load it (the
deployment's pull steps, the flow's module imported) and runs its ``@warm_up`` set-up. At the
go the engine runs *in this process*, on the flow loaded: same process id, so the agent's
SIGUSR1 reaches the flow's own process (docs/operators/architecture.md#design-4), and no
wrapper sits in between. When the flow could not be loaded ahead, this process replaces itself
with ``python -m prefect.engine`` (``exec``), which loads it again and reports the error.

Why wait: one bid serves a flow run across preemptions, and the market starts the next
allocation (a migration) as soon as the previous job stopped, often before the worker has moved
the flow run to ``Scheduled("Preempted")`` and picked it up again. Starting the engine then
would race the worker's state changes; waiting for the worker's label makes the worker the one
writer of the run's state between attempts.

SIGUSR1 is ignored from here until the flow's checkpointer installs its handler (an ignored
disposition survives ``exec``), so an early notice cannot kill the engine; the notice file
still tells the checkpointer. A notice that arrives while waiting ends this attempt at once:
nothing has run, so it acknowledges at once and exits.

A gang member of rank > 0 (``RANK`` set by the agent, not ``"0"``) runs the same flow code
without the engine: rank 0's engine is the one writer of the flow run's state. It waits for the
gang's go: the worker has handed the run to rank 0's allocation of this very attempt (the
``spotgpu.allocation`` label names ``SPOTGPU_GANG_LEAD_ALLOCATION``, and the run is Pending
"Starting" or already Running), so a Running state left from the attempt before is no go. It
loads the flow as the engine would (the deployment's entrypoint, after its pull steps:
``load_flow_from_flow_run``) and calls the flow's function with the run's parameters in this
process. Tasks it calls run outside any flow run. When the function returns, the member waits
for the flow run to end (rank 0's engine still writes its result, its artifacts and its final
state; the market ends a gang with any member's job) and exits 0; when it raises, it exits 1 at
once. A notice while it waits is acknowledged at once: its work is done.

Exit codes: 0 the run is already over (Completed, Failed or Cancelled; Crashed is not over, the
worker reschedules a preempted run) or noticed before it started; 3 no go within
``SPOTGPU_LAUNCH_TIMEOUT`` seconds (default 600).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from uuid import UUID

from prefect_spotgpu.protocol import JOB_ENV, LABELS, TORCH_ENV, RunState


def main() -> int:
    flow_run_id = os.environ["PREFECT__FLOW_RUN_ID"]
    follower = os.environ.get(TORCH_ENV.RANK, "0") != "0"  # a gang member of rank > 0
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # before any thread: see the module doc
    ready = None if follower else Ready(flow_run_id)
    code = wait_for_go()
    if code is not None:
        if ready is not None and not ready.done():  # nothing more to run: no clean-up either
            sys.stdout.flush()
            os._exit(code)
        return code
    if follower:
        code = run_flow_function(flow_run_id)
        return code or until_the_run_ends(flow_run_id)
    flow = ready.flow()
    print(f"spotgpu: go at {time.time():.3f}", flush=True)
    if flow is None:
        os.execv(sys.executable, [sys.executable, "-m", "prefect.engine"])
    from prefect_spotgpu.prefect_internals import run_engine

    return run_engine(flow, flow_run_id)


class Ready:
    """The flow loaded and set up in a thread, while the launcher waits for its go."""

    def __init__(self, flow_run_id: str) -> None:
        self.flow_run_id = flow_run_id
        self._flow = None
        self._thread = threading.Thread(target=self._load, name="spotgpu-ready", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from prefect.flow_engine import load_flow, load_flow_run

        from prefect_spotgpu.checkpoint.warm import run_warm_ups

        try:
            flow = load_flow(load_flow_run(flow_run_id=UUID(self.flow_run_id)))
            seconds = run_warm_ups()
        except Exception as exc:  # the engine loads it again after the go, and says why
            print(f"spotgpu: the flow could not be loaded ahead ({exc!r})", file=sys.stderr)
            return
        self._flow = flow
        print(f"spotgpu: warm at {time.time():.3f} (set-up {seconds:.2f} s)", flush=True)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def flow(self):
        """The flow, once loaded and set up (None when loading failed)."""
        self._thread.join()
        return self._flow


def wait_for_go() -> int | None:
    """Wait for the worker's go (the module doc): None once it is given, or the exit code
    this job ends with instead (0: over or noticed before it started; 3: no go in time)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    flow_run_id = os.environ["PREFECT__FLOW_RUN_ID"]
    allocation = os.environ.get(JOB_ENV.ALLOCATION_ID, "")
    notice_file = _notice_file()
    timeout = _timeout()
    follower = os.environ.get(TORCH_ENV.RANK, "0") != "0"  # a gang member of rank > 0
    lead = os.environ.get(JOB_ENV.GANG_LEAD_ALLOCATION, "")

    from prefect.client.orchestration import get_client

    started = time.monotonic()
    deadline = started + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if notice_file.exists():
                _acknowledge(notice_file)
                print(f"spotgpu: notice before the flow run started (allocation {allocation})")
                return 0
            flow_run = client.read_flow_run(flow_run_id)
            state = flow_run.state
            if state is not None and state.is_final() and not state.is_crashed():
                print(f"spotgpu: flow run {flow_run_id} is already {state.name}; nothing to do")
                return 0  # (Crashed is not the end: the worker reschedules a preempted run)
            if follower:
                if _gang_go(flow_run, lead):
                    return None
            elif (
                state is not None
                and state.is_pending()
                and (flow_run.labels or {}).get(LABELS.ALLOCATION) == allocation
            ):
                return None
            time.sleep(0.1 if time.monotonic() - started < 10 else 1.0)  # then ease off
    print(f"spotgpu: no go from the worker within {timeout:.0f} s", file=sys.stderr)
    return 3


def _notice_file() -> Path:
    return Path(os.environ.get(JOB_ENV.NOTICE_FILE, "/nonexistent/notice"))


def _timeout() -> float:
    return float(os.environ.get(JOB_ENV.LAUNCH_TIMEOUT, "600"))


def _gang_go(flow_run, lead: str) -> bool:
    """The go for a gang member of rank > 0: the worker handed the run to rank 0's allocation
    of this attempt, ``lead`` (Pending "Starting"), or rank 0's engine runs it."""
    state = flow_run.state
    if state is None or not lead or (flow_run.labels or {}).get(LABELS.ALLOCATION) != lead:
        return False
    return state.is_running() or (state.is_pending() and state.name == RunState.STARTING)


def until_the_run_ends(flow_run_id: str) -> int:
    """A member of rank > 0 whose function returned: wait while rank 0's engine finishes the
    flow run (its end is the gang's), then 0. A notice meanwhile is acknowledged at once."""
    from prefect.client.orchestration import get_client

    notice_file, timeout = _notice_file(), _timeout()

    print(f"spotgpu: rank {os.environ.get(TORCH_ENV.RANK)} done; waiting for the flow run's end")
    sys.stdout.flush()
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if notice_file.exists():
                _acknowledge(notice_file)
                return 0
            state = client.read_flow_run(flow_run_id).state
            over = state is None or (state.is_final() and not state.is_crashed())
            if over or state.is_scheduled():
                return 0  # ended, or rescheduled (a new attempt starts every member anew)
            time.sleep(0.5)
    print(f"spotgpu: the flow run did not end within {timeout:.0f} s", file=sys.stderr)
    return 0


def run_flow_function(flow_run_id: str, load=None) -> int:
    """Rank > 0 of a gang: the flow's function with the run's parameters, in this process,
    leaving the flow run's state to rank 0's engine. 0 when it returns, 1 when it raises.
    ``load``: how to get the flow and its parameters (default: the deployment's entrypoint;
    a decorated flow's executor loads them from its bundle)."""
    import asyncio
    import inspect
    import traceback

    from prefect.client.orchestration import get_client
    from prefect.flows import load_flow_from_flow_run
    from prefect.utilities.callables import parameters_to_args_kwargs

    async def from_deployment():
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run_id)
            flow = await load_flow_from_flow_run(flow_run, use_placeholder_flow=False)
            return flow, flow_run.parameters

    rank = os.environ.get(TORCH_ENV.RANK)
    try:
        flow, parameters = load() if load is not None else asyncio.run(from_deployment())
        if flow.should_validate_parameters:
            parameters = flow.validate_parameters(parameters)
        args, kwargs = parameters_to_args_kwargs(flow.fn, parameters)
        print(f"spotgpu: rank {rank} runs {flow.name!r} without the engine ({flow_run_id})")
        sys.stdout.flush()
        result = flow.fn(*args, **kwargs)
        if inspect.iscoroutine(result):  # an async flow's function
            asyncio.run(result)
    except Exception:
        traceback.print_exc()
        print(f"spotgpu: rank {rank} of flow run {flow_run_id} failed", file=sys.stderr)
        return 1
    return 0


def _acknowledge(notice_file: Path) -> None:
    """Nothing ran, so nothing to save: acknowledge at once (as the checkpointer would)."""
    from prefect_spotgpu.checkpoint import write_ack

    write_ack(os.environ.get(JOB_ENV.ACK_FILE) or f"{notice_file}.ack", step=None, started=False)


if __name__ == "__main__":
    sys.exit(main())
