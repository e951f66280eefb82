"""Deploying a flow to a spot-gpu pool from Python, the way most Prefect 3 users deploy.

    from prefect import flow
    from prefect_spotgpu.deploy import spot_job_variables

    flow.from_source(source="https://github.com/you/repo", entrypoint="train.py:train").deploy(
        name="train-nightly",
        work_pool_name="spot",
        job_variables=spot_job_variables(gpu_model="A100-80G", max_price=1.2, gpu_count=2),
    )

:func:`spot_job_variables` checks the variables against this package's spot-gpu variables
(``SpotGPUJobConfiguration``, the form a spot-gpu pool starts with; not a pool's edited
form) when the
deployment is made, so a typo or a bad value fails there, naming the field — not later,
on a node, in a billed job. GPU model spellings are normalised as the market does.
"""

from __future__ import annotations

from typing import Any

from prefect_spotgpu.economics.schedules import NIGHT_CRON, NIGHT_RRULE, zone
from prefect_spotgpu.market.gpus import DEFAULT_CATALOG
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration

BLOCK_VARIABLES = ("market", "checkpoint_storage")
"""Set on the pool (``spotgpu pool setup``) rather than per deployment."""


def spot_job_variables(**variables: Any) -> dict[str, Any]:
    """The ``job_variables`` of a deployment on a spot-gpu pool, validated now.

    >>> spot_job_variables(gpu_model="nvidia a100 80gb", max_price=1.2)
    {'gpu_model': 'A100-80G', 'max_price': 1.2}
    >>> spot_job_variables(max_prize=1.2)
    Traceback (most recent call last):
    ...
    ValueError: unknown job variable 'max_prize'; a spot-gpu pool has: bidding_policy, cheap_window_only, command, deadline, deadline_hours, env, gpu_count, gpu_hours, gpu_model, image, labels, max_preemptions, max_price, min_node_count, name, node_count, notice_webhook, on_demand_fallback, region, restart_minutes, timezone
    """  # noqa: E501
    known = sorted(set(SpotGPUJobConfiguration.model_fields) - set(BLOCK_VARIABLES))
    for name in variables:
        if name in BLOCK_VARIABLES:
            raise ValueError(
                f"{name} is the pool's: link its block with spotgpu pool setup, not per deployment"
            )
        if name not in known:
            raise ValueError(
                f"unknown job variable {name!r}; a spot-gpu pool has: {', '.join(known)}"
            )
    if "gpu_model" in variables:
        variables["gpu_model"] = DEFAULT_CATALOG.normalize(variables["gpu_model"])
    SpotGPUJobConfiguration(**variables)  # a bad value: ValidationError, naming the field
    return variables


def night_schedule(tz: str = "UTC"):
    """A Prefect cron schedule that starts a run as each cheap window opens, in ``tz``; pair
    it with the ``cheap_window_only`` job variable so the run also stops when it closes."""
    from prefect.client.schemas.schedules import CronSchedule

    return CronSchedule(cron=NIGHT_CRON, timezone=zone(tz).key)


def night_rrule(tz: str = "UTC"):
    """The same as :func:`night_schedule`, as a Prefect RRule schedule."""
    from prefect.client.schemas.schedules import RRuleSchedule

    return RRuleSchedule(rrule=NIGHT_RRULE, timezone=zone(tz).key)
