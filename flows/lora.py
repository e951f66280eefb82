"""Fine-tune a causal language model with LoRA (``peft``) under Hugging Face's ``Trainer`` on
spot GPUs: a notice saves and stops, the next attempt resumes on the same curve.

The base model is a small GPT-2 built from a configuration (no download: bring your own with
``AutoModelForCausalLM.from_pretrained`` on a node that has it); the data are 64-byte windows of
the Python standard library's source (a byte vocabulary), as in ``pretrain.py``. Only the
adapters (LoRA on the attention's ``c_attn``) train. ``SpotTrainerCallback`` makes a notice a
save-then-stop into the run's storage and gives the next attempt its checkpoint
(docs/users/recipes.md); the adapter, when done, goes to the run's storage
(``outputs/lora-adapter/``), never to a path of the job.

    python flows/lora.py --steps 60 --log /tmp/lora.jsonl    # locally, no Prefect server
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from pretrain import stdlib_corpus

BLOCK = 64  # bytes of context a sample


class Windows(torch.utils.data.Dataset):
    """``count`` windows of the corpus, at offsets fixed by a seed: the same data everywhere."""

    def __init__(self, corpus: torch.Tensor, count: int, seed: int = 0) -> None:
        starts = torch.randint(0, len(corpus) - BLOCK, (count,), generator=torch.Generator()
                               .manual_seed(seed))  # fmt: skip
        self.corpus, self.starts = corpus, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        tokens = self.corpus[self.starts[i] : self.starts[i] + BLOCK]
        return {"input_ids": tokens, "labels": tokens}


def fine_tune(steps: int, *, output_dir: str, log=None, spot=None, step_seconds: float = 0.0):
    """Train the adapters for ``steps`` steps (resuming from ``spot.resume_from``); the
    trained model and the losses by step. ``output_dir``: the Trainer's scratch (a temporary
    directory: what must last goes to the run's storage, by the callback and the flow)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from prefect_spotgpu.checkpoint.huggingface import SpotTrainerCallback

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2,
                                      n_head=4))  # fmt: skip
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                            lora_dropout=0.05, fan_in_fan_out=True))  # fmt: skip
    losses: dict[int, float] = {}

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]
                if log is not None:
                    log(step=state.global_step, loss=logs["loss"])

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(step_seconds)

    spot = spot or SpotTrainerCallback()
    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
        learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, disable_tqdm=True,
    )  # fmt: skip
    data = Windows(stdlib_corpus(200_000), count=512)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[spot, Progress()])
    trainer.train(resume_from_checkpoint=spot.resume_from)
    return model, losses


def adapter_bytes(model) -> tuple[bytes, str]:
    """The trained adapter's weights as one file's bytes (safetensors), and their SHA-256."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    data = save(dict(sorted(state.items())))
    return data, hashlib.sha256(data).hexdigest()


def _prefect_flow():
    from prefect import flow, get_run_logger

    from prefect_spotgpu.checkpoint.flow import run_outputs

    @flow(name="lora")
    def lora(steps: int = 200) -> dict:
        """LoRA fine-tuning of a small causal language model; resumes from checkpoints."""
        logger = get_run_logger()
        model, losses = fine_tune(steps, output_dir=tempfile.mkdtemp(prefix="lora-"))
        data, digest = adapter_bytes(model)
        objects, prefix = run_outputs("lora-adapter")
        objects.put(f"{prefix}/adapter_model.safetensors", data)
        logger.info("adapter %s (%d bytes) in the run's storage at %s", digest[:12], len(data),
                    prefix)  # fmt: skip
        return {"losses": [losses[s] for s in sorted(losses)], "adapter_sha256": digest}

    return lora


def main(argv: list[str] | None = None) -> None:
    """Without Prefect's server: train, resume from the run's storage
    (``SPOTGPU_CHECKPOINT_URL``, key ``--key``), append each step's loss and the adapter's
    SHA-256 to ``--log`` as JSON lines."""
    import argparse

    from prefect_spotgpu.checkpoint.huggingface import SpotTrainerCallback

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--key", default="lora")
    parser.add_argument("--log", default=os.environ.get("JOB_LOG"))
    parser.add_argument("--step-seconds", type=float,
                        default=float(os.environ.get("STEP_SECONDS", "0")))  # fmt: skip
    args = parser.parse_args(argv)
    attempt = os.environ.get("SPOTGPU_ALLOCATION_ID", "local")

    def log(**entry) -> None:
        if args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps({"attempt": attempt, **entry}) + "\n")

    spot = SpotTrainerCallback(key=args.key, every=3600)
    log(start=spot.resume_from, pid=os.getpid())
    scratch = tempfile.mkdtemp(prefix="lora-")
    model, _ = fine_tune(args.steps, output_dir=scratch, log=log, spot=spot,
                         step_seconds=args.step_seconds)  # fmt: skip
    log(done=args.steps, weights=adapter_bytes(model)[1])


if __name__ == "__main__":
    main()
else:
    lora = _prefect_flow()
