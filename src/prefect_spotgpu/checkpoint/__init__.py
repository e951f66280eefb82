"""Checkpoints for spot work: periodic and final saves near disk speed, exact resume.

The core (``Checkpointer``, the format, local and S3 storage) imports nothing of Prefect;
``prefect_spotgpu.checkpoint.flow`` gives a flow run its storage and key.

A torch.distributed job (a gang of nodes, one rank each) saves one shard per rank, committed
together (``gang.py``): every rank builds its checkpointer with its rank and the world size,
and makes the same calls at the same steps::

    ckpt = Checkpointer(storage, "run-42", rank=dist.get_rank(),
                        world_size=dist.get_world_size())
    restored = ckpt.restore()          # this rank's shard of the newest complete gang step
    ...
    ckpt.maybe_save(lambda: this_ranks_state(), step)   # saves at the same step everywhere

A ``torch.distributed.checkpoint`` state (FSDP2, torchtitan) goes through
``DistributedCheckpointer`` instead (``distributed.py``; DCP's storage plug-ins in ``dcp.py``):
DCP plans and reshards, this storage keeps the promises. It needs torch, so it is imported
when first named.
"""

from prefect_spotgpu.checkpoint.checkpointer import Checkpointer, Restored, SaveResult
from prefect_spotgpu.checkpoint.fencing import StaleAttempt
from prefect_spotgpu.checkpoint.format import (
    CorruptCheckpoint,
    UnreadableCheckpoint,
    UntrustedCheckpoint,
)
from prefect_spotgpu.checkpoint.gang import GangCheckpointer, GangCheckpointFailed
from prefect_spotgpu.checkpoint.group import GroupSync, TorchGroupSync
from prefect_spotgpu.checkpoint.handshake import write_ack
from prefect_spotgpu.checkpoint.rng import rng_state, set_rng_state
from prefect_spotgpu.checkpoint.storage import (
    CheckpointStorage,
    LocalStorage,
    S3Storage,
    storage_from_url,
)
from prefect_spotgpu.checkpoint.warm import warm_up

__all__ = [
    "CheckpointStorage",
    "Checkpointer",
    "CorruptCheckpoint",
    "DistributedCheckpointer",
    "GangCheckpointFailed",
    "GangCheckpointer",
    "GroupSync",
    "LocalStorage",
    "Restored",
    "S3Storage",
    "SaveResult",
    "StaleAttempt",
    "TorchGroupSync",
    "UnreadableCheckpoint",
    "UntrustedCheckpoint",
    "rng_state",
    "set_rng_state",
    "storage_from_url",
    "warm_up",
    "write_ack",
]


def __getattr__(name: str):
    if name == "DistributedCheckpointer":  # (imports torch: only when asked for)
        from prefect_spotgpu.checkpoint.distributed import DistributedCheckpointer

        return DistributedCheckpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
