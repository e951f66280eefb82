"""A plain Python script that calls a flow decorated for spot GPUs, as a user's would be
(``tests/test_decorated_flows.py`` runs it as its own process).

    python decorated_flow.py POOL PROGRESS STEPS [--raise]

The flow is ``spot_flow.count``'s checkpointed random walk; the script prints the call's
result (or the exception it raised) as one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow

from prefect_spotgpu import spot_gpu
from spot_flow import count

POOL, PROGRESS, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
if "--steps-long" in sys.argv:  # a run that lasts until it is stopped
    STEPS = 100_000
RAISE = "--raise" in sys.argv


@spot_gpu(work_pool=POOL, gpu_count=2, max_price=1.5)
@flow(name="decorated-count")
def decorated_count(steps: int, progress: str, fail: bool = False) -> dict:
    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run

    if fail:
        raise RuntimeError("the flow raised on purpose")
    return count(checkpointer_for_run(every=0.3), steps, 0.1, Path(progress))


if __name__ == "__main__":
    try:
        result = decorated_count(steps=STEPS, progress=PROGRESS, fail=RAISE)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"result": result}), flush=True)
