"""Pretrain a small GPT-style language model on the Python standard library's own source code.

The corpus is on every machine with Python (no download): the ``.py`` files of the standard
library, in sorted order, as bytes (a 256-token vocabulary). The model is a decoder-only
transformer (token and position embeddings, pre-norm blocks of causal self-attention and an MLP,
tied output head). Batches are drawn by a seeded ``torch.Generator`` whose state is part of the
checkpoint, as are the model, the optimizer, every RNG (python, numpy, torch, CUDA) and the
losses so far: a run resumed from a checkpoint continues the *same* loss curve, bit for bit on
the CPU.

    python flows/pretrain.py --steps 300            # locally, without Prefect's server

On a spot-gpu pool, each attempt of a flow run restores the run's latest checkpoint; on a
notice, the next step saves at once and the agent stops the process.
"""

from __future__ import annotations

import math
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from prefect_spotgpu.checkpoint import Checkpointer, rng_state, set_rng_state


@dataclass(frozen=True)
class GPTConfig:
    """Model and run size; the defaults train in about a minute on two CPU cores."""

    steps: int = 300
    batch: int = 16
    block: int = 64  # context length in bytes
    layers: int = 2
    heads: int = 4
    width: int = 64
    lr: float = 3e-3
    dropout: float = 0.1
    corpus_bytes: int = 2_000_000
    seed: int = 1337


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's ``.py`` sources, sorted by path, as one tensor of bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    text = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width)
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.heads = cfg.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(256, cfg.width)
        self.positions = nn.Embedding(cfg.block, cfg.width)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.layers)))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, 256, bias=False)
        self.head.weight = self.tokens.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tokens(idx) + self.positions(pos))))


def train(
    ckpt: Checkpointer,
    cfg: GPTConfig,
    on_notice: Callable[[Checkpointer], None],
    on_progress: Callable[[int, float], None] = lambda step, loss: None,
    device: str = "cpu",
) -> dict:
    """Train (or resume) to ``cfg.steps``; returns the losses of every step, as floats."""
    torch.manual_seed(cfg.seed)
    data = stdlib_corpus(cfg.corpus_bytes)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(cfg.seed + 1)
    losses: list[float] = []
    start = 0
    restored = ckpt.restore()
    if restored is not None:
        state = restored.state
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        batches.set_state(state["batches"])
        set_rng_state(state["rng"])
        losses = [float(x) for x in state["losses"]]
        start = restored.step + 1

    def snapshot() -> dict:
        return {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "batches": batches.get_state(),
            "rng": rng_state(),
            "losses": torch.tensor(losses, dtype=torch.float64),
            "config": asdict(cfg),
        }

    model.train()
    for step in range(start, cfg.steps):
        starts = torch.randint(len(data) - cfg.block - 1, (cfg.batch,), generator=batches)
        x = torch.stack([data[s : s + cfg.block] for s in starts]).to(device)
        y = torch.stack([data[s + 1 : s + cfg.block + 1] for s in starts]).to(device)
        lr = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        on_progress(step, losses[-1])
        ckpt.maybe_save(snapshot, step)
        if ckpt.notice_received:
            on_notice(ckpt)
    return {"losses": losses, "final_loss": losses[-1] if losses else None, "steps": cfg.steps}


def _prefect_flow():
    from prefect import flow, get_run_logger
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run, wait_to_be_stopped

    @flow(name="pretrain", log_prints=False)
    def pretrain(
        steps: int = 300,
        layers: int = 2,
        width: int = 64,
        batch: int = 16,
        checkpoint_minutes: float = 15.0,
    ) -> dict:
        """Pretrain a small GPT on the standard library's source; resumes from checkpoints."""
        logger = get_run_logger()
        cfg = GPTConfig(steps=steps, layers=layers, width=width, batch=batch)
        ckpt = checkpointer_for_run(every=checkpoint_minutes * 60)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        progress = create_progress_artifact(0.0, description="pretraining steps done (%)")
        last = [time.monotonic()]

        def on_progress(step: int, loss: float) -> None:
            if step % 25 == 0 or step == cfg.steps - 1:
                logger.info("step %d/%d loss %.4f", step + 1, cfg.steps, loss)
            if time.monotonic() - last[0] > 2 or step == cfg.steps - 1:
                update_progress_artifact(progress, 100.0 * (step + 1) / cfg.steps)
                last[0] = time.monotonic()

        result = train(ckpt, cfg, wait_to_be_stopped, on_progress, device=device)
        logger.info("done: final loss %.4f after %d steps", result["final_loss"], cfg.steps)
        return result

    return pretrain


pretrain = _prefect_flow()


if __name__ == "__main__":
    import argparse
    import tempfile

    from prefect_spotgpu.checkpoint import LocalStorage
    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped

    parser = argparse.ArgumentParser(description="pretrain a small GPT without Prefect's server")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoints", default=tempfile.mkdtemp(prefix="pretrain-"))
    args = parser.parse_args()
    out = train(
        Checkpointer(LocalStorage(args.checkpoints), "pretrain", every=60),
        GPTConfig(steps=args.steps),
        wait_to_be_stopped,
        lambda step, loss: print(f"step {step + 1} loss {loss:.4f}") if step % 25 == 0 else None,
    )
    print(f"final loss {out['final_loss']:.4f}")
