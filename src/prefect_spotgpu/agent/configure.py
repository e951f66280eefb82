"""From the operator's options to a runner and a state directory (``spotgpu agent start``).

The agent's key never comes from its command line (every user of the host can read
``/proc/<pid>/cmdline``): it comes from a file or the ``SPOTGPU_AGENT_TOKEN`` variable, which
is then removed from the agent's environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from prefect_spotgpu.agent.isolation import JobUsers, unreachable
from prefect_spotgpu.agent.preflight import check_job_interpreter
from prefect_spotgpu.agent.runners import Runner, get_runner
from prefect_spotgpu.checkpoint.objects import NODE_ROOT_MARKER
from prefect_spotgpu.protocol import Runner as RunnerKind
from prefect_spotgpu.protocol import unfit_job_subnet

logger = logging.getLogger("prefect_spotgpu.agent")

TOKEN_ENV = "SPOTGPU_AGENT_TOKEN"


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """The runner's options, as ``spotgpu agent start`` takes them."""

    kind: str = RunnerKind.PROCESS
    checkpoint_root: Path | None = None
    job_user: str = "auto"
    job_uid_base: int | None = None  # None: SPOTGPU_JOB_UID_BASE, else UID_BASE
    pids_limit: int = 4096
    memory: str | None = None
    job_python: Path | None = None  # the process runner's job interpreter (None: the agent's)
    default_image: str | None = None  # the docker runner's image for bids without one
    job_subnet: str | None = None  # the docker runner's job network (runners/job_network.py)


def agent_token(token_file: str | None) -> str | None:
    """The key from ``token_file``, else from the environment (then removed from this
    process's ``os.environ``; ``/proc/<pid>/environ`` still shows the value it started with,
    which only root and the agent's own user can read — never an isolated job)."""
    token = os.environ.pop(TOKEN_ENV, None) or None
    if token_file:
        path = Path(token_file)
        try:
            token = path.read_text().strip() or None
            if path.stat().st_mode & 0o077:
                logger.warning("%s is readable by other users: chmod 600 it", path)
        except OSError as exc:
            raise ValueError(f"--token-file: {exc}") from None
    return token


def default_state_dir(name: str) -> Path:
    """``$SPOTGPU_HOME/agent-NAME``; SPOTGPU_HOME is ~/.spotgpu, or /var/lib/spotgpu for
    root (root's home is usually closed to the job users that must reach their files)."""
    if os.environ.get("SPOTGPU_HOME"):
        home = Path(os.environ["SPOTGPU_HOME"])
    else:
        home = Path("/var/lib/spotgpu") if os.geteuid() == 0 else Path.home() / ".spotgpu"
    return home / f"agent-{name}"


def build_runner(options: RunnerOptions, state_dir: Path) -> Runner:
    """The runner, and the state directory ready for it; ValueError names a bad option, or a
    node its jobs could not run on (a job interpreter its job users cannot execute:
    ``preflight``).

    The checkpoint root defaults to ``<state dir>/checkpoints`` for the docker runner and for
    isolated process jobs; a process runner without isolation and without a root keeps each
    job's own checkpoint path (the single-tenant case)."""
    if options.memory and not re.fullmatch(r"\d+[bkmgBKMG]?", options.memory):
        raise ValueError(f"--job-memory {options.memory!r}: give a size like 512m or 64g")
    users = JobUsers(options.job_user, uid_base=options.job_uid_base)
    docker = options.kind == RunnerKind.DOCKER
    if not docker and not users.isolated and options.job_user == "auto":
        raise ValueError(
            "the process runner is not running as root, so its jobs would run as this agent's "
            "own user and could read its node token, and through it every job's secrets on "
            "this node. Run the agent as root (each job gets a uid of its own), use --runner "
            "docker, or accept that on a single-tenant node with --job-user set to this user "
            f"({pwd.getpwuid(os.geteuid()).pw_name})"
        )
    if docker and users.for_job(allocation_id=0, tenant_id=0).root:
        raise ValueError("the docker runner never runs a job as root: --job-user auto or a user")
    if docker and options.job_python is not None:
        raise ValueError("--job-python is the process runner's: a container has its own")
    if not docker and options.default_image is not None:
        raise ValueError("--default-image is the docker runner's: a process job runs on the host")
    if options.job_subnet is not None:
        if not docker:
            raise ValueError("--job-subnet is the docker runner's: process jobs use the host's")
        if why := unfit_job_subnet(options.job_subnet):
            raise ValueError(f"--job-subnet {options.job_subnet!r} is {why}")
        if os.geteuid() != 0:
            raise ValueError(
                "--job-subnet needs the agent to run as root: it writes the job network's "
                "firewall rules (iptables)"
            )
    root = options.checkpoint_root
    if root is None and (docker or users.isolated):
        root = state_dir / "checkpoints"
    extra = (
        {
            "pids_limit": options.pids_limit,
            "memory": options.memory,
            "default_image": options.default_image,
            "job_subnet": options.job_subnet,
        }
        if docker
        else {"interpreter": options.job_python}
    )
    runner = get_runner(
        options.kind,
        users=users,
        checkpoint_root=None if root is None else Path(root).absolute(),
        **extra,
    )
    if not docker:  # before anything is made: a node whose 'python' jobs cannot run
        check_job_interpreter(runner.interpreter, users)
    if not state_dir.parent.exists():  # a home it makes is private (the market may share
        # it: service/at_rest.py refuses one others can list); job users may only traverse it
        state_dir.parent.mkdir(parents=True, mode=0o711 if users.isolated else 0o700)
    state_dir.mkdir(parents=True, exist_ok=True)
    if root is not None:  # buyers reading this root find their files in tenant-<id>
        mark_node_root(Path(root).absolute())
    if users.isolated:  # job users reach their own directories and list none of ours
        state_dir.chmod(0o711)
        for needed in (state_dir, root):
            if blocked := unreachable(needed):
                raise ValueError(
                    f"{needed} is out of reach of job users ({blocked} is not o+x): choose "
                    "--state-dir and --checkpoint-root elsewhere, e.g. under /var/lib"
                )
    return runner


def mark_node_root(root: Path) -> None:
    """Make the checkpoint root (traversable, not listable, as ``prepare_job_dirs`` makes it)
    and leave ``NODE_ROOT_MARKER`` in it (``checkpoint.objects.tenant_objects``)."""
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o711, parents=True)
    marker = root / NODE_ROOT_MARKER
    if not marker.is_file():
        marker.write_text("this directory is a spot-gpu node checkpoint root: tenant-<id>/\n")
        marker.chmod(0o644)
