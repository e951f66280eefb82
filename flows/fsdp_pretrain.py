"""Pretrain the small GPT of ``pretrain.py`` sharded with FSDP2 (``fully_shard``), checkpointed
through ``torch.distributed.checkpoint`` into the run's storage (docs/users/recipes.md).

Every block and the model are ``fully_shard``-ed over the gang (one rank a node); the state is
DCP's (``get_state_dict``: sharded weights and optimizer moments), saved by
``DistributedCheckpointer``: ``async_save`` every ``checkpoint_minutes``, a final save on a
notice seen by any rank, every rank acknowledging after the commit. A gang resumed on the same
world size follows the same loss curve, bit for bit; DCP reshards, so the same checkpoint also
loads on a different number of ranks (a gang that goes on smaller, a single rank). Batches are
drawn by a generator seeded by the step: the same starts on every rank, rank ``r`` the ``r``-th
slice. No dropout (as in large-model pretraining): nothing random but the data.

    torchrun --nproc-per-node 2 flows/fsdp_pretrain.py --steps 60 --checkpoints /tmp/fsdp

Rank 0 is the flow run on a spot-gpu pool (a gang's ``node_count``); every other rank runs
this command with the flow run's parameters as flags, as ``pretrain.py``'s do.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pretrain import (
    GPT,
    GPTConfig,
    leave_now,
    process_group,
    rank_batch,
    set_learning_rate,
    stdlib_corpus,
)

from prefect_spotgpu.checkpoint.flow import distributed_checkpointer_for_run


def train(cfg: GPTConfig, *, storage=None, key=None, every: float = 900.0, on_progress=None,
          on_notice=None) -> dict:  # fmt: skip
    """Train (or resume) to ``cfg.steps`` inside the gang's process group; the gang's losses
    (the mean over the ranks) of every step so far, the same on every rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.batch % world:
        raise ValueError(f"batch={cfg.batch} does not split evenly over {world} ranks")
    share = cfg.batch // world
    on_gpu = torch.cuda.is_available()
    mesh = init_device_mesh("cuda" if on_gpu else "cpu", (world,))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    if on_gpu:
        model = model.cuda()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    ckpt = distributed_checkpointer_for_run(storage, key=key, every=every)
    losses: list[float] = []

    def state() -> dict:
        model_state, optim_state = get_state_dict(model, opt)
        return {"model": model_state, "optim": optim_state, "losses": list(losses)}

    restored = state()
    last = ckpt.restore(restored)
    if last is not None:
        set_state_dict(model, opt, model_state_dict=restored["model"],
                       optim_state_dict=restored["optim"])  # fmt: skip
        losses = list(restored["losses"])
    data = stdlib_corpus(cfg.corpus_bytes)
    device = "cuda" if on_gpu else "cpu"
    for step in range(0 if last is None else last + 1, cfg.steps):
        draw = torch.Generator().manual_seed(cfg.seed + step)  # by the step: any world size
        x, y = rank_batch(data, cfg, draw, rank * share, share, device)
        set_learning_rate(opt, cfg, step)
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if on_progress is not None:
            on_progress(step, losses[-1])
        ckpt.maybe_save(state, step)
        if ckpt.notice_received:
            ckpt.close()
            if on_notice is not None:
                on_notice(ckpt)
            break
    ckpt.close()
    return {"losses": losses, "steps": cfg.steps, "world_size": world}


def _joined():
    """The gang's process group (``pretrain.process_group``), or a group of this process
    alone when it runs by itself (FSDP needs one)."""
    from contextlib import contextmanager

    @contextmanager
    def joined():
        if dist.is_initialized():
            yield
            return
        with process_group() as (_, world):
            if world == 1:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            yield

    return joined()


def _prefect_flow():
    from prefect import flow, get_run_logger
    from prefect.context import FlowRunContext

    @flow(name="fsdp-pretrain")
    def fsdp_pretrain(steps: int = 200, layers: int = 2, width: int = 64, batch: int = 16,
                      checkpoint_minutes: float = 15.0) -> dict:  # fmt: skip
        """Pretrain a small GPT sharded with FSDP2 over the gang; DCP checkpoints, resharded.
        Rank 0 is the flow run and logs; the other ranks run this outside any flow run."""
        cfg = GPTConfig(steps=steps, layers=layers, width=width, batch=batch, dropout=0.0)
        every = checkpoint_minutes * 60
        with _joined():
            if dist.get_rank() > 0 or FlowRunContext.get() is None:
                return train(cfg, every=every)
            logger = get_run_logger()
            logger.info("rank 0 of %d: FSDP over the gang", dist.get_world_size())

            def progress(step: int, loss: float) -> None:
                if step % 25 == 0 or step == steps - 1:
                    logger.info("step %d/%d loss %.4f", step + 1, steps, loss)

            return train(cfg, every=every, on_progress=progress)

    return fsdp_pretrain


def main(argv: list[str] | None = None) -> None:
    """One rank's command line (see the module's docstring): the flow's parameters as flags;
    rank 0 writes the losses to ``--result``; after a notice's final save ``--after-notice
    exit`` ends the process (run the same command to resume), ``wait`` waits to be stopped."""
    import argparse

    from _cli import add_flow_parameters

    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flow_parameters(parser, __file__, "fsdp_pretrain", defaults={"checkpoint_minutes": 1.0})
    parser.add_argument("--checkpoints", default=os.environ.get("SPOTGPU_CHECKPOINT_URL"))
    parser.add_argument("--key", default=None)
    parser.add_argument("--result", help="rank 0 writes the losses here, as JSON")
    parser.add_argument("--after-notice", choices=("exit", "wait"), default="exit")
    args = parser.parse_args(argv)
    if not args.checkpoints:
        parser.error("give --checkpoints (or SPOTGPU_CHECKPOINT_URL), shared by every rank")
    key = args.key or (None if os.environ.get("PREFECT__FLOW_RUN_ID") else "fsdp-pretrain")
    cfg = GPTConfig(steps=args.steps, layers=args.layers, width=args.width, batch=args.batch,
                    dropout=0.0)  # fmt: skip
    stopped = wait_to_be_stopped if args.after_notice == "wait" else (lambda ckpt: None)
    with _joined():
        result = train(cfg, storage=args.checkpoints, key=key, on_notice=stopped,
                       every=args.checkpoint_minutes * 60)  # fmt: skip
        if dist.get_rank() == 0 and args.result:
            Path(args.result).write_text(json.dumps(result))
        dist.barrier()
        leave_now()  # (gloo's teardown at exit aborts now and then: see pretrain.leave_now)


if __name__ == "__main__":
    main()
else:
    fsdp_pretrain = _prefect_flow()
