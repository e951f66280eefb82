"""A flow that counts, logging each step, and answers a notice with a final save, then waits
to be stopped (as every job does): test_run_logs.py reclaims it the way the agent does."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefect import flow, get_run_logger

from prefect_spotgpu.checkpoint.flow import checkpointer_for_run


@flow(name="noticed")
def noticed(steps: int = 100_000) -> int:
    logger = get_run_logger()
    ckpt = checkpointer_for_run(every=3600)
    progress = Path(os.environ["NOTICED_PROGRESS"])
    for step in range(steps):
        logger.info("step %s", step)
        progress.write_text(str(step))
        ckpt.maybe_save({"step": step}, step)
        if ckpt.notice_received:
            logger.info("saved at step %s: waiting to be stopped", step)
            while True:
                time.sleep(1)
        time.sleep(0.05)
    return steps
