"""Checkpoints for spot work: periodic and final saves near disk speed, exact resume.

The core (``Checkpointer``, the format, local and S3 storage) imports nothing of Prefect;
``prefect_spotgpu.checkpoint.flow`` gives a flow run its storage and key.
"""

from prefect_spotgpu.checkpoint.checkpointer import (
    Checkpointer,
    Restored,
    SaveResult,
    rng_state,
    set_rng_state,
    write_ack,
)
from prefect_spotgpu.checkpoint.format import (
    CorruptCheckpoint,
    UnreadableCheckpoint,
    UntrustedCheckpoint,
)
from prefect_spotgpu.checkpoint.storage import (
    CheckpointStorage,
    LocalStorage,
    S3Storage,
    storage_from_url,
)

__all__ = [
    "CheckpointStorage",
    "Checkpointer",
    "CorruptCheckpoint",
    "LocalStorage",
    "Restored",
    "S3Storage",
    "SaveResult",
    "UnreadableCheckpoint",
    "UntrustedCheckpoint",
    "rng_state",
    "set_rng_state",
    "storage_from_url",
    "write_ack",
]
