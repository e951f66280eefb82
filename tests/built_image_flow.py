"""A user's script that calls a decorated flow in a catalogue image (``test_image_build.py``
runs it as its own process):

    python built_image_flow.py POOL IMAGE STEPS

The flow's code is only here, in ``__main__``: it reaches the node as Prefect's bundle (pickled
by value), and runs in the image ``spotgpu admin image build`` made, which holds
prefect-spotgpu and its dependencies and nothing of this script. It sums the squares of its
steps, checkpointing as it goes; its progress (JSON lines: each attempt's start, its steps,
the final save) goes to the tenant's checkpoint directory as the node mounts it. The script
prints the call's result (or the exception it raised) as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from prefect import flow

from prefect_spotgpu import spot_gpu

POOL, IMAGE, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])


def note(entry: dict) -> None:
    """One line of progress, beside the run's checkpoints (the tenant's directory)."""
    with open(Path(os.environ["SPOTGPU_CHECKPOINT_URL"]) / "walk.jsonl", "a") as out:
        out.write(json.dumps({**entry, "t": time.time()}) + "\n")


@spot_gpu(work_pool=POOL, image=IMAGE, gpu_count=2, max_price=1.5)
@flow(name="built-image-squares")
def squares(steps: int) -> dict:
    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run

    os.umask(0o002)  # each attempt is another uid of the tenant's group
    ckpt = checkpointer_for_run(every=0.3)
    restored = ckpt.restore()
    start, total = (0, 0) if restored is None else (restored.step + 1, restored.state["total"])
    note({"start": start, "alloc": os.environ.get("SPOTGPU_ALLOCATION_ID")})
    for step in range(start, steps):
        total += step * step
        note({"step": step})
        if not ckpt.notice_received and ckpt.notice_pending():
            note({"saved": step})  # said first: the agent stops the job once it is saved
        ckpt.maybe_save({"total": total}, step)
        if ckpt.notice_received:  # saved and acknowledged: the agent stops this process
            time.sleep(max(0.0, (ckpt.notice_deadline or time.time() + 60) - time.time()))
        time.sleep(0.1)
    return {"total": total, "python": sys.executable}


if __name__ == "__main__":
    try:
        result = squares(steps=STEPS)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"result": result}), flush=True)
