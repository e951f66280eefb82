"""The job of a ``SpotGPUCluster`` bid: one Dask worker on the node, in this very process.

``python -m prefect_spotgpu.dask.worker_job`` is the bid's plain ``job.command`` (the node's
runner and image rules are every job's). It reads its scheduler, TLS certificate and options
from the bid's sealed environment (``protocol.DASK_ENV``) and joins the scheduler over TLS as
``<bid>-<allocation>`` (a name no other allocation of the bid has).

**A notice is not a failure.** The agent's SIGUSR1 reaches this process (no nanny, no
wrapper: the worker is the job's main process); its handler is installed before anything
heavy is imported, and the notice file is watched too. At the notice the worker retires
gracefully within the deadline (``rules.retire_seconds``): it takes no new task, its running
task finishes (or, at the end of the budget, is handed back), and the scheduler moves its
results to other workers (the worker pauses, then ``Worker.close_gracefully``). Then it
acknowledges exactly as a flow job's checkpointer does (``checkpoint.write_ack``) and exits 0:
the allocation ends as a preemption with its final save, and the market places the bid again.

Exit codes: 0 at a notice (acknowledged) or when the scheduler let it go (the cluster scaled
down or closed); ``DASK_UNREACHABLE_EXIT`` when the scheduler could not be reached within
``SPOTGPU_DASK_JOIN_TIMEOUT`` seconds (the cluster reports it as such); 2 when the bid's
environment is not a Dask worker's.
"""

from __future__ import annotations

import os
import signal
import sys
import time

_noticed = False


def _on_notice(signum, frame) -> None:  # only a flag: the loop below acts on it
    global _noticed
    _noticed = True


signal.signal(signal.SIGUSR1, _on_notice)  # first: SIGUSR1's default action would kill us

from prefect_spotgpu.protocol import DASK_ENV, DASK_UNREACHABLE_EXIT, JOB_ENV  # noqa: E402


def main() -> int:
    import asyncio

    try:
        settings = Settings.from_environment(os.environ)
    except KeyError as exc:
        print(f"spotgpu: not a Dask worker job: {exc} is not set", file=sys.stderr)
        return 2
    return asyncio.run(serve(settings))


class Settings:
    """The worker's settings, from its job's environment."""

    def __init__(self, env) -> None:
        from prefect_spotgpu.dask.rules import worker_name

        self.scheduler = env[DASK_ENV.SCHEDULER]
        self.name = worker_name(
            bid=int(env[JOB_ENV.BID_ID]), allocation=int(env[JOB_ENV.ALLOCATION_ID])
        )
        self.pems = (env[DASK_ENV.TLS_CA], env[DASK_ENV.TLS_CERT], env[DASK_ENV.TLS_KEY])
        self.nthreads = int(env.get(DASK_ENV.NTHREADS, "1"))
        self.resources = parse_resources(env.get(DASK_ENV.RESOURCES, ""))
        self.memory_limit = env.get(DASK_ENV.MEMORY_LIMIT, "0")
        self.join_timeout = float(env.get(DASK_ENV.JOIN_TIMEOUT, "60"))
        self.host = env.get(DASK_ENV.WORKER_HOST) or route_to(self.scheduler)
        self.notice_file = env.get(JOB_ENV.NOTICE_FILE, "/nonexistent/notice")
        self.ack_file = env.get(JOB_ENV.ACK_FILE) or f"{self.notice_file}.ack"

    @classmethod
    def from_environment(cls, env) -> Settings:
        return cls(env)


def parse_resources(text: str) -> dict[str, float]:
    """``"GPU=1 MEM=2"`` -> ``{"GPU": 1.0, "MEM": 2.0}``."""
    pairs = (item.split("=", 1) for item in text.split())
    return {name: float(amount) for name, amount in pairs}


def route_to(address: str) -> str:
    """This node's address on its route to ``address`` (``tls://host:port``): where the
    scheduler and the other workers reach this worker."""
    import socket

    from distributed.comm import get_address_host_port

    host, port = get_address_host_port(address)
    family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(where)  # UDP: no packet is sent, the route is looked up
        return probe.getsockname()[0]


