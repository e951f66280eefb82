"""Dask on spot GPUs: ``SpotGPUCluster``, each worker one spot bid (``cluster.py``).

Importing this package is cheap: a node's worker job (``worker_job``) installs its notice
handler before anything heavy loads, so the cluster is imported only when asked for.
"""

from __future__ import annotations

__all__ = ["SpotGPUCluster", "SpotGPUJob", "put_once"]


def __getattr__(name: str):
    if name in ("SpotGPUCluster", "SpotGPUJob"):
        from prefect_spotgpu.dask import cluster

        return getattr(cluster, name)
    if name == "put_once":
        from prefect_spotgpu.dask.outputs import put_once

        return put_once
    raise AttributeError(f"module 'prefect_spotgpu.dask' has no attribute {name!r}")
