"""How a node runs jobs, and what that lets it serve (pure; ``types.Node.runner``).

A bid that names an image runs only in that image, so only on a Docker node; a bid without one
(``image: process``, "the node's own environment") runs as a host process on a process node,
or on a Docker node in the image its operator named (``--default-image``). The index keeps what
each node serves as bits (:func:`serves_mask`) and each bid's need (:func:`needs_mask`).

A gang member must also reach its gang's other members on other hosts: a process node's jobs
share the host's network, a Docker node's containers reach them only on its job network
(``spotgpu agent start --job-subnet``, docs/users/gangs.md). ``SERVES_GANGS`` says a node runs
gang members of what it serves; the market places a gang only on such nodes
(``index.serves_member``).
"""

from __future__ import annotations

from enum import StrEnum


class Runner(StrEnum):
    """How a node runs its jobs (``spotgpu agent start --runner``): what it can serve.

    A bid that names an image runs only in that image, so only on a Docker node; a bid without
    one (``image: process``, "the node's own environment") runs as a host process on a process
    node, or on a Docker node in the image its operator named (``--default-image``). The market
    places a bid only on a node that serves it (:func:`serves_mask`)."""

    PROCESS = "process"
    """Host processes with the agent's interpreter: bids without an image."""
    DOCKER = "docker"
    """Containers: bids with an image; without one only with a default image."""


SERVES_PROCESS = 1
"""A node serves bids without an image (a bit of :func:`serves_mask`)."""
SERVES_IMAGES = 2
"""A node serves bids that name an image."""
SERVES_GANGS = 4
"""A node runs gang members of the bids it serves: a process node, or a Docker node with a job
network (its containers reach other hosts' members)."""
SERVES_ALL = SERVES_PROCESS | SERVES_IMAGES | SERVES_GANGS
"""An agent that did not say its runner (an older one): any bid, as before."""


def serves_mask(runner: Runner | None, default_image: bool, job_network: bool = False) -> int:
    """What a node serves, as bits: ``SERVES_PROCESS``, ``SERVES_IMAGES``, ``SERVES_GANGS``.

    >>> serves_mask(Runner.PROCESS, False), serves_mask(Runner.DOCKER, False)
    (5, 2)
    >>> serves_mask(Runner.DOCKER, True), serves_mask(Runner.DOCKER, False, job_network=True)
    (3, 6)
    >>> serves_mask(None, False) == serves_mask(Runner.DOCKER, True, True) == SERVES_ALL
    True
    """
    if runner is None:
        return SERVES_ALL
    if runner == Runner.PROCESS:
        return SERVES_PROCESS | SERVES_GANGS
    return (
        SERVES_IMAGES
        | (SERVES_PROCESS if default_image else 0)
        | (SERVES_GANGS if job_network else 0)
    )


def needs_mask(image: str | None) -> int:
    """What a bid needs of a node: ``SERVES_IMAGES`` with an image, else ``SERVES_PROCESS``."""
    return SERVES_IMAGES if image else SERVES_PROCESS


def check_runner(
    runner: object, default_image: object, job_network: object = False
) -> Runner | None:
    """A node's ``runner`` as a :class:`Runner` (or None), and booleans ``default_image`` and
    ``job_network``; ValueError naming the field otherwise."""
    for name, value in (("default_image", default_image), ("job_network", job_network)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean, got {value!r}")
    if runner is None:
        return None
    try:
        return Runner(runner)
    except ValueError:
        names = ", ".join(r.value for r in Runner)
        raise ValueError(f"runner must be one of {names} or None, got {runner!r}") from None
