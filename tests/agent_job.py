"""A job the agent tests run: counts steps, checkpoints, answers a notice with a final save.

python agent_job.py STEPS      (JOB_LOG: a JSON-lines progress file shared by all runs;
                                BREAK_STORAGE_ON_NOTICE=1: the checkpoint storage breaks for
                                real when the notice comes, so the final save fails;
                                SLOW_FINAL_SAVE=SECONDS: the final save starts that late)
"""

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from prefect_spotgpu.checkpoint import Checkpointer, storage_from_url

steps = int(sys.argv[1])
log_path = os.environ["JOB_LOG"]
alloc = int(os.environ["SPOTGPU_ALLOCATION_ID"])
ckpt = Checkpointer(
    storage_from_url(os.environ["SPOTGPU_CHECKPOINT_URL"]),
    os.environ["SPOTGPU_CHECKPOINT_KEY"],
    every=0.5,
)
library_handler = signal.getsignal(signal.SIGUSR1)
CONTAINER_GPUS = "NVIDIA_VISIBLE_DEVICES"  # the docker runner's; CUDA_VISIBLE_DEVICES: a process's


def on_sigusr1(signum, frame):
    with open(log_path, "a") as log:
        log.write(json.dumps({"alloc": alloc, "signal": time.time()}) + "\n")
    library_handler(signum, frame)


signal.signal(signal.SIGUSR1, on_sigusr1)
restored = ckpt.restore()
start, total = (restored.step + 1, restored.state["total"]) if restored else (0, 0)
with open(log_path, "a") as log:
    log.write(
        json.dumps(
            {
                "alloc": alloc,
                "start": start,
                "pid": os.getpid(),
                "t": time.time(),
                "gpus": os.environ.get(
                    "CUDA_VISIBLE_DEVICES", os.environ.get("NVIDIA_VISIBLE_DEVICES")
                ),
                "threads": os.environ.get("OMP_NUM_THREADS"),
            }
        )
        + "\n"
    )
for step in range(start, steps):
    time.sleep(0.05)
    total += step
    with open(log_path, "a") as log:
        log.write(json.dumps({"alloc": alloc, "step": step, "t": time.time()}) + "\n")
    if os.environ.get("BREAK_STORAGE_ON_NOTICE") and ckpt.notice_pending():
        key_dir = Path(os.environ["SPOTGPU_CHECKPOINT_URL"], os.environ["SPOTGPU_CHECKPOINT_KEY"])
        shutil.rmtree(key_dir, ignore_errors=True)
        key_dir.write_text("no longer a directory")
    if os.environ.get("SLOW_FINAL_SAVE") and ckpt.notice_pending():
        time.sleep(float(os.environ["SLOW_FINAL_SAVE"]))  # a large state's final save
    ckpt.maybe_save({"total": total}, step)
    if ckpt.notice_received:
        while True:  # saved and acknowledged: the agent stops us
            time.sleep(1)
with open(log_path, "a") as log:
    log.write(json.dumps({"alloc": alloc, "done": total, "t": time.time()}) + "\n")
