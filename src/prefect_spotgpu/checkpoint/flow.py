"""The thin Prefect side: a checkpointer keyed by the current flow run.

    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run

    @flow
    def pretrain(...):
        ckpt = checkpointer_for_run()   # SPOTGPU_CHECKPOINT_URL, key = flow run id
        ...

A resumed run (same flow run, run count + 1) finds the checkpoints of its earlier attempts.
Under the spot-gpu worker the job's environment also carries the run's signing key
(``SPOTGPU_CHECKPOINT_SIGNING_KEY``, the same for every attempt of the run), so its
checkpoints are signed and only checkpoints signed with it are restored.

In a torch.distributed job (a gang of nodes) every rank calls ``checkpointer_for_run()`` after
``init_process_group``: its rank and the world size come from the standard environment
(``RANK``/``WORLD_SIZE`` as torchrun sets them, else ``NODE_RANK``/``NNODES`` with one
process per node), and each rank saves its own shard (``gang.py``).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from prefect_spotgpu.checkpoint.checkpointer import Checkpointer
from prefect_spotgpu.checkpoint.storage import CheckpointStorage, storage_from_url
from prefect_spotgpu.protocol import JOB_ENV


def checkpointer_for_run(
    storage: CheckpointStorage | str | None = None,
    *,
    key: str | None = None,
    every: timedelta | float = timedelta(minutes=15),
    keep: int = 3,
    signing_key: str | bytes | None = None,
    sync_every: int = 1,
    background: bool = True,
    if_busy: str = "skip",
) -> Checkpointer:
    """A ``Checkpointer`` for the running flow: its storage from the argument or
    ``SPOTGPU_CHECKPOINT_URL``, its key from the argument or the flow run id, its signing key
    from the argument or ``SPOTGPU_CHECKPOINT_SIGNING_KEY`` (see ``Checkpointer``), its rank
    and world size from the environment (:func:`rank_from_environment`; a
    ``GangCheckpointer`` when the world is larger than one); ``background`` and ``if_busy``:
    how periodic saves are written (``Checkpointer``)."""
    storage, key = storage_and_key(storage, key)
    rank, world_size = rank_from_environment()
    return Checkpointer(
        storage,
        key,
        every=every,
        keep=keep,
        signing_key=signing_key,
        rank=rank,
        world_size=world_size,
        sync_every=sync_every,
        background=background,
        if_busy=if_busy,
    )


def distributed_checkpointer_for_run(
    storage: CheckpointStorage | str | None = None,
    *,
    key: str | None = None,
    every: timedelta | float = timedelta(minutes=15),
    keep: int = 3,
    signing_key: str | bytes | None = None,
    sync_every: int = 1,
    process_group=None,
):
    """A ``DistributedCheckpointer`` (``torch.distributed.checkpoint``: FSDP2, torchtitan)
    for the running flow, its storage, key and signing key found as
    :func:`checkpointer_for_run` finds them; its ranks are torch.distributed's (initialize it
    first, on every rank), or this process alone."""
    from prefect_spotgpu.checkpoint.distributed import DistributedCheckpointer

    storage, key = storage_and_key(storage, key)
    return DistributedCheckpointer(
        storage,
        key,
        every=every,
        keep=keep,
        signing_key=signing_key,
        sync_every=sync_every,
        process_group=process_group,
    )


def storage_and_key(storage: CheckpointStorage | str | None, key: str | None):
    """The storage (the argument, or ``SPOTGPU_CHECKPOINT_URL``) and the key (the argument,
    or the flow run's), with the library's saves shown in the run's logs."""
    if storage is None:
        url = os.environ.get(JOB_ENV.CHECKPOINT_URL)
        if not url:
            raise ValueError(f"no checkpoint storage: pass one or set {JOB_ENV.CHECKPOINT_URL}")
        storage = url
    if isinstance(storage, str):
        storage = storage_from_url(storage)
    if key is None:
        from prefect.runtime import flow_run

        run_id = flow_run.get_id()
        if not run_id:
            raise ValueError("not inside a flow run: pass key=")
        key = f"flow-run-{run_id}"
    library_logger = logging.getLogger("prefect_spotgpu.checkpoint")
    if library_logger.level == logging.NOTSET:  # saves show in the run's logs (the worker
        library_logger.setLevel(logging.INFO)  # sets PREFECT_LOGGING_EXTRA_LOGGERS for that)
    return storage, key


OUTPUTS = "outputs"
"""Where a run's storage keeps flows' outputs: ``outputs/<name>/...``."""


def run_outputs(name: str, storage_url: str | None = None):
    """Where a flow writes its outputs ``name``: the run's storage (the argument or
    ``SPOTGPU_CHECKPOINT_URL``, as for checkpoints) and the prefix ``outputs/<name>``. Never a
    path relative to the job: the next attempt may run on another host, in another container.

    >>> store, prefix = run_outputs("renders/night-1", "/mnt/ckpt")
    >>> store, prefix
    (LocalObjects('/mnt/ckpt'), 'outputs/renders/night-1')
    """
    from prefect_spotgpu.checkpoint.objects import check_name, objects_from_url

    url = storage_url or os.environ.get(JOB_ENV.CHECKPOINT_URL)
    if not url:
        raise ValueError(f"no run storage for outputs: pass one or set {JOB_ENV.CHECKPOINT_URL}")
    return objects_from_url(url), f"{OUTPUTS}/{check_name(name)}"


def rank_from_environment(environ=os.environ) -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed's standard environment: ``RANK`` and
    ``WORLD_SIZE`` (torchrun), else ``NODE_RANK`` and ``NNODES`` (one process per node), else
    ``(0, 1)``; a malformed value raises ``ValueError`` naming the variable.

    >>> rank_from_environment({"RANK": "3", "WORLD_SIZE": "4"})
    (3, 4)
    >>> rank_from_environment({"NODE_RANK": "1", "NNODES": "2"})
    (1, 2)
    >>> rank_from_environment({})
    (0, 1)
    """
    for rank_name, size_name in (("RANK", "WORLD_SIZE"), ("NODE_RANK", "NNODES")):
        if size_name not in environ:
            continue
        values = []
        for name, default in ((rank_name, "0"), (size_name, None)):
            raw = environ.get(name, default)
            try:
                values.append(int(raw))
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
        rank, world_size = values
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"{rank_name}={rank} is not a rank of {size_name}={world_size}")
        return rank, world_size
    return 0, 1


def wait_to_be_stopped(ckpt: Checkpointer, grace: float = 30.0) -> None:
    """After a notice's final save: wait for the node's agent to stop this process.

    The agent stops the job within a second of the acknowledgement. Returning instead would
    let the flow carry on (or complete with partial work); if no one stops the process by the
    notice deadline plus ``grace`` (no agent: a notice file outside the market), this raises.
    """
    import time

    deadline = (ckpt.notice_deadline or time.time()) + grace
    while time.time() < deadline:
        time.sleep(0.1)
    raise RuntimeError(
        f"checkpoint {ckpt.key} saved its final state but nothing stopped the process"
    )
