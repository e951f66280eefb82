"""A whole spot-GPU stack on one machine: the market service, node agents with declared GPUs and
a ``spot-gpu`` worker, as real processes, against a Prefect API.

The end-to-end tests, ``benchmarks/recovery.py`` and the demo use it. Each process runs in its
own session and logs to ``<home>/logs/<name>.log``; :meth:`LocalStack.stop` (or leaving the
``with`` block) stops every process it started, and the jobs those started.

    with LocalStack(home, prefect_api_url) as stack:
        stack.start_market(); stack.start_agent("node-a"); stack.start_agent("node-b")
        pool = stack.create_pool("spot")            # blocks + a spot-gpu work pool
        stack.start_worker(pool)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from prefect_spotgpu.api_client import api_base, api_client, tls
from prefect_spotgpu.protocol import JOB_ENV, Capacity, NodeState, Runner
from prefect_spotgpu.service.at_rest import private_dir


class StackError(RuntimeError):
    """A part of the stack did not come up; the message names it and its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FIRST_POLL_SECONDS = 0.05
SLOWEST_POLL_SECONDS = 0.25


def wait_for(
    predicate, timeout: float = 10.0, what: str = "the condition", interval: float | None = None
):
    """Poll ``predicate`` until it returns something truthy (returned), or raise TimeoutError.

    Every ``interval`` seconds when given; by default every ``FIRST_POLL_SECONDS`` at first,
    then a fifth less often each time, down to every ``SLOWEST_POLL_SECONDS`` from about the
    first second on: a long wait (a Prefect server starting, a run training) does not ask the
    market or Prefect twenty times a second, and a short one is seen as soon as before."""
    deadline = time.monotonic() + timeout
    pause = interval or FIRST_POLL_SECONDS
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(pause)
        if interval is None:
            pause = min(pause * 1.2, SLOWEST_POLL_SECONDS)


STACK_ENV = "SPOTGPU_STACK_HOME"
"""In the environment of every process a stack starts: how its stop finds one it missed."""


