"""The keeper of a process job: the job's parent, whichever agent watches it.

A process's exit status goes to its parent only. The process runner therefore starts each job
under a keeper, this file's text given to the agent's own interpreter with ``python -I -S -c``
(nothing of the package is imported, it starts in milliseconds). The keeper reads the job's
spec on its standard input (command, environment, user: never on its command line, where any
local user could read a secret), starts the job as the job's user, tells the runner the job's
pid (or why it could not start) on a descriptor, waits for it, writes how it ended to a file
in the job's directory, and ends the same way (the same exit code, or killed by the same
signal). The agent that started it reads that as it always did; an agent that *adopted* the
job after a hand-over (``agent.handover``) reads the file.

The keeper runs as the agent's user with an environment of its own (none of the job's
variables: a tenant's ``LD_PRELOAD`` never reaches it), so a job can neither signal it nor
forge its record (the file is written under a fresh name, never through a link, then renamed).
It leads the job's process group: a stop (SIGTERM, then SIGKILL, to the group) reaches both,
and the keeper outlives a SIGTERM (its handler does nothing) to record how the job ended. The
notice's SIGUSR1 goes to the job's own pid, never to the keeper. Its handlers are Python
functions, so the job starts with every signal at its default action.

Usage: ``python -I -S -c SOURCE HANDSHAKE_FD < SPEC``.
"""

import json
import os
import signal
import subprocess
import sys

EXIT_NAME = "exit"
"""The file in the job's directory that holds how the job ended: ``{"code": n}`` (a signal:
``-n``), written by its keeper."""
START_FAILED = "failed"
"""The handshake's key for a job that could not start: ``[errno, strerror, filename]``."""

SPEC_COMMAND, SPEC_ENV, SPEC_EXIT_FILE = "command", "env", "exit_file"
"""The spec's keys (a JSON object on the keeper's standard input): the job's argv, its
environment, where its keeper records how it ended; and its ``SWITCHES``."""
ANSWER_PID = "pid"
"""The handshake's key for the job's pid, once it started."""
SWITCHES = ("user", "group", "extra_groups", "umask")
"""What of the spec becomes ``Popen``'s user switch (only under root)."""


def _write_exit(path: str, code: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, json.dumps({"code": code}).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    handshake = int(argv[1])
    spec = json.loads(sys.stdin.buffer.read())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)  # the job's to act on (not inherited: a function)
    switch = {name: spec[name] for name in SWITCHES if name in spec}
    try:
        job = subprocess.Popen(
            spec[SPEC_COMMAND],
            env=spec[SPEC_ENV],
            stdin=subprocess.DEVNULL,
            close_fds=True,
            **switch,
        )
    except OSError as exc:
        failed = [exc.errno, exc.strerror, exc.filename]
        os.write(handshake, json.dumps({START_FAILED: failed}).encode())
        return 127
    os.write(handshake, json.dumps({ANSWER_PID: job.pid}).encode())
    os.close(handshake)
    code = job.wait()
    try:
        _write_exit(spec[SPEC_EXIT_FILE], code)
    except OSError as exc:  # (what the job did to its directory): its exit code still counts
        print(f"spotgpu keeper: the job's exit status was not recorded: {exc}", file=sys.stderr)
    if code < 0:  # end as the job did: killed by its signal
        if -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(-code, signal.SIG_DFL)  # (ours did nothing)
        os.kill(os.getpid(), -code)
    return code & 0xFF


if __name__ == "__main__":
    sys.exit(main(sys.argv))
