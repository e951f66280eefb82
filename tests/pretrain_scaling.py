"""The pretraining flow on one rank and on a gang of two on this machine (gloo, CPU): the step
time of each and the final save of a notice. Prints one JSON object.

    python tests/pretrain_scaling.py [--steps 60] [--width 64] [--layers 2] [--batch 16]

Each run is ``flows/pretrain.py``'s command line (every rank its own process with
torch.distributed's standard environment on loopback). Halfway through, rank 0's notice file
appears; the gang saves its final checkpoint and stops. Step times are rank 0's mean from the
end of the first step to the notice; ``final_save_s`` is the checkpointer's own figure (state,
shard, and for a gang the commit of the gang manifest), ``notice_to_acks_s`` the wall time
from the notice file to the last rank's acknowledgement (the rest of the step in progress,
then the save). ``threads`` is each rank's
``OMP_NUM_THREADS`` (``default``: torch's, one a core).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from prefect_spotgpu.cli.stack import free_port  # noqa: E402
from prefect_spotgpu.protocol import JOB_ENV  # noqa: E402

PACE = re.compile(r"(\d+) steps at ([0-9.]+) ms a step")
SAVED = re.compile(r"final save at step (\d+) \(([0-9.]+) MB in ([0-9.]+) s\)")


def one_run(world_size: int, threads: str, sizes: list[str], steps: int, work: Path) -> dict:
    port = free_port()
    work.mkdir()
    procs, outs, acks = [], [], []
    for rank in range(world_size):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
        if world_size > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
            env.update(MASTER_PORT=str(port))
        if threads != "default":
            env["OMP_NUM_THREADS"] = threads
        env.update(
            PYTHONUNBUFFERED="1",
            **{
                JOB_ENV.NOTICE_FILE: str(work / f"notice-{rank}"),
                JOB_ENV.ACK_FILE: str(work / f"ack-{rank}"),
            },
        )
        outs.append(work / f"rank{rank}.out")
        acks.append(work / f"ack-{rank}")
        command = [sys.executable, str(ROOT / "flows" / "pretrain.py"), "--steps", str(steps)]
        command += [*sizes, "--log-every", "1", "--checkpoints", str(work / "store")]
        with open(outs[-1], "w") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 600
    while outs[0].read_text().count("\nstep ") < steps // 2:
        assert time.monotonic() < deadline and procs[0].poll() is None, outs[0].read_text()
        time.sleep(0.01)
    noticed = time.time()
    (work / "notice-0").write_text(json.dumps({"deadline": noticed + 300}))
    while not all(ack.exists() for ack in acks):
        assert time.monotonic() < deadline, "no acknowledgement"
        time.sleep(0.005)
    acked = max(json.loads(ack.read_text())["saved_at"] for ack in acks)
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=120) == 0, outs[rank].read_text()[-2000:]
    text = outs[0].read_text()
    pace, saved = PACE.search(text), SAVED.search(text)
    return {
        "ranks": world_size,
        "threads": threads,
        "step_ms": float(pace[2]),
        "steps_timed": int(pace[1]),
        "final_save_s": float(saved[3]),
        "shard_mb": float(saved[2]),
        "notice_to_acks_s": round(acked - noticed, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", default="64")
    parser.add_argument("--layers", default="2")
    parser.add_argument("--batch", default="16")
    args = parser.parse_args()
    sizes = ["--width", args.width, "--layers", args.layers, "--batch", args.batch]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (world_size, threads) in enumerate([(1, "default"), (1, "1"), (2, "1")]):
            runs.append(one_run(world_size, threads, sizes, args.steps, Path(tmp) / str(n)))
    one, gang = runs[0], runs[2]
    print(
        json.dumps(
            {
                "cpus": os.cpu_count(),
                "model": {"width": args.width, "layers": args.layers, "batch": args.batch},
                "runs": runs,
                "gang_step_over_one_rank": round(gang["step_ms"] / one["step_ms"], 2),
                "gang_step_over_one_rank_one_thread": round(
                    gang["step_ms"] / runs[1]["step_ms"], 2
                ),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
