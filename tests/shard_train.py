"""One rank of a 2-rank DDP training run for the gang exact-resume test (a process per rank).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python shard_train.py STORAGE_URL LOSS_LOG STEPS

Trains a tiny MLP (with dropout) under DistributedDataParallel on gloo: one global order of
the data per epoch from a seeded generator, each rank its slice of every batch. The
checkpointer comes from ``checkpointer_for_run`` (rank and world size from the environment),
saving every step; the notice, ack and saved files are the usual ``SPOTGPU_*`` variables.
Appends "step loss.hex()" lines to LOSS_LOG; stops after a final save. An ``s3://`` storage
goes to ``SPOTGPU_TEST_S3_ENDPOINT``.
"""

import logging
import os
import random
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from prefect_spotgpu.checkpoint import rng_state, set_rng_state, storage_from_url
from prefect_spotgpu.checkpoint.flow import checkpointer_for_run

url, log_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world_size = dist.get_rank(), dist.get_world_size()
data_gen = torch.Generator().manual_seed(1)
X = torch.randn(256, 16, generator=data_gen)
Y = (X @ torch.randn(16, 1, generator=data_gen)).tanh() + 0.1 * torch.randn(
    256, 1, generator=data_gen
)
torch.manual_seed(0)  # the same initial model everywhere
model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
)
torch.manual_seed(100 + rank)  # each rank its own dropout
random.seed(rank)
np.random.seed(rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
order_gen = torch.Generator().manual_seed(2)  # the same order on every rank
batch, epoch_order, position = 16, None, 0

endpoint = os.environ.get("SPOTGPU_TEST_S3_ENDPOINT")
options = {"endpoint_url": endpoint, "region_name": "us-east-1"} if endpoint else {}
ckpt = checkpointer_for_run(storage_from_url(url, **options), key="exact-resume", every=1e-6)
assert (ckpt.rank, ckpt.world_size) == (rank, world_size)
start = 0
restored = ckpt.restore()
if restored is not None:
    s = restored.state
    model.load_state_dict(s["model"])
    opt.load_state_dict(s["opt"])
    set_rng_state(s["rng"])
    order_gen.set_state(s["order_gen"])
    epoch_order, position = s["epoch_order"], s["position"]
    start = restored.step + 1
ddp = DistributedDataParallel(model)

with open(log_path, "a") as log:
    for step in range(start, steps):
        if epoch_order is None or position >= len(X):
            epoch_order, position = torch.randperm(len(X), generator=order_gen), 0
        mine = position + rank * batch
        idx = epoch_order[mine : mine + batch]
        position += batch * world_size
        loss = torch.nn.functional.mse_loss(ddp(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(f"{step} {loss.item().hex()}\n")
        log.flush()
        ckpt.maybe_save(
            lambda epoch_order=epoch_order, position=position: {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "rng": rng_state(),
                "order_gen": order_gen.get_state(),
                "epoch_order": epoch_order,
                "position": position,
            },
            step,
        )
        if ckpt.notice_received:
            break
dist.destroy_process_group()
