"""A tiny FSDP2 training run the DCP tests start with torchrun (gloo, CPU): one JSON line per
step on rank 0 (its loss), saving through ``DistributedCheckpointer`` into this project's
storage, resuming from it (on any world size).

torchrun --nproc-per-node N dcp_train.py STORAGE_URL STEPS LOG
    [env] EVERY: seconds between periodic saves (default 0.2); KEEP (3); SIGNING_KEY;
          NOTICE_DIR: rank r's notice file is NOTICE_DIR/notice-r (its ack: .ack beside it);
          STEP_SECONDS: a pause per step (so a test can notice mid-run); FULL: write the whole
          model and optimizer state (full tensors, rank 0) to this path at the end;
          SAVE_AT: save at this step after the loop
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from prefect_spotgpu.checkpoint import storage_from_url
from prefect_spotgpu.checkpoint.distributed import DistributedCheckpointer

url, steps, log_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
    torch.nn.Linear(64, 1),
)  # fmt: skip
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
notice_dir = os.environ.get("NOTICE_DIR")
ckpt = DistributedCheckpointer(
    storage_from_url(url),
    "run",
    every=float(os.environ.get("EVERY", "0.2")),
    keep=int(os.environ.get("KEEP", "3")),
    signing_key=os.environ.get("SIGNING_KEY") or None,
    notice_file=f"{notice_dir}/notice-{rank}" if notice_dir else None,
)


def state() -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


restored = state()
last = ckpt.restore(restored)
if last is not None:
    set_state_dict(model, optimizer, model_state_dict=restored["model"],
                   optim_state_dict=restored["optim"])  # fmt: skip
start = 0 if last is None else last + 1
pause = float(os.environ.get("STEP_SECONDS", "0"))
for step in range(start, steps):
    batch = torch.Generator().manual_seed(step)  # the data order: by step, on every rank
    x = torch.randn(32, 16, generator=batch)
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        with open(log_path, "a") as log:
            log.write(json.dumps({"world": world, "step": step, "loss": loss.item()}) + "\n")
    ckpt.maybe_save(state, step)
    if ckpt.notice_received:
        if rank == 0:
            with open(log_path, "a") as log:
                log.write(json.dumps({"world": world, "final": step}) + "\n")
        break
    time.sleep(pause)
ckpt.close()
if os.environ.get("SAVE_AT"):  # a save at the last step, whatever the interval
    ckpt.save(state(), int(os.environ["SAVE_AT"]))
if os.environ.get("FULL"):
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    optim = optimizer.state_dict()["state"]
    moments = {f"{i}.{k}": v.full_tensor() for i, s in optim.items() for k, v in s.items()
               if hasattr(v, "full_tensor")}  # fmt: skip
    if rank == 0:
        torch.save({"model": full, "optim": moments}, os.environ["FULL"])
dist.barrier()
# and out, without tearing gloo down: its teardown at exit aborts now and then ("terminate
# called without an active exception", pytorch/pytorch#179291) while a peer still exits
sys.stdout.flush()
os._exit(0)
