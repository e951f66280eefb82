"""The process runner: each job a local process, the leader of its own process group.

Signals (docs/operators/architecture.md#design-4): the notice is SIGUSR1 to the job's *main process
only* — never its group: SIGUSR1's default action is to terminate, so every process without a
handler (DataLoader workers, wrappers) would die. The stop at the end of a notice is SIGKILL to the
whole group and to every other process of the job (its own uid, see ``isolation``): a process that
left the group with ``setsid`` is stopped too. Other stops (a cancelled run, the agent shutting
down) send SIGTERM first and SIGKILL after a grace period.

Jobs are hostile (docs/operators/architecture.md#design-7): a job gets a clean environment
(:func:`process_environment`) and, under root, a user of its own. Its pid is recorded in its
directory (``isolation.PID_NAME``); ``reconcile`` kills by it only while the pid still is that job
(its environment says so).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prefect_spotgpu.agent.isolation import (
    PID_NAME,
    JobUser,
    JobUsers,
    job_marker,
    kill_job_processes,
    open_job_log,
    prepare_job_dirs,
    read_job_file,
    read_pid,
    retire_workdir,
    uids_in_use,
)
from prefect_spotgpu.agent.keeper import (
    ANSWER_PID,
    EXIT_NAME,
    SPEC_COMMAND,
    SPEC_ENV,
    SPEC_EXIT_FILE,
    START_FAILED,
)
from prefect_spotgpu.agent.runners.runner import (
    JobFault,
    JobHandle,
    JobRequest,
    Progress,
    checkpoint_location,
    clear_job_files,
    last_line_of,
    record_pid,
    write_notice,
)
from prefect_spotgpu.protocol import Runner

logger = logging.getLogger("prefect_spotgpu.agent")

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
KEEPER = (Path(__file__).parent.parent / "keeper.py").read_text()
"""The job's keeper (``agent/keeper.py``), given to the job's interpreter as its code."""
TAIL_BYTES = 4096
"""How much of the end of a job's log is read for its last line."""


@dataclass(eq=False, kw_only=True)
class ProcessJob(JobHandle):
    """A process job: its ``ref`` is its pid, the leader of its process group. ``log`` reads
    its output file (``job.log``) by descriptor, opened before the job ran: whatever the job
    later puts at that name (a link to a file it may not read), the agent reads its own log."""

    process: subprocess.Popen | None  # None: adopted from an earlier agent (not our child)
    job_pid: int  # the job's own process (the keeper's child): where the notice goes
    user: JobUser
    log: int | None = None

    @property
    def pid(self) -> int:
        """The keeper's pid: the leader of the job's process group."""
        return int(self.ref)

    @property
    def job_ref(self) -> str:
        return str(self.job_pid)

    def poll(self) -> int | None:
        if self.process is not None:
            return self.process.poll()
        if _is_job(self.pid, self.request.workdir):  # (its pid, reused since, is not)
            return None
        return recorded_exit(self.request.workdir)


def process_environment(
    request: JobRequest, checkpoint_url: str | None, interpreter: str = sys.executable
) -> dict[str, str]:
    """A process job's whole environment: safe defaults, the job's own variables, then the
    GPUs and the ``SPOTGPU_*`` variables — nothing of the agent's (its token included)."""
    workdir = str(request.workdir)
    return {
        "PATH": f"{Path(interpreter).parent}:{SAFE_PATH}",
        "HOME": workdir,
        "LANG": os.environ.get("LANG") or "C.UTF-8",
        "PREFECT_HOME": f"{workdir}/.prefect",
        **request.thread_default(),
        **request.env,
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in request.gpu_indices),
        **request.job_variables(workdir=workdir, checkpoint_url=checkpoint_url),
    }


def _resolve_python(command: list[str], interpreter: str = sys.executable) -> list[str]:
    """A process job's ``python`` is the node's job interpreter (by default the agent's own:
    its environment has the packages the agent was installed with); any other program is
    taken as given."""
    if command and command[0] in ("python", "python3"):
        return [interpreter, *command[1:]]
    return command


def blames_the_job(exc: OSError, *, program: str, interpreter: str) -> bool:
    """Whether a process job that could not be started (``exc``, from ``Popen``) failed for
    a reason of its own: its arguments and environment are too long, or the program its
    command names (not the node's interpreter) could not be executed. Anything else is the
    node's: its interpreter, the job's directory, its user.

    >>> gone = FileNotFoundError(errno.ENOENT, "No such file or directory", "/opt/x")
    >>> blames_the_job(gone, program="/opt/x", interpreter="/venv/bin/python")
    True
    >>> denied = PermissionError(errno.EACCES, "Permission denied", "/venv/bin/python")
    >>> blames_the_job(denied, program="/venv/bin/python", interpreter="/venv/bin/python")
    False
    >>> chdir = FileNotFoundError(errno.ENOENT, "No such file or directory", "/state/alloc-7")
    >>> blames_the_job(chdir, program="/opt/x", interpreter="/venv/bin/python")
    False
    """
    if exc.errno == errno.E2BIG:
        return True
    executing = exc.filename == program  # (Popen names the program only when exec failed)
    return executing and program != interpreter


