"""What the agent checks before it takes any work: that its job users can run the job
interpreter.

A process job whose command starts with ``python`` runs the node's job interpreter (the
agent's own, or ``--job-python``: ``runners.process``). Under root, jobs run as unprivileged
users (``isolation``); one that cannot search every directory on the way to that file, through
every symbolic link, or cannot execute the file itself, fails every such job with EACCES the
moment it starts — and the market places the bid again at once, each attempt billed. So the
agent refuses to start instead (``configure.build_runner``), naming the path and the fix.

The decision is pure: :func:`exec_blocker` takes the steps of the path's resolution (each
directory searched, then the file, with their modes and owners) and the user's uid and groups.
Only :func:`resolution` and :func:`check_job_interpreter` look at the file system. The check
follows the classic permission bits, as the kernel does for a user without capabilities; ACLs
and ``noexec`` mounts are not read (an ACL that grants more is ignored, one that takes away
is not seen).

A venv under root's home (0700) is out of reach of every job user::

    >>> root, venv = Step("/", 0o40755, 0, 0), Step("/root", 0o40700, 0, 0)
    >>> python = Step("/root/venv/bin/python3.11", 0o100755, 0, 0)
    >>> exec_blocker([root, venv, python], uid=200_000, gids={200_000})
    '/root is mode 0700 (owner uid 0, group 0): others may not search it'
    >>> exec_blocker([root, venv, python], uid=0, gids={0}) is None
    True
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from prefect_spotgpu.agent.isolation import JobUsers

MAX_LINKS = 40
"""The most symbolic links one resolution follows (Linux's own limit)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One file a path's resolution passes: a directory it searches, or the file it ends at
    (never a link: a link is followed, and its target's steps are in its place)."""

    path: str
    mode: int  # st_mode
    uid: int
    gid: int


def _bits(step: Step, uid: int, gids: Collection[int]) -> tuple[int, str]:
    """The execute/search bit that applies to the user, and whose it is (owner, group or
    others: exactly one applies, as for the kernel)."""
    if uid == step.uid:
        return stat.S_IXUSR, "its owner"
    if step.gid in gids:
        return stat.S_IXGRP, "its group"
    return stat.S_IXOTH, "others"


def _mode(step: Step) -> str:
    return f"mode {stat.S_IMODE(step.mode):04o} (owner uid {step.uid}, group {step.gid})"


def exec_blocker(steps: Sequence[Step], *, uid: int, gids: Collection[int]) -> str | None:
    """Why user ``uid`` (groups ``gids``) cannot execute the file ``steps`` resolve to —
    every step but the last a directory it must search, the last the file — or None if it
    can. Root searches every directory and executes a file any execute bit is set on."""
    *directories, target = steps
    for directory in directories:
        if not stat.S_ISDIR(directory.mode):
            return f"{directory.path} is not a directory"
        bit, whose = _bits(directory, uid, gids)
        if uid != 0 and not directory.mode & bit:
            return f"{directory.path} is {_mode(directory)}: {whose} may not search it"
    if not stat.S_ISREG(target.mode):
        return f"{target.path} is not a regular file"
    if uid == 0:
        runs = target.mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return None if runs else f"{target.path} is {_mode(target)}: nobody may execute it"
    bit, whose = _bits(target, uid, gids)
    return None if target.mode & bit else f"{target.path} is {_mode(target)}: {whose} may not"


def _step(path: str) -> Step:
    info = os.stat(path)
    return Step(path, info.st_mode, info.st_uid, info.st_gid)


def resolution(path: Path | str) -> list[Step]:
    """The steps of ``path``'s resolution, as exec makes them: from ``/``, each directory
    searched for the next name, each symbolic link followed (its target from where it lies),
    then the file. ``OSError`` (as exec would: ENOENT, ENOTDIR, ELOOP) if it does not
    resolve."""
    pending = list(PurePosixPath(os.path.abspath(path)).parts[1:])
    current, steps, links = "/", [], 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        steps.append(_step(current))  # searched for ``name`` (".." too)
        if name == "..":
            current = os.path.dirname(current)
            continue
        following = os.path.join(current, name)
        info = os.lstat(following)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
            target = PurePosixPath(os.readlink(following))
            if target.is_absolute():
                current = "/"
            pending[:0] = target.parts[1:] if target.is_absolute() else target.parts
            continue
        current = following
    steps.append(_step(current))
    return [s for i, s in enumerate(steps) if i == 0 or s.path != steps[i - 1].path]


def _who(users: JobUsers) -> str:
    if users.spec == "auto":
        return f"the job users (uid {users.uid_base} and up, --job-user auto)"
    return f"the job user {users.spec!r}"


def check_job_interpreter(interpreter: Path | str, users: JobUsers) -> None:
    """Refuse (``ValueError``, naming the path and the fix) a job interpreter the node's job
    users cannot execute. Jobs that run as the agent's own user need no check: the agent runs
    that interpreter itself, or was given it."""
    if not users.isolated:
        return
    user = users.for_job(allocation_id=0, tenant_id=0)  # (jobs run with no other groups)
    shown = str(interpreter)
    try:
        steps = resolution(interpreter)
        why = exec_blocker(steps, uid=user.uid, gids={user.gid})
        if steps[-1].path != os.path.abspath(interpreter):
            shown += f" (a link to {steps[-1].path})"
    except OSError as exc:
        why = exc.strerror or str(exc)
    if why is None:
        return
    raise ValueError(
        f"{_who(users)} cannot execute {shown}, which process jobs that start with 'python' "
        f"run: {why}. Put the agent's virtual environment where that user can read it (e.g. "
        "under /opt, every directory on the way o+x), give --job-python an interpreter that "
        "user can run, or pass --job-user a user that can"
    )
