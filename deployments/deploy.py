"""Deploy the pretraining flow to the spot-gpu pool "spot" from Python (README: the first hour,
by hand). The flow's code comes from its source, this repository's directory (every node on
this machine reaches it; elsewhere, a git URL); ``spot_job_variables`` checks the variables
against the pool's form now, so a typo fails here rather than on a node.

    python deployments/deploy.py            # then: prefect deployment run pretrain/pretrain-by-hand
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from prefect_spotgpu.deploy import spot_job_variables

REPOSITORY = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    flow.from_source(source=str(REPOSITORY), entrypoint="flows/pretrain.py:pretrain").deploy(
        name="pretrain-by-hand",
        work_pool_name="spot",
        # about half a minute on two CPU cores, a checkpoint every 15 s: time to reclaim its node
        parameters={"steps": 1000, "checkpoint_minutes": 0.25},
        job_variables=spot_job_variables(gpu_model="A100-80G", gpu_count=1, max_price=1.2),
    )
