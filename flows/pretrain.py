"""Pretrain a small GPT-style language model on the Python standard library's own source code.

The corpus is on every machine with Python (no download): the ``.py`` files of the standard
library, in sorted order, as bytes (a 256-token vocabulary). The model is a decoder-only
transformer (token and position embeddings, pre-norm blocks of causal self-attention and an MLP,
tied output head). Batches are drawn by a seeded ``torch.Generator`` whose state is part of the
checkpoint, as are the model, the optimizer, every RNG (python, numpy, torch, CUDA) and the
losses so far: a run resumed from a checkpoint continues the *same* loss curve, bit for bit on
the CPU.

    python flows/pretrain.py --steps 300            # locally, without Prefect's server
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python flows/pretrain.py --checkpoints /tmp/gang   # and RANK=1 alike: a gang of two

On a spot-gpu pool, each attempt of a flow run restores the run's latest checkpoint; on a
notice, the next step saves at once and the agent stops the process.

**A gang** (``node_count`` nodes, docs/users/gangs.md) trains data-parallel: one process per node,
each with torch.distributed's standard environment (``MASTER_ADDR``/``MASTER_PORT`` of rank 0, and
``RANK``/``WORLD_SIZE`` or ``NODE_RANK``/``NNODES``). With a world size above one, every rank
joins the process group (NCCL when CUDA is available, else gloo; ``env://``), wraps the model
in ``DistributedDataParallel`` and takes its own equal share of every batch (``batch`` is the
global batch: the same starts drawn by the same seeded generator on every rank, rank ``r`` the
``r``-th slice), so the global loss, the mean of the ranks' losses, follows one curve however
often the gang is stopped and resumed. Each rank saves its own shard of the run's gang
checkpoint (``Checkpointer(rank=, world_size=)``; the model and optimizer are the same on
every rank, the dropout RNG is not). Rank 0 is the flow run (``python -m prefect.engine``): it
alone logs the losses and updates the progress artifact. Every other rank runs the same
training outside Prefect, each of the flow run's parameters as its flag (``steps`` as
``--steps``, ``checkpoint_minutes`` as ``--checkpoint-minutes``, ...)::

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=<rank 0's address> MASTER_PORT=29500 \
    PREFECT__FLOW_RUN_ID=<the flow run's id> SPOTGPU_CHECKPOINT_URL=<the run's storage> \
        python flows/pretrain.py --steps 3000 --checkpoint-minutes 15 --after-notice wait

(the checkpoint key is the flow run's, as on rank 0; the signing key and the notice, ack and
saved files are the usual ``SPOTGPU_*`` variables). From Python, ``pretrain.fn(**parameters)``
does the same: outside a flow run the flow's body only trains.
"""

from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from prefect_spotgpu.checkpoint import Checkpointer, TorchGroupSync, rng_state, set_rng_state
from prefect_spotgpu.checkpoint.flow import (
    checkpointer_for_run,
    rank_from_environment,
    wait_to_be_stopped,
)
from prefect_spotgpu.checkpoint.group import same_everywhere
from prefect_spotgpu.protocol import JOB_ENV


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


@contextmanager
def process_group() -> Iterator[tuple[int, int]]:
    """Join the gang the environment names and leave it on exit: ``(rank, world_size)``.

    World size 1 (no torch.distributed variables): nothing is initialised. Otherwise the
    default process group, NCCL on this node's GPU (``LOCAL_RANK``, default 0) when CUDA is
    available, else gloo, rendezvous at ``MASTER_ADDR:MASTER_PORT`` (``env://``); the rank and
    world size are passed explicitly, so ``NODE_RANK``/``NNODES`` alone will do.
    """
    rank, world_size = rank_from_environment()
    if world_size == 1:
        yield rank, world_size
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"rank {rank} of {world_size} needs {' and '.join(missing)}: rank 0's address and port"
        )
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
    try:
        yield rank, world_size
        dist.barrier()  # leave together: rank 0 hosts the store the others may still be using
    finally:
        dist.destroy_process_group()


