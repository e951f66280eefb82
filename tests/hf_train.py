"""A tiny Hugging Face Trainer run (GPT-2 built from a configuration, CPU, no download) with
``SpotTrainerCallback``: the agent tests run it as a job, and once without a market.

python hf_train.py STEPS    (JOB_LOG: a JSON-lines file, one line per step's loss and one with
                             the final weights' SHA-256; SPOTGPU_CHECKPOINT_URL: the storage;
                             OUTPUT: the Trainer's output_dir; STEP_SECONDS: a pause per step)
"""

import hashlib
import json
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from prefect_spotgpu.checkpoint.huggingface import SpotTrainerCallback

steps = int(sys.argv[1])
log_path = os.environ["JOB_LOG"]
attempt = os.environ.get("SPOTGPU_ALLOCATION_ID", "local")


def log(**entry) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps({"attempt": attempt, **entry}) + "\n")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 64, (16,), generator=ids)
        return {"input_ids": tokens, "labels": tokens}


class Losses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            log(step=state.global_step, loss=logs["loss"], pid=os.getpid())

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("STEP_SECONDS", "0")))


torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir=os.environ.get("OUTPUT", "hf-output"), max_steps=steps,
    per_device_train_batch_size=4,
    learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
    seed=0, data_seed=0, disable_tqdm=True,
)  # fmt: skip
spot = SpotTrainerCallback(key="hf-run", every=3600)
log(start=spot.resume_from, pid=os.getpid())
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[spot, Losses()])
trainer.train(resume_from_checkpoint=spot.resume_from)
weights = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    weights.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
log(done=steps, weights=weights.hexdigest())
