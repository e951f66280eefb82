"""Runners: how the agent starts, signals and stops a job, each behind one ``Runner``.

``runner`` holds the contract (``JobRequest``, ``JobHandle``, the ``Runner`` protocol);
``process`` runs a job as a local process group (the default, single-tenant), ``docker`` as a
container (multi-tenant). A runner is chosen by name (``--runner``): :func:`get_runner`.
"""

from __future__ import annotations

from prefect_spotgpu.agent.runners.docker import DockerRunner
from prefect_spotgpu.agent.runners.process import ProcessRunner
from prefect_spotgpu.agent.runners.runner import JobFault, JobHandle, JobRequest, Runner
from prefect_spotgpu.protocol import Runner as RunnerKind

__all__ = [
    "RUNNERS",
    "DockerRunner",
    "JobFault",
    "JobHandle",
    "JobRequest",
    "ProcessRunner",
    "Runner",
    "get_runner",
]

RUNNERS: dict[str, type[Runner]] = {
    RunnerKind.PROCESS: ProcessRunner,
    RunnerKind.DOCKER: DockerRunner,
}


def get_runner(name: str, **options) -> Runner:
    """The runner called ``name``, made with ``options`` (its keyword arguments)."""
    try:
        runner = RUNNERS[name]
    except KeyError:
        raise ValueError(
            f"runner {name!r} is not known; valid runners: {', '.join(sorted(RUNNERS))}"
        ) from None
    return runner(**options)
