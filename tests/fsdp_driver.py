"""One rank of ``flows/fsdp_pretrain.py``'s training, as an attempt on a node would run it
(torchrun starts one process a rank).

    torchrun --nproc-per-node N fsdp_driver.py CKPT_DIR RESULT NOTICE_AT STEPS

Rank r's notice file is CKPT_DIR/notice-r; with NOTICE_AT >= 0, rank 1 alone (rank 0 in a world
of one) gets its notice when that step is done: every rank then saves, acknowledges and ends.
Rank 0 writes the losses to RESULT, and "stopped after the final save at STEP" after a notice.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "flows"))

ckpt_dir, result, notice_at, steps = (
    Path(sys.argv[1]),
    sys.argv[2],
    int(sys.argv[3]),
    int(sys.argv[4]),
)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["SPOTGPU_NOTICE_FILE"] = str(ckpt_dir / f"notice-{rank}")
(ckpt_dir / f"notice-{rank}").unlink(missing_ok=True)

import torch.distributed as dist  # noqa: E402
from fsdp_pretrain import GPTConfig, _joined, leave_now, train  # noqa: E402


def at_step(step: int, loss: float) -> None:
    if step == notice_at and rank == min(1, world - 1):
        (ckpt_dir / f"notice-{rank}").write_text(json.dumps({"deadline": 1e12}))


def stopped(ckpt) -> None:
    if rank == 0:
        print(f"stopped after the final save at {ckpt.last_save.step}", flush=True)


with _joined():
    cfg = GPTConfig(steps=steps, corpus_bytes=300_000, dropout=0.0)
    out = train(cfg, storage=str(ckpt_dir / "store"), key="fsdp", on_progress=at_step,
                on_notice=stopped, every=1e9)  # fmt: skip
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    dist.barrier()
    leave_now()
