"""A small training run used by the exact-resume test (run as a separate process).

    python ckpt_train.py CKPT_DIR LOSS_LOG STEPS

Trains a tiny MLP on synthetic data, shuffled each epoch by a seeded generator, checkpointing
every step through the Checkpointer. Appends "step loss.hex()" lines to LOSS_LOG. Stops after a
final save when a notice arrives (SIGUSR1 or the notice file).
"""

import os
import random
import sys

import numpy as np
import torch

from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage, rng_state, set_rng_state

ckpt_dir, log_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
device = torch.device(os.environ.get("SPOTGPU_TEST_DEVICE", "cpu"))  # "cuda" on a GPU node
if device.type == "cuda":
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
data_gen = torch.Generator().manual_seed(1)
X = torch.randn(256, 16, generator=data_gen)
Y = (X @ torch.randn(16, 1, generator=data_gen)).tanh() + 0.1 * torch.randn(
    256, 1, generator=data_gen
)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
order_gen = torch.Generator().manual_seed(2)
batch, epoch_order, position = 32, None, 0

ckpt = Checkpointer(LocalStorage(ckpt_dir), "exact-resume", every=0.000001, keep=2)
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

with open(log_path, "a") as log:
    for step in range(start, steps):
        if epoch_order is None or position >= len(X):
            epoch_order, position = torch.randperm(len(X), generator=order_gen), 0
        idx = epoch_order[position : position + batch].to(device)
        position += batch
        loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
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
            sys.exit(0)