class LocalStack:
    """Processes of a local stack; see the module docstring."""

    def __init__(
        self,
        home: Path,
        prefect_api_url: str = "",
        *,
        gpu_model: str = "A100-80G",
        region: str = "local",
        tick_seconds: float = 0.2,
        heartbeat_timeout_seconds: float = 30.0,
        admin_key: str | None = None,
    ) -> None:
        self.home = private_dir(Path(home))  # a new home is 0700 (an existing one keeps its mode)
        self.logs = self.home / "logs"
        self.logs.mkdir(exist_ok=True)
        self.prefect_api_url = prefect_api_url.rstrip("/")
        self.gpu_model, self.region = gpu_model, region
        self.tick_seconds = tick_seconds
        self.heartbeat_timeout_seconds = heartbeat_timeout_seconds
        self.admin_key = admin_key or f"sgadm_{secrets.token_urlsafe(24)}"
        self.market_url = ""
        self.processes: dict[str, subprocess.Popen] = {}
        self._agent_gpus: dict[str, int] = {}  # agent name -> its declared GPUs
        self.owner_key = self.buyer_key = ""

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- processes

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None):
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            process = subprocess.Popen(
                args,
                env={**os.environ, **(env or {}), STACK_ENV: str(self.home)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.processes[name] = process
        return process

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def _wait(self, name: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            process = self.processes[name]
            if process.poll() is not None:
                raise StackError(f"{name} exited ({process.returncode}):\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise StackError(f"{name} not ready after {timeout:.0f} s:\n{self.log(name)}")
            time.sleep(0.1)

    def start_prefect_server(
        self, host: str = "127.0.0.1", database_url: str | None = None, netns: str | None = None
    ) -> str:
        """``prefect server start`` with its own SQLite database under ``home`` (or the
        PostgreSQL database at ``database_url``, ``postgresql+asyncpg://...``: a wide
        fan-out's), for a stack made without a ``prefect_api_url``; returns (and uses from
        now on) its API URL.

        ``host``: the address it listens on and is reached at (e.g. the Docker bridge's
        gateway, for flow runs in containers); ``netns``: a network namespace it runs in (a
        machine other than the GPU hosts, whose containers reach none of their host's
        services on a job network)."""
        port = free_port()
        self._spawn(
            "prefect-server",
            [
                *(("ip", "netns", "exec", netns) if netns else ()),
                *(sys.executable, "-m", "prefect", "server", "start"),
                *("--host", host, "--port", str(port)),
            ],
            env={
                "PREFECT_HOME": str(self.home / "prefect"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                # the UI asks its API here (by default the settings' port 4200, not --port)
                "PREFECT_SERVER_UI_API_URL": f"http://{host}:{port}/api",
                "PREFECT_API_DATABASE_CONNECTION_URL": database_url
                or f"sqlite+aiosqlite:///{self.home / 'prefect' / 'prefect.db'}",
            },
        )
        self.prefect_api_url = f"http://{host}:{port}/api"
        self._wait("prefect-server", lambda: _healthy(self.prefect_api_url + "/health"), 180)
        return self.prefect_api_url

    def start_market(self, db_url: str | None = None) -> str:
        """The market service on a free loopback port (SQLite under ``home`` by default),
        with two tenants: the fleet owner and the Prefect buyer."""
        port = free_port()
        self.market_url = f"http://127.0.0.1:{port}"
        self._market_db = db_url or f"sqlite:///{self.home / 'market.db'}"
        self._serve_market(port)
        admin = self.market(self.admin_key)
        owner = _created(admin.post("/tenants", json={"name": "fleet-owner"}))
        self.owner_key = owner["api_key"]
        granted = admin.put(f"/tenants/{owner['id']}/provider", json={"provider": True})
        granted.raise_for_status()  # only a provider may register nodes
        self.buyer_key = _created(
            admin.post("/tenants", json={"name": "prefect", "starting_credit": 1000})
        )["api_key"]
        return self.market_url

    def restart_market(self, down_seconds: float = 0.0) -> None:
        """Kill the market service (SIGKILL: a crash) and start it again on its port and
        database after ``down_seconds``."""
        self.kill("market")
        time.sleep(down_seconds)
        self._serve_market(int(self.market_url.rsplit(":", 1)[1]))

    def _serve_market(self, port: int) -> None:
        db = self._market_db
        self._spawn(
            "market",
            [
                *(sys.executable, "-m", "prefect_spotgpu.cli", "server", "start"),
                *("--db", db, "--port", str(port), "--tick-seconds", str(self.tick_seconds)),
                *("--log-level", "warning"),
            ],
            env={
                "SPOTGPU_ADMIN_KEY": self.admin_key,
                "SPOTGPU_HOME": str(self.home / "market"),
                "SPOTGPU_MIGRATE_AT_START": "true",  # one host, its own market
                "SPOTGPU_CHARGE_FLUSH_SECONDS": "0.5",
                "SPOTGPU_HEARTBEAT_TIMEOUT_SECONDS": str(self.heartbeat_timeout_seconds),
            },
        )
        self._wait("market", lambda: _healthy(api_base(self.market_url) + "/health"), 60)

    def market(self, key: str | None = None) -> httpx.Client:
        """A client for the market's API as ``key`` (default: the buyer)."""
        return api_client(self.market_url, key or self.buyer_key)

    def start_agent(
        self,
        name: str,
        gpus: int | None = None,
        reserve_price: float = 0.9,
        capacity: str = Capacity.SPOT,
        runner: str = Runner.PROCESS,
        job_subnet: str | None = None,
    ) -> int:
        """A node agent with ``gpus`` declared GPUs (None: as many as the last agent of that
        name had, 2 for a new one: a restarted node is the node it was); returns its node id
        once registered.

        ``capacity="on_demand"`` registers non-preemptible capacity at the on-demand price.

        The agents share one checkpoint root (as nodes share storage). The process runner's
        jobs run as the caller's user (``--job-user``): the stack is the single-tenant demo,
        whose jobs use the caller's interpreter and write the caller's files — under root that
        interpreter often lives in root's home, which the per-job users cannot reach.
        ``runner="docker"``: jobs in containers of their image, as users of their own
        (``--job-user auto``: ``home`` must then be a directory other users can traverse);
        ``job_subnet``: on a job network of that subnet (``--job-subnet``: gang members)."""
        gpus = self._agent_gpus.setdefault(name, 2) if gpus is None else gpus
        self._agent_gpus[name] = gpus
        price = ("--reserve-price", str(reserve_price)) if capacity == Capacity.SPOT else ()
        users = (
            ("--runner", Runner.DOCKER.value, "--job-user", "auto")
            if runner == Runner.DOCKER
            else ("--job-user", str(os.getuid()))
        )
        self._spawn(
            f"agent-{name}",
            [
                *(sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start"),
                *("--market", self.market_url),
                *("--gpus", f"{self.gpu_model}:{gpus}", "--name", name, "--region", self.region),
                *price,
                *("--capacity", capacity, "--heartbeat-seconds", "1"),
                *("--state-dir", str(self.home / f"agent-{name}"), "--grace-seconds", "3"),
                *("--checkpoint-root", str(self.home / "node-checkpoints")),
                *users,
                *(("--job-subnet", job_subnet) if job_subnet else ()),
            ],
            env={"SPOTGPU_AGENT_TOKEN": self.owner_key},
        )  # the key in the environment, not on the command line (ps shows that)
        owner = self.market(self.owner_key)

        def registered():
            nodes = owner.get("/nodes").json()
            return [n["id"] for n in nodes if n["name"] == name and n["state"] == NodeState.LIVE]

        self._wait(f"agent-{name}", registered, 60)
        return registered()[0]

    def start_worker(
        self, pool: str, name: str = "worker", env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """``prefect worker start --pool POOL --type spot-gpu`` as a process (``env``: more
        of its environment)."""
        process = self._spawn(
            name,
            [
                *(sys.executable, "-m", "prefect", "worker", "start"),
                *("--pool", pool, "--type", "spot-gpu", "--name", f"{name}-{os.getpid()}"),
            ],
            env={"PREFECT_API_URL": self.prefect_api_url, **(env or {})},
        )
        self._wait(name, lambda: "started!" in self.log(name, 100_000), 120)
        return process

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a process's whole session (a lost node: the agent *and* its jobs)."""
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        process.wait(timeout=30)

    def job_pids(self, agent: str) -> list[int]:
        """Process ids of the jobs an agent started (each leads its own session), only those
        still running as that allocation's job (a recorded pid may have been reused)."""
        pids = []
        for pid_file in (self.home / f"agent-{agent}").glob("alloc-*/pid"):
            alloc = pid_file.parent.name.removeprefix("alloc-")
            with contextlib.suppress(ValueError, OSError):
                pid = int(pid_file.read_text())
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                if f"{JOB_ENV.ALLOCATION_ID}={alloc}".encode() in environ.split(b"\0"):
                    pids.append(pid)
        return pids

    def stop(self) -> None:
        """Stop every process, agents' jobs included: SIGTERM, then SIGKILL."""
        agents = [n.removeprefix("agent-") for n in self.processes if n.startswith("agent-")]
        jobs = [pid for agent in agents for pid in self.job_pids(agent)]
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pid in [p.pid for p in self.processes.values() if p.poll() is None] + jobs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        for pid in self._strays():  # started as the stop came (a Ctrl-C mid-spawn): unrecorded
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _strays(self) -> list[int]:
        """Live processes this stack started (``STACK_ENV`` names its home in their environment)
        that ``processes`` may have missed."""
        mark, me, found = f"{STACK_ENV}={self.home}".encode(), os.getpid(), []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if (entry / "stat").read_text().split(")")[-1].split()[0] == "Z":
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if mark in environ:
                found.append(int(entry.name))
        return found

    # ---------------------------------------------------------------- Prefect side

    def create_pool(
        self,
        pool: str,
        *,
        checkpoint_dir: Path | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> str:
        """Save the market and checkpoint blocks and create a spot-gpu work pool using them.
        The checkpoint block's directory is, by default, the one the stack's agents keep the
        buyer's checkpoints and outputs in (``node-checkpoints/tenant-<id>``): the caller of a
        decorated flow and a fan-out's parent read the outputs the nodes wrote there."""
        with self._prefect_settings():
            return asyncio.run(self._create_pool(pool, checkpoint_dir, defaults or {}))

    def _prefect_settings(self):
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings(updates={PREFECT_API_URL: self.prefect_api_url})

    async def _create_pool(self, pool: str, checkpoint_dir, defaults: dict) -> str:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.client.schemas.objects import WorkPoolStorageConfiguration
        from pydantic import SecretStr

        from prefect_spotgpu import bundles
        from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket
        from prefect_spotgpu.worker import SpotGPUWorker

        market = SpotMarket(url=self.market_url, api_key=SecretStr(self.buyer_key))
        market_id = await market.save(f"{pool}-market", overwrite=True)
        if checkpoint_dir is None:  # where the nodes keep this tenant's files (its outputs)
            buyer = self.market(self.buyer_key).get("/me").json()["id"]
            checkpoint_dir = self.home / "node-checkpoints" / f"tenant-{buyer}"
        storage = CheckpointStorage(path=str(checkpoint_dir))
        storage_id = await storage.save(f"{pool}-checkpoints", overwrite=True)
        template = SpotGPUWorker.get_default_base_job_template()
        values = {
            "market": {"$ref": {"block_document_id": str(market_id)}},
            "checkpoint_storage": {"$ref": {"block_document_id": str(storage_id)}},
            "gpu_model": self.gpu_model,
            "region": self.region,
            **defaults,
        }
        for key, value in values.items():
            template["variables"]["properties"][key]["default"] = value
        storage_configuration = WorkPoolStorageConfiguration(
            **bundles.storage_configuration(
                block_name=f"{pool}-checkpoints", url=storage.url(), block_id=str(storage_id)
            )
        )
        async with get_client() as client:
            with contextlib.suppress(Exception):
                await client.delete_work_pool(pool)
            await client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type="spot-gpu",
                    base_job_template=template,
                    storage_configuration=storage_configuration,
                )
            )
        return pool

    def deploy(self, entrypoint: str, directory: Path, name: str, pool: str) -> str:
        """A deployment of ``file.py:flow`` in ``directory`` on ``pool``; its id."""
        with self._prefect_settings():
            return asyncio.run(self._deploy(entrypoint, Path(directory), name, pool))

    async def _deploy(self, entrypoint: str, directory: Path, name: str, pool: str) -> str:
        from prefect.client.orchestration import get_client

        flow_name = entrypoint.rsplit(":", 1)[1].replace("_", "-")
        async with get_client() as client:
            flow_id = await client.create_flow_from_name(flow_name)
            deployment_id = await client.create_deployment(
                flow_id=flow_id,
                name=name,
                work_pool_name=pool,
                entrypoint=entrypoint,
                path=str(directory),
                pull_steps=[
                    {
                        "prefect.deployments.steps.set_working_directory": {
                            "directory": str(directory)
                        }
                    }
                ],
            )
        return str(deployment_id)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, verify=tls()).status_code == 200
    except httpx.HTTPError:
        return False


def _created(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        raise StackError(f"the market refused: {response.status_code} {response.text}")
    return response.json()
