"""The job a spot-gpu flow run's bid carries: wait for the worker's go, then become the engine.

The node's agent starts ``python -m prefect_spotgpu.launch`` for every allocation of the bid.
This process waits until the Prefect worker has handed this allocation the flow run (the flow
run is Pending and its ``spotgpu.allocation`` label names this allocation), then *replaces
itself* with ``python -m prefect.engine`` through ``exec``: same process id, so the agent's
SIGUSR1 reaches the flow's own process (DESIGN §4), and no wrapper sits in between.

Why wait: one bid serves a flow run across preemptions, and the market starts the next
allocation (a migration) as soon as the previous job stopped, often before the worker has moved
the flow run to ``Scheduled("Preempted")`` and picked it up again. Starting the engine then
would race the worker's state changes; waiting for the worker's label makes the worker the one
writer of the run's state between attempts.

SIGUSR1 is ignored from here until the flow's checkpointer installs its handler (an ignored
disposition survives ``exec``), so an early notice cannot kill the engine; the notice file
still tells the checkpointer. A notice that arrives while waiting ends this attempt at once:
nothing has run, so it acknowledges at once and exits.

Exit codes: 0 the run is already over (Completed, Failed or Cancelled; Crashed is not over, the
worker reschedules a preempted run) or noticed before it started; 3 no go within
``SPOTGPU_LAUNCH_TIMEOUT`` seconds (default 600).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from prefect_spotgpu.protocol import JOB_ENV, LABELS


def main() -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    flow_run_id = os.environ["PREFECT__FLOW_RUN_ID"]
    allocation = os.environ.get(JOB_ENV.ALLOCATION_ID, "")
    notice_file = Path(os.environ.get(JOB_ENV.NOTICE_FILE, "/nonexistent/notice"))
    timeout = float(os.environ.get(JOB_ENV.LAUNCH_TIMEOUT, "600"))

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
            if (
                state is not None
                and state.is_pending()
                and (flow_run.labels or {}).get(LABELS.ALLOCATION) == allocation
            ):
                break
            time.sleep(0.1 if time.monotonic() - started < 10 else 1.0)  # then ease off
        else:
            print(f"spotgpu: no go from the worker within {timeout:.0f} s", file=sys.stderr)
            return 3
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "prefect.engine"])
    return 0  # pragma: no cover - exec does not return


def _acknowledge(notice_file: Path) -> None:
    """Nothing ran, so nothing to save: acknowledge at once (as the checkpointer would)."""
    from prefect_spotgpu.checkpoint import write_ack

    write_ack(os.environ.get(JOB_ENV.ACK_FILE) or f"{notice_file}.ack", step=None, started=False)


if __name__ == "__main__":
    sys.exit(main())