class ProcessRunner:
    """Jobs as local processes (the default, and the single-tenant choice: see ``isolation``
    for what it isolates under root).

    ``checkpoint_root``: when given, local checkpoint URLs become the tenant's directory
    under it (the agent gives one under root isolation); otherwise they are kept.
    ``interpreter``: what a job whose command starts with ``python`` runs (default: the
    agent's own, ``sys.executable``); job users must be able to run it
    (``preflight.check_job_interpreter``).
    """

    name = Runner.PROCESS.value
    default_image = None  # (processes: no image)

    def __init__(
        self,
        *,
        users: JobUsers | None = None,
        checkpoint_root: Path | None = None,
        interpreter: Path | str | None = None,
    ) -> None:
        self.users = users or JobUsers()
        self.checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        self.interpreter = os.path.abspath(interpreter or sys.executable)
        if not self.users.isolated:
            logger.warning("process runner: jobs are not isolated (%s)", self.users.describe())

    def start(self, request: JobRequest) -> ProcessJob:
        if request.image:  # never run an image's job on the host, ignoring its image
            raise JobFault(
                f"this node runs jobs as host processes (--runner process): the bid asks for "
                f"the image {request.image}, which only a Docker node (--runner docker) runs"
            )
        user = self.users.for_job(allocation_id=request.allocation_id, tenant_id=request.tenant_id)
        if user.dedicated and user.uid in uids_in_use():
            # a live job of an allocation id equal modulo the range: never share a uid (the
            # agent reports this allocation failed; the market places the bid again)
            raise ValueError(f"job uid {user.uid} is in use by another process")
        host_dir, url = checkpoint_location(request, self.checkpoint_root)
        prepare_job_dirs(request.workdir, host_dir, user, chown=self.users.isolated)
        clear_job_files(request)
        (request.workdir / EXIT_NAME).unlink(missing_ok=True)  # an earlier attempt's
        switch = {}
        if self.users.isolated:
            switch = {"user": user.uid, "group": user.gid, "extra_groups": [], "umask": 0o007}
            # (the keeper, the agent's user, switches to the job's as it starts it)
        log = open_job_log(request.workdir / "job.log")
        try:
            reader = os.open(f"/proc/self/fd/{log}", os.O_RDONLY)  # that file, to read its end
            argv = _resolve_python(request.command, self.interpreter)
            try:
                keeper, job_pid = self._start_keeper(request, argv, url, log, switch)
            except BaseException as exc:
                os.close(reader)
                if isinstance(exc, OSError) and blames_the_job(
                    exc, program=argv[0], interpreter=self.interpreter
                ):
                    raise JobFault(str(exc)) from exc
                raise
        finally:
            os.close(log)
        record_pid(request, keeper.pid)
        return ProcessJob(
            request,
            str(keeper.pid),
            time.time(),
            process=keeper,
            job_pid=job_pid,
            user=user,
            log=reader,
        )

    def _start_keeper(
        self, request: JobRequest, argv: list[str], url: str | None, log: int, switch: dict
    ) -> tuple[subprocess.Popen, int]:
        """Start the job under its keeper (``keeper``): the keeper's ``Popen`` and the job's
        pid; the ``OSError`` the job's own start raised, if it could not start."""
        spec = {
            SPEC_COMMAND: argv,
            SPEC_ENV: process_environment(request, url, self.interpreter),
            SPEC_EXIT_FILE: str(request.workdir / EXIT_NAME),
            **switch,
        }
        marker_name, _, marker = job_marker(request.workdir).decode().partition("=")
        read_end, write_end = os.pipe()
        try:
            keeper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", KEEPER, str(write_end)],
                env={"PATH": SAFE_PATH, marker_name: marker},  # (reconcile finds it by this)
                cwd=request.workdir,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(write_end,),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        with contextlib.suppress(BrokenPipeError):  # (it died: its handshake says why)
            keeper.stdin.write(json.dumps(spec).encode())
        with contextlib.suppress(BrokenPipeError):
            keeper.stdin.close()
        with os.fdopen(read_end, "rb") as said:
            told = said.read()
        try:
            answer = json.loads(told or b"{}")
        except ValueError:
            answer = {}
        if ANSWER_PID in answer:
            return keeper, int(answer[ANSWER_PID])
        keeper.wait()
        if START_FAILED in answer:
            number, message, filename = answer[START_FAILED]
            raise OSError(number, message, filename)
        raise RuntimeError(f"the job's keeper exited {keeper.returncode} before the job started")

    def ready(self, request: JobRequest) -> bool:
        return True  # nothing to fetch: the command is the node's

    def prepare(self, request: JobRequest, progress: Progress) -> None:
        pass

    def local_images(self) -> list[str]:
        return []  # processes, no images

    def notice(self, handle: ProcessJob, deadline: float) -> None:
        try:
            write_notice(handle.request, deadline)  # (fails if the job put a directory there)
        finally:
            if _parent(handle.job_pid) == handle.pid:  # the job still, never a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(handle.job_pid, signal.SIGUSR1)  # the job's main process only
            handle.signalled_at = time.time()

    def stop(self, handle: ProcessJob, grace: float = 10.0) -> None:
        """SIGTERM to the job's group, SIGKILL after ``grace`` seconds to the group and to
        every other process of the job; ``grace`` 0: SIGKILL only."""
        if grace > 0:
            _signal_group(handle.pid, signal.SIGTERM)
        if grace > 0 and handle.process is not None:  # our child: wait on it, no polling
            with contextlib.suppress(subprocess.TimeoutExpired):
                handle.process.wait(timeout=grace)
        deadline = time.monotonic() + grace  # (an adopted job is not our child: we look)
        while time.monotonic() < deadline and handle.poll() is None:
            time.sleep(0.02)
        _signal_group(handle.pid, signal.SIGKILL)
        kill_job_processes(handle.user, handle.request.workdir)
        if handle.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                handle.process.wait(timeout=5)
        if handle.log is not None:
            os.close(handle.log)
            handle.log = None
        if self.users.isolated:
            retire_workdir(handle.request.workdir)

    def poll(self, handle: ProcessJob) -> int | None:
        return handle.poll()

    def last_line(self, handle: ProcessJob) -> str | None:
        """The last non-empty line of the job's log (of its last ``TAIL_BYTES``)."""
        if handle.log is None:
            return None
        size = os.fstat(handle.log).st_size
        return last_line_of(os.pread(handle.log, TAIL_BYTES, max(0, size - TAIL_BYTES)))

    def adopt(self, request: JobRequest, ref: str, job_ref: str) -> ProcessJob | None:
        """The job an agent handed over (``agent.handover``): its keeper ``ref`` and the job's
        own pid ``job_ref``, if the keeper still is that job's; None if it is gone."""
        pid, job_pid = int(ref), int(job_ref)
        if not _is_job(pid, request.workdir):
            return None
        user = self.users.for_job(allocation_id=request.allocation_id, tenant_id=request.tenant_id)
        try:  # the file its keeper writes to: whatever the job put at the log's name since
            log = os.open(f"/proc/{pid}/fd/1", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            log = None
        return ProcessJob(request, ref, time.time(), process=None, job_pid=job_pid, user=user,
                          log=log)  # fmt: skip

    def reconcile(self, allocation_id: int, workdir: Path) -> bool:
        """Kill the job an earlier run recorded in ``workdir`` (:meth:`kill_stale`), if any,
        and forget its pid."""
        pid = read_pid(workdir / PID_NAME)
        if pid is None:
            return False
        killed = self.kill_stale(allocation_id, pid, workdir)
        (workdir / PID_NAME).unlink(missing_ok=True)
        return killed

    def kill_stale(self, allocation_id: int, pid: int, workdir: Path) -> bool:
        """SIGKILL what is left of an earlier run's job in ``workdir``: its group (if ``pid``
        still is that job) and every other process of it (the uid depends on the allocation
        only)."""
        killed = _kill_group_if_job(pid, workdir)
        user = self.users.for_job(allocation_id=allocation_id, tenant_id=None)
        return kill_job_processes(user, workdir) > 0 or killed


def recorded_exit(workdir: Path) -> int:
    """How a job whose keeper is gone ended, as its keeper recorded it (``keeper.EXIT_NAME``);
    -9 when nothing was recorded (the keeper was killed with the job)."""
    code = (read_job_file(workdir / EXIT_NAME) or {}).get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) else -signal.SIGKILL


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it waits for its parent to read it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _parent(pid: int) -> int | None:
    """``pid``'s parent, or None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_job(pid: int, workdir: Path) -> bool:
    """Whether ``pid`` runs and is a process of the job of ``workdir``. A recorded pid may
    have been reused by an unrelated process after a reboot or a long outage: the job's
    environment (:func:`job_marker`) must match."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone (or not ours to read)
    return _alive(pid) and job_marker(workdir) in environ


def _kill_group_if_job(pid: int, workdir: Path) -> bool:
    """SIGKILL the process group of ``pid`` if it still is the job of ``workdir``
    (:func:`_is_job`)."""
    if not _is_job(pid, workdir):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
        return True
    return False


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