def train(
    ckpt: Checkpointer,
    cfg: GPTConfig,
    on_notice: Callable[[Checkpointer], None],
    on_progress: Callable[[int, float], None] = lambda step, loss: None,
    device: str = "cpu",
) -> dict:
    """Train (or resume) to ``cfg.steps``; returns the losses of every step, as floats.

    With a gang checkpointer (``ckpt.world_size > 1``, inside :func:`process_group`) this is
    rank ``ckpt.rank``'s part of data-parallel training: its share of every batch, gradients
    averaged by ``DistributedDataParallel``, and the losses returned (and checkpointed) are
    the gang's, the mean over the ranks, the same on every rank. World size 1 is the plain
    run: its losses and its checkpoint's format do not depend on any of this.
    """
    rank, world_size = ckpt.rank, ckpt.world_size
    if cfg.batch % world_size:
        raise ValueError(f"batch={cfg.batch} does not split evenly over {world_size} ranks")
    share = cfg.batch // world_size
    torch.manual_seed(cfg.seed)
    data = stdlib_corpus(cfg.corpus_bytes)
    model = GPT(cfg).to(device)  # the same initial model on every rank
    if world_size > 1:
        _check_same_run(cfg, data)
        torch.manual_seed(cfg.seed + 10_000 + rank)  # each rank its own dropout
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(cfg.seed + 1)  # the same starts on every rank
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
    net = model
    if world_size > 1:  # after the restore: DDP starts from rank 0's weights, now everyone's
        on_gpu = torch.device(device).type == "cuda"
        net = DistributedDataParallel(
            model, device_ids=[torch.cuda.current_device()] if on_gpu else None
        )

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
        x, y = rank_batch(data, cfg, batches, rank * share, share, device)
        set_learning_rate(opt, cfg, step)
        loss = F.cross_entropy(net(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(_gang_loss(loss, world_size))
        on_progress(step, losses[-1])
        ckpt.maybe_save(snapshot, step)
        if ckpt.notice_received:
            on_notice(ckpt)
    return {"losses": losses, "final_loss": losses[-1] if losses else None, "steps": cfg.steps}


def rank_batch(
    data: torch.Tensor, cfg: GPTConfig, draw: torch.Generator, first: int, share: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's windows of the corpus, drawn by ``draw`` (the same on every rank): this
    rank's ``share`` of them from the ``first``-th, as inputs and next-byte targets."""
    starts = torch.randint(len(data) - cfg.block - 1, (cfg.batch,), generator=draw)
    starts = starts[first : first + share]
    x = torch.stack([data[s : s + cfg.block] for s in starts]).to(device)
    y = torch.stack([data[s + 1 : s + cfg.block + 1] for s in starts]).to(device)
    return x, y


def set_learning_rate(opt: torch.optim.Optimizer, cfg: GPTConfig, step: int) -> None:
    """Warm up over 20 steps, then a cosine to 0 at ``cfg.steps``."""
    lr = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
    for group in opt.param_groups:
        group["lr"] = lr


def _gang_loss(loss: torch.Tensor, world_size: int) -> float:
    """The loss of the whole batch: the mean of the ranks' (their shares are equal)."""
    if world_size == 1:
        return loss.item()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / world_size).item()


def _check_same_run(cfg: GPTConfig, data: torch.Tensor) -> None:
    """Every rank must train the same configuration on the same corpus (the same Python's
    standard library on every node), or the ranks would average unrelated gradients."""
    digest = zlib.crc32(json.dumps(asdict(cfg), sort_keys=True).encode())
    digest = zlib.crc32(data.to(torch.uint8).numpy().tobytes(), digest)
    if not same_everywhere(TorchGroupSync(), digest):
        raise ValueError(
            "the ranks of this gang do not train the same configuration on the same corpus: "
            "give every rank the same parameters, and every node the same image"
        )


def run(
    cfg: GPTConfig,
    *,
    every: float,
    storage: str | None = None,
    key: str | None = None,
    on_notice: Callable[[Checkpointer], None] = wait_to_be_stopped,
    on_progress: Callable[[int, float], None] = lambda step, loss: None,
) -> dict:
    """One rank's whole part: join the gang (:func:`process_group`), take the run's
    checkpointer (``checkpointer_for_run``: storage and key from the arguments or the
    environment, rank and world size from the environment), train on CUDA or the CPU, leave
    the gang. ``every``: seconds between periodic checkpoints. Only rank 0 reports progress."""
    with process_group() as (rank, _):
        ckpt = checkpointer_for_run(storage, key=key, every=every)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        report = on_progress if rank == 0 else (lambda step, loss: None)  # the run is rank 0's
        try:
            return train(ckpt, cfg, on_notice, report, device=device)
        finally:
            ckpt.close()  # a save still in flight is written before the gang is left


def leave_now() -> NoReturn:
    """End a gang rank's process at once, its output flushed, without the interpreter's
    teardown; everything is written by then (the result, the checkpoints: ``run`` closes its
    checkpointer).

    Why: gloo's worker threads outlive ``destroy_process_group`` (torch keeps the group
    referenced once DDP has used it), and one that frees a finished collective's work after
    the main thread has begun the interpreter's exit must take the GIL to release the work's
    tensors, and aborts the whole process instead: "terminate called without an active
    exception", exit -6, after a run that completed (read off a core dump: the worker thread in
    ``~AsyncBarrierWork`` -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` -> ``take_gil``
    while the main thread was in ``Py_FinalizeEx``; the same race as in
    https://github.com/pytorch/pytorch/pull/179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _prefect_flow():
    from prefect import flow, get_run_logger
    from prefect.artifacts import (
        create_progress_artifact,
        create_table_artifact,
        update_progress_artifact,
    )
    from prefect.context import FlowRunContext

    @flow(name="pretrain", log_prints=False)
    def pretrain(
        steps: int = 300,
        layers: int = 2,
        width: int = 64,
        batch: int = 16,
        checkpoint_minutes: float = 15.0,
    ) -> dict:
        """Pretrain a small GPT on the standard library's source; resumes from checkpoints.

        On a gang every rank runs this with the same parameters: rank 0 as the flow run, the
        others as ``pretrain.fn(...)`` outside any flow run, where it only trains."""
        cfg = GPTConfig(steps=steps, layers=layers, width=width, batch=batch)
        every = checkpoint_minutes * 60
        rank, world_size = rank_from_environment()
        if rank > 0 or FlowRunContext.get() is None:
            return run(cfg, every=every)
        logger = get_run_logger()
        if world_size > 1:
            logger.info(
                "rank 0 of a gang of %d: data-parallel, batch %d a rank",
                world_size,
                batch // world_size,
            )
        progress = create_progress_artifact(0.0, description="pretraining steps done (%)")
        last = [time.monotonic()]

        def on_progress(step: int, loss: float) -> None:
            if step % 25 == 0 or step == cfg.steps - 1:
                logger.info("step %d/%d loss %.4f", step + 1, cfg.steps, loss)
            if time.monotonic() - last[0] > 2 or step == cfg.steps - 1:
                update_progress_artifact(progress, 100.0 * (step + 1) / cfg.steps)
                last[0] = time.monotonic()

        result = run(cfg, every=every, on_progress=on_progress)
        logger.info("done: final loss %.4f after %d steps", result["final_loss"], cfg.steps)
        create_table_artifact(
            [{"step": step, "loss": loss} for step, loss in enumerate(result["losses"], 1)],
            description="the loss of every step, across every attempt (the gang's: the mean "
            "of its ranks')",
        )
        return result

    return pretrain


def main(argv: list[str] | None = None) -> None:
    """The command line: a run without Prefect's server, or one rank of a gang (see the
    module's docstring); rank 0 prints the losses, every rank its checkpoints."""
    import argparse
    import logging
    import tempfile

    from _cli import add_flow_parameters  # flows/_cli.py: the flow's parameters as flags

    defaults, sizes = GPTConfig(), ("steps", "layers", "width", "batch", "corpus_bytes")
    parser = argparse.ArgumentParser(
        description="Pretrain a small GPT: the flow's training, here, without Prefect's "
        "server. In a gang, run it on every rank with torch.distributed's environment (RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the flow run's parameters as flags."
    )
    # the flow's parameters (steps, layers, width, batch, checkpoint_minutes), its defaults
    # but for the checkpoints: every minute here, to show them in a run of minutes
    add_flow_parameters(parser, __file__, "pretrain", defaults={"checkpoint_minutes": 1.0})
    run_options = parser.add_argument_group("this command's own options")
    run_options.add_argument(
        "--corpus-bytes",
        type=int,
        default=defaults.corpus_bytes,
        help="bytes of the standard library's source to train on, default %(default)s",
    )
    run_options.add_argument(
        "--checkpoints",
        default=os.environ.get(JOB_ENV.CHECKPOINT_URL),
        help=f"a directory every rank shares, or s3://bucket/prefix (default: "
        f"${JOB_ENV.CHECKPOINT_URL}, else a new temporary directory for a run of one rank)",
    )
    run_options.add_argument(
        "--key",
        help="the checkpoint key (default: the flow run's when PREFECT__FLOW_RUN_ID is set, "
        "as on rank 0, else 'pretrain')",
    )
    run_options.add_argument("--log-every", type=int, default=25, help="print every N-th loss")
    run_options.add_argument(
        "--after-notice",
        choices=("exit", "wait"),
        default="exit",
        help="after a notice's final save: exit 0 (run the same command to resume), or wait "
        "to be stopped as the flow run does (under a node's agent)",
    )
    run_options.add_argument("--result", help="rank 0 writes the losses here, as JSON")
    args = parser.parse_args(argv)
    rank, world_size = rank_from_environment()
    logging.basicConfig(format=f"%(asctime)s rank {rank} %(message)s", level=logging.WARNING)
    if args.checkpoints is None:
        if world_size > 1:
            parser.error(
                f"a gang needs --checkpoints (or {JOB_ENV.CHECKPOINT_URL}) on shared storage"
            )
        args.checkpoints = tempfile.mkdtemp(prefix="pretrain-")
    key = args.key or (None if os.environ.get("PREFECT__FLOW_RUN_ID") else "pretrain")
    cfg = GPTConfig(**{name: getattr(args, name) for name in sizes})
    step_ends: list[float] = []  # rank 0's

    def on_progress(step: int, loss: float) -> None:
        step_ends.append(time.monotonic())
        if step % args.log_every == 0 or step == cfg.steps - 1:
            print(f"step {step + 1}/{cfg.steps} loss {loss:.4f}", flush=True)

    def print_pace() -> None:
        if len(step_ends) > 1:  # from the end of this attempt's first step (its warm-up)
            mean = (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1)
            print(f"{len(step_ends) - 1} steps at {1000 * mean:.1f} ms a step, {world_size} ranks")

    def stopped(ckpt: Checkpointer) -> None:
        saved = ckpt.last_save
        print_pace()
        print(
            f"stopped after the final save at step {saved.step} "
            f"({saved.bytes / 1e6:.1f} MB in {saved.seconds:.3f} s); the same command resumes",
            flush=True,
        )
        if world_size > 1:
            ckpt.close()
            leave_now()
        sys.exit(0)

    result = run(
        cfg,
        every=args.checkpoint_minutes * 60,
        storage=args.checkpoints,
        key=key,
        on_notice=stopped if args.after_notice == "exit" else wait_to_be_stopped,
        on_progress=on_progress,
    )
    if rank == 0:
        print_pace()
        print(f"final loss {result['final_loss']:.4f}", flush=True)
        if args.result:
            Path(args.result).write_text(json.dumps(result))
    if world_size > 1:
        leave_now()


if __name__ == "__main__":  # the command line needs no Prefect flow (importing Prefect: 4 s)
    main()
else:
    pretrain = _prefect_flow()
