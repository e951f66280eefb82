"""The ``spot-gpu`` Prefect worker: flow runs bid for GPUs, preemption is a resumable state.

``prefect_spotgpu.worker`` is the ``prefect.collections`` entry point, so
``prefect worker start --type spot-gpu`` finds ``SpotGPUWorker`` here. The rooms:

- ``worker``: BaseWorker glue only (start, run, kill_infrastructure, adoption)
- ``config``: the job configuration (also the pool's UI form) and the image catalogue
- ``reactions``: PURE: what one bid event means for the flow run (``react``)
- ``attempt``: follows one bid and carries out each reaction against Prefect and the market
- ``market_api``: the market calls, their errors and the transient-failure rule
- ``placement``: places, reprices and replaces a run's bids
- ``pacing``: PURE: the deadline policy's plan for a bid
- ``report``: the run's cost report and artifacts
"""

from prefect_spotgpu.worker.config import (
    LAUNCH_COMMAND,
    SEEDED_IMAGES,
    SpotGPUJobConfiguration,
)
from prefect_spotgpu.worker.market_api import MarketError
from prefect_spotgpu.worker.worker import SpotGPUWorker, SpotGPUWorkerResult

__all__ = [
    "LAUNCH_COMMAND",
    "SEEDED_IMAGES",
    "MarketError",
    "SpotGPUJobConfiguration",
    "SpotGPUWorker",
    "SpotGPUWorkerResult",
]