async def serve(settings: Settings) -> int:
    import asyncio

    from distributed import Worker
    from distributed.core import Status
    from distributed.security import Security

    ca, cert, key = settings.pems
    security = Security(
        tls_ca_file=ca, tls_worker_cert=cert, tls_worker_key=key, require_encryption=True
    )
    worker = Worker(
        settings.scheduler,
        name=settings.name,
        nthreads=settings.nthreads,
        resources=settings.resources,
        memory_limit=settings.memory_limit,
        security=security,
        host=settings.host,
        protocol="tls",
        death_timeout=settings.join_timeout,
        validate=False,
    )
    try:
        await asyncio.wait_for(worker, settings.join_timeout + 5)
    except Exception as exc:  # refused, unreachable, timed out: this job cannot serve
        print(
            f"spotgpu: cannot reach the Dask scheduler at {settings.scheduler} within "
            f"{settings.join_timeout:.0f} s ({type(exc).__name__}: {exc})",
            file=sys.stderr,
            flush=True,
        )
        return DASK_UNREACHABLE_EXIT
    print(f"spotgpu: Dask worker {settings.name} joined at {time.time():.3f}", flush=True)
    while not (_noticed or os.path.exists(settings.notice_file)):
        if worker.status in (Status.closing, Status.closed, Status.failed):
            await worker.finished()
            await send_prefect_records()
            print(f"spotgpu: Dask worker {settings.name} let go by its scheduler", flush=True)
            return 0
        await asyncio.sleep(0.05)
    await retire(worker, settings)
    return 0


async def retire(worker, settings: Settings) -> None:
    """The notice: retire gracefully within the deadline, then acknowledge."""
    import asyncio
    import json

    from prefect_spotgpu.checkpoint import write_ack
    from prefect_spotgpu.dask.rules import retire_seconds

    deadline = None
    try:
        with open(settings.notice_file) as f:
            deadline = float(json.load(f)["deadline"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # SIGUSR1 before the file: the default budget
    budget = retire_seconds(deadline=deadline, now=time.time())
    started = time.monotonic()
    print(f"spotgpu: notice; retiring {settings.name} (at most {budget:.0f} s)", flush=True)
    handed_back = False
    try:
        await asyncio.wait_for(_retire(worker), budget)
    except (TimeoutError, OSError):
        handed_back = True  # what still ran is the scheduler's to give to another worker
        await worker.close(reason="spot-notice-deadline")
    await send_prefect_records()  # (before the ack: the agent stops the job after it)
    seconds = round(time.monotonic() - started, 3)
    write_ack(settings.ack_file, step=None, dask_worker=settings.name, retired_seconds=seconds,
              handed_back=handed_back)  # fmt: skip
    print(f"spotgpu: retired in {seconds} s; acknowledged", flush=True)


async def _retire(worker) -> None:
    """No new task; the running one finishes; then every result moves and the worker goes.

    ``Worker.close_gracefully`` alone would remove the worker while its task runs (the
    scheduler then runs that task again elsewhere). So the worker first pauses (as Dask's
    memory pause does: the scheduler gives it nothing new and it starts none of its queued
    tasks), its running task finishes, then it retires: its results move, its queued tasks go
    back to the scheduler."""
    import asyncio

    from distributed.core import Status

    worker.status = Status.paused  # (the setter tells the scheduler)
    while worker.state.executing or worker.state.long_running:
        await asyncio.sleep(0.02)
    await worker.close_gracefully(reason="spot-notice")


PREFECT_SEND_SECONDS = 5.0  # (within ``retire_seconds``' margin before the deadline)


async def send_prefect_records(timeout: float = PREFECT_SEND_SECONDS) -> None:
    """Send what Prefect still holds of the tasks this worker ran: their state events and logs.

    Prefect records a task run's states from its events, which a background thread sends. This
    process ends with ``os._exit``, which skips the exit hooks that would send the rest: a task
    finished just before the notice would stay Running in Prefect, though its result reached
    the flow."""
    if "prefect" not in sys.modules:  # no task of Prefect's ran here
        return
    import asyncio

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    services = (EventsWorker, APILogWorker)  # (side by side: ``timeout`` in all)
    await asyncio.gather(*(s.drain_all(timeout=timeout, at_exit=False) for s in services))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the worker's thread pool must not hold the exit
