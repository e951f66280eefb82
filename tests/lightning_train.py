"""A tiny Lightning run (an MLP, CPU, a resumable dataloader) with ``SpotLightningCheckpoint``:
the agent tests run it as a job, and once without a market.

python lightning_train.py STEPS   (JOB_LOG: one JSON line per step's loss and one with the
                                   final weights' SHA-256; SPOTGPU_CHECKPOINT_URL: the storage;
                                   STEP_SECONDS: a pause per step)
"""

import hashlib
import json
import os
import sys
import time

import lightning
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from prefect_spotgpu.checkpoint.lightning import SpotLightningCheckpoint

steps = int(sys.argv[1])
log_path = os.environ["JOB_LOG"]
attempt = os.environ.get("SPOTGPU_ALLOCATION_ID", "local")


def log(**entry) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps({"attempt": attempt, **entry}) + "\n")


class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        log(step=self.global_step + 1, loss=loss.item(), pid=os.getpid())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Pause(lightning.Callback):
    def on_train_batch_end(self, *args):
        time.sleep(float(os.environ.get("STEP_SECONDS", "0")))


lightning.seed_everything(0, verbose=False)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
# a resumable loader whose shuffling has a generator of its own (saved with the loader's state),
# and one for the loader's seeds: nothing drawn from the global generator, which dropout uses
order = RandomSampler(data, generator=torch.Generator().manual_seed(1))
loader = StatefulDataLoader(data, batch_size=4, sampler=order, generator=torch.Generator())
model = Regression()
spot = SpotLightningCheckpoint(key="lightning-run", every=3600)
log(start=spot.resumed_step, pid=os.getpid())
trainer = lightning.Trainer(
    accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[spot, Pause()],
)  # fmt: skip
trainer.fit(model, loader)
weights = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    weights.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
log(done=steps, weights=weights.hexdigest())
