"""The agent refuses to start when its job users cannot execute the job interpreter:
the pure decision on plain stat results, the resolution on a real file system, and, as root,
the verdict checked against what exec really does for an unprivileged user."""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_spotgpu.agent.configure import RunnerOptions, build_runner
from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.preflight import (
    Step,
    check_job_interpreter,
    exec_blocker,
    resolution,
)
from test_agent_isolation import AS_ROOT, NEEDS_PYTHON, PYTHON

D, F = stat.S_IFDIR, stat.S_IFREG
ROOT = Step("/", D | 0o755, 0, 0)


def steps(*middle: Step, target: Step) -> list[Step]:
    return [ROOT, *middle, target]


PYTHON_FILE = Step("/opt/venv/bin/python", F | 0o755, 0, 0)


# ---------------------------------------------------------------- the pure decision


def test_every_directory_on_the_way_must_be_searchable_by_the_users_class():
    opt = Step("/opt", D | 0o755, 0, 0)
    closed = Step("/opt/venv", D | 0o750, 0, 50)
    path = steps(opt, closed, target=PYTHON_FILE)
    why = exec_blocker(path, uid=1000, gids={1000})
    assert why == "/opt/venv is mode 0750 (owner uid 0, group 50): others may not search it"
    assert exec_blocker(path, uid=1000, gids={1000, 50}) is None  # in its group
    assert exec_blocker(path, uid=0, gids={0}) is None  # root searches every directory
    owned = Step("/opt/venv", D | 0o071, 1000, 50)  # owner's bits apply to the owner only
    why = exec_blocker(steps(opt, owned, target=PYTHON_FILE), uid=1000, gids={50})
    assert why is not None and "its owner may not search it" in why
    group_only = Step("/opt/venv", D | 0o705, 0, 50)  # the group's bits apply, not others'
    why = exec_blocker(steps(opt, group_only, target=PYTHON_FILE), uid=1000, gids={50})
    assert why is not None and "its group may not search it" in why


def test_the_file_itself_must_be_a_regular_file_the_user_may_execute():
    opt = Step("/opt", D | 0o755, 0, 0)
    for mode, uid, ok in (
        (0o755, 1000, True),
        (0o750, 1000, False),
        (0o700, 0, True),  # root: any execute bit
        (0o644, 0, False),  # root too needs one
        (0o705, 7, True),
    ):
        target = Step("/opt/python", F | mode, 0, 0)
        why = exec_blocker(steps(opt, target=target), uid=uid, gids={uid})
        assert (why is None) is ok, (oct(mode), uid, why)
    directory = Step("/opt/python", D | 0o755, 0, 0)
    assert "not a regular file" in exec_blocker(steps(opt, target=directory), uid=7, gids={7})
    a_file = Step("/opt", F | 0o755, 0, 0)
    assert exec_blocker(steps(a_file, target=PYTHON_FILE), uid=7, gids={7}) == (
        "/opt is not a directory"
    )


# ---------------------------------------------------------------- the resolution


def test_the_resolution_follows_every_link_from_where_it_lies(tmp_path):
    real = tmp_path / "pyenv" / "bin"
    real.mkdir(parents=True)
    (real / "python3.11").write_text("#!/bin/sh\n")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to(real / "python3.11")  # absolute
    (venv / "python").symlink_to("python3")  # relative, in the same directory
    (tmp_path / "up").symlink_to("venv/bin/../bin")  # with ".."
    found = [s.path for s in resolution(tmp_path / "up" / "python")]
    assert found[-1] == str(real / "python3.11")
    assert str(venv) in found and str(real) in found and str(tmp_path / "pyenv") in found
    assert found[0] == "/"
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OSError) as raised:
        resolution(tmp_path / "loop")
    assert raised.value.errno == errno.ELOOP
    with pytest.raises(FileNotFoundError):
        resolution(tmp_path / "venv" / "bin" / "python2")


def test_jobs_that_run_as_the_agents_own_user_need_no_check(tmp_path):
    me = JobUsers(str(os.geteuid()))
    assert not me.isolated
    check_job_interpreter(tmp_path / "no-such-python", me)  # nothing to check: no refusal


# ---------------------------------------------------------------- as root, the real thing


def _runs_as(user: pwd.struct_passwd, program: Path) -> bool:
    try:
        subprocess.run(
            [str(program), "-c", "pass"],
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=[],
            check=True,
            timeout=30,
            capture_output=True,
        )
    except PermissionError:
        return False
    return True


@AS_ROOT
@NEEDS_PYTHON
def test_the_check_says_what_exec_does_for_an_unprivileged_user(sandbox):
    nobody = pwd.getpwnam("nobody")
    home = sandbox / "root-home"
    (home / "venv" / "bin").mkdir(parents=True)
    python = home / "venv" / "bin" / "python"
    python.symlink_to(PYTHON)
    home.chmod(0o700)  # root's home, as on most hosts
    with pytest.raises(ValueError) as refused:
        check_job_interpreter(python, JobUsers("nobody"))
    message = str(refused.value)
    assert f"the job user 'nobody' cannot execute {python}" in message
    assert f"{home} is mode 0700 (owner uid 0, group 0): others may not search it" in message
    assert "--job-python" in message and "--job-user" in message
    assert not _runs_as(nobody, python)  # exec agrees: EACCES
    with pytest.raises(ValueError, match=f"uid {JobUsers('auto').uid_base} and up"):
        check_job_interpreter(python, JobUsers("auto"))
    home.chmod(0o711)  # traversable: the check passes, and so does exec
    check_job_interpreter(python, JobUsers("nobody"))
    assert _runs_as(nobody, python)
    copy = sandbox / "python-copy"
    shutil.copy2(Path(PYTHON).resolve(), copy)
    copy.chmod(0o700)  # only root may execute it
    with pytest.raises(ValueError, match="others may not"):
        check_job_interpreter(copy, JobUsers("nobody"))
    assert not _runs_as(nobody, copy)


@AS_ROOT
@NEEDS_PYTHON
def test_an_agent_refuses_to_start_with_an_interpreter_its_job_users_cannot_run(sandbox):
    home = sandbox / "closed"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "python").symlink_to(PYTHON)
    home.chmod(0o700)
    state = sandbox / "state"
    blocked = RunnerOptions(job_python=home / "bin" / "python")
    with pytest.raises(ValueError, match=f"{home} is mode 0700"):
        build_runner(blocked, state)
    assert not state.exists()  # refused before anything was made
    runner = build_runner(RunnerOptions(job_python=Path(PYTHON)), state)
    assert runner.interpreter == PYTHON
    result = subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start", "--gpus", "A100-80G:1",
         "--market", "http://127.0.0.1:9", "--state-dir", str(sandbox / "cli-state"),
         "--job-python", str(home / "bin" / "python")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPOTGPU_AGENT_TOKEN": "x", "COLUMNS": "300"},
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "cannot execute" in out and "0700" in out and "Traceback" not in out, out
    assert not (sandbox / "cli-state").exists()
