"""Decorated flows travel as Prefect bundles through the run's own storage (no uv, no index).

Prefect's integrations ship a flow called from code as a *bundle*: the flow pickled with its
parameters, uploaded by the pool's ``bundle_upload_step`` and run on the infrastructure by its
``bundle_execution_step`` (``prefect/bundles``; docs/operators/architecture.md, "How users reach
it"). Prefect's own steps run through ``uv run --with <requirements>``, which installs packages at
run time: a GPU node may reach no package index, and a spot run should not pay for installs at
every resume.
A spot-gpu pool's steps are this package's instead, run by the job's own Python:

- ``python -m prefect_spotgpu.bundles.upload --block NAME --key KEY FILE`` (in the caller):
  writes the bundle as ``bundles/KEY`` into the Spot Checkpoint Storage block ``NAME``, and
  records its SHA-256 on the flow run (label ``spotgpu.bundle-sha256``);
- ``python -m prefect_spotgpu.bundles.execute --url URL --key KEY`` (the job on the node):
  waits for the worker's go as every spot job does (``launch``), reads the bundle from the
  storage at ``URL`` (the job's credentials: its environment), refuses bytes whose SHA-256
  is not the one the caller recorded, and runs the flow in this very process (so the notice's
  SIGUSR1 reaches it).

``spotgpu pool setup`` writes both steps into the pool's storage configuration, with the same
block as the pool's default result storage: ``prefect work-pool storage inspect POOL`` shows
them.
"""

from __future__ import annotations

BUNDLES = "bundles"
"""Where a storage keeps bundles: ``bundles/<key>``."""
UPLOAD_STEP = "prefect_spotgpu.bundles.upload"
EXECUTION_STEP = "prefect_spotgpu.bundles.execute"


def storage_configuration(*, block_name: str, url: str, block_id: str) -> dict:
    """A spot-gpu pool's ``storage_configuration``: this package's upload and execution steps
    on the Spot Checkpoint Storage block ``block_name`` (at ``url``), which is also the pool's
    default result storage (``block_id``), so a caller can read its flow's result."""
    return {
        "bundle_upload_step": {UPLOAD_STEP: {"launcher": ["python"], "block": block_name}},
        "bundle_execution_step": {EXECUTION_STEP: {"launcher": ["python"], "url": url}},
        "default_result_storage_block_id": block_id,
    }


def bundle_name(key: str) -> str:
    return f"{BUNDLES}/{key}"
