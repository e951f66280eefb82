"""A training loop that resumes exactly where a notice stopped it: the full restore example of
docs/users/restore-example.md, run by tests/test_buyer_examples.py through a notice and a resume.

A resumed attempt needs everything the next step depends on: the model's weights, the
optimizer's moments, the learning-rate schedule's position, the order of the data, every random
generator (dropout here) and the losses so far. All of it goes into one checkpoint. ``restore``
gives it back with every tensor on the CPU, whatever device saved it; ``load_state_dict`` puts
each part where the model lives now, which need not be the device of the attempt that saved it.

    python flows/resumable_training.py --steps 3000 --checkpoints /tmp/ckpt
    kill -USR1 <its pid>     # a notice: it saves at once and exits; the same command resumes
"""

from __future__ import annotations

import sys

import torch
from prefect import flow
from torch import nn
from torch.nn import functional as F

from prefect_spotgpu.checkpoint import Checkpointer, rng_state, set_rng_state
from prefect_spotgpu.checkpoint.flow import checkpointer_for_run, wait_to_be_stopped

FEATURES, CLASSES, EXAMPLES, BATCH = 32, 4, 4096, 64


def dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic classification set: the same on every node, nothing to download."""
    draw = torch.Generator().manual_seed(seed)
    inputs = torch.randn(EXAMPLES, FEATURES, generator=draw)
    weights = torch.randn(FEATURES, CLASSES, generator=draw)
    noise = 0.5 * torch.randn(EXAMPLES, CLASSES, generator=draw)
    return inputs, (inputs @ weights + noise).argmax(dim=1)


def build(device: torch.device, steps: int):
    """The model, already on ``device``, its optimizer and its schedule: an optimizer's
    restored moments go to the device its parameters are on when it loads them."""
    model = nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, CLASSES)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    return model, optimizer, schedule


def train(ckpt: Checkpointer, steps: int, device: str = "cpu", on_notice=wait_to_be_stopped):
    """Train to ``steps``, from the newest checkpoint when there is one; every step's loss."""
    device = torch.device(device)
    torch.manual_seed(0)  # the same initial weights in every attempt
    inputs, labels = dataset()
    model, optimizer, schedule = build(device, steps)
    order = torch.Generator().manual_seed(1)  # which examples each step draws
    losses: list[float] = []
    start = 0

    restored = ckpt.restore()  # the newest complete, verified checkpoint, or None
    if restored is not None:
        state = restored.state  # every tensor on the CPU: no map_location to give
        model.load_state_dict(state["model"])  # copied into the parameters, on their device
        optimizer.load_state_dict(state["optimizer"])  # moments moved to their parameters'
        schedule.load_state_dict(state["schedule"])
        order.set_state(state["order"])
        set_rng_state(state["rng"])  # Python's, NumPy's, torch's and CUDA's: the dropout
        losses = state["losses"].tolist()
        start = restored.step + 1
        print(f"resuming at step {start} of {steps}", flush=True)  # the run's logs (log_prints)

    def snapshot() -> dict:  # called only when a save is due: nothing is copied in between
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "order": order.get_state(),
            "rng": rng_state(),
            "losses": torch.tensor(losses, dtype=torch.float64),
        }

    model.train()
    for step in range(start, steps):
        batch = torch.randint(EXAMPLES, (BATCH,), generator=order)
        loss = F.cross_entropy(model(inputs[batch].to(device)), labels[batch].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        ckpt.maybe_save(snapshot, step)  # every `every`; at once, and final, on a notice
        if ckpt.notice_received:  # the final save is durable and acknowledged:
            on_notice(ckpt)  # the node's agent stops this process now
    ckpt.close()  # a periodic save still being written is finished first
    return losses


@flow(name="train-classifier", log_prints=True)
def train_classifier(steps: int = 3000, checkpoint_minutes: float = 15.0) -> dict:
    """Train the classifier on the GPU the run got (the CPU where there is none), resuming
    from the run's newest checkpoint after a preemption."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = checkpointer_for_run(every=checkpoint_minutes * 60)  # the run's storage and key
    losses = train(ckpt, steps, device)
    return {"device": device, "steps": steps, "final_loss": losses[-1], "losses": losses}


def main(argv: list[str] | None = None) -> None:
    """Run the loop here, without Prefect's server: a SIGUSR1 is a notice (the final save, then
    exit 0); the same command resumes from the checkpoint."""
    import argparse

    from prefect_spotgpu.checkpoint import LocalStorage

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--checkpoints", required=True, help="a directory for the checkpoints")
    parser.add_argument("--checkpoint-minutes", type=float, default=1.0)
    args = parser.parse_args(argv)
    ckpt = Checkpointer(
        LocalStorage(args.checkpoints), "resumable-training", every=args.checkpoint_minutes * 60
    )

    def stop(ckpt: Checkpointer) -> None:
        print(f"noticed: saved step {ckpt.last_save.step}; the same command resumes", flush=True)
        sys.exit(0)

    losses = train(ckpt, args.steps, "cuda" if torch.cuda.is_available() else "cpu", stop)
    print(f"final loss {losses[-1]:.4f} after {args.steps} steps")


if __name__ == "__main__":
    main()
