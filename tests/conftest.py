"""Shared fixtures: real databases (SQLite file, PostgreSQL schema) and the real service under
uvicorn on a loopback port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import sqlalchemy as sa
import uvicorn

from prefect_spotgpu.api_client import tls
from prefect_spotgpu.cli.stack import free_port, wait_for

# Prefect, before anything imports it: a private home, no analytics, and time for the test
# server to start on a 2-core machine.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="spotgpu-test-prefect-"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# Torch and NumPy, in this process and the ones it starts (the ranks of a gang, a benchmark): one
# thread each. The suite's workers already fill the two cores; a thread per core in each
# process (torch's default) spends the cores switching between them. A test of threads sets its
# own; the agents' jobs get their share from the agent (``OMP_NUM_THREADS``, the runners).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite runs in parallel workers (pytest-xdist, pyproject's addopts), each with its own
# Prefect server, services and agents. What the workers share of the host is kept apart:
# - job uids: an agent kills a stopped job's processes by its uid, so each worker's agents get
#   their own range (``--job-uid-base``, by its environment variable), apart from the default
#   range that agents started with a fresh environment use (the manual path's);
# - the Docker engine, its job containers, networks and the registry: every test that uses
#   them runs in one worker (the ``docker`` group, ``pytest_collection_modifyitems`` below);
#   a module of whole-stack tests (a Prefect server, a demo) runs in one worker, and each
#   worker that runs one has its own Prefect test server;
# - PostgreSQL: each worker its own database (``test_gw1``, ...), since the tick leader's
#   advisory lock is one per database, whatever a test's schema.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...; None: not in a worker
WORKER = int(XDIST_WORKER.removeprefix("gw")) if XDIST_WORKER else 0
if XDIST_WORKER:  # (the controller's conftest ran first: its value is inherited, replace it)
    os.environ["SPOTGPU_JOB_UID_BASE"] = str(300_000 + 100_000 * WORKER)
DOCKER_FIXTURES = {"job_image", "flow_image", "registry"}
STACK_FIXTURES = {"prefect_api_url"}
STACK_MODULES = {"test_demo.py", "test_prefect_ui.py", "test_readme.py", "test_manual_path.py"}

POSTGRES_URL = os.environ.get(
    "SPOTGPU_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
ADMIN_KEY = "sgadm_test-admin-key-0123456789"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The PostgreSQL server the tests use (this worker's database on it: the module's
    comment). Unreachable is a failure, never a skip."""
    engine = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    url = sa.engine.make_url(POSTGRES_URL)
    if XDIST_WORKER and WORKER:
        url = url.set(database=f"{url.database}_gw{WORKER}")
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
            exists = connection.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": url.database}
            ).scalar()
            if not exists:
                connection.execute(sa.text(f'CREATE DATABASE "{url.database}"'))
    except Exception as exc:  # pragma: no cover - the environment is broken
        pytest.fail(f"PostgreSQL is not reachable at {POSTGRES_URL}: {exc}", pytrace=False)
    finally:
        engine.dispose()
    return url.render_as_string(hide_password=False)


def fresh_postgres_schema(base_url: str) -> tuple[str, callable]:
    """A URL whose connections use a new, empty schema, and a function that drops it."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base_url)
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    joiner = "&" if "?" in base_url else "?"
    url = f"{base_url}{joiner}options={quote(f'-csearch_path={schema}')}"

    def drop() -> None:
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    return url, drop


@pytest.fixture(scope="session")
def prefect_api_url() -> Iterator[str]:
    """A real Prefect server (``prefect_test_harness``), started once per test session."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        url = PREFECT_API_URL.value()
        # in the environment too, as a user's shell or profile has it: child processes (the
        # decorators' bundle uploads, the CLI) find the API there, not in this one's memory
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            os.environ.pop("PREFECT_API_URL", None)


@pytest.fixture
def prefect(prefect_api_url):
    """A synchronous client of the session's Prefect server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        yield client


@pytest.fixture(scope="session")
def job_image() -> Iterator[str]:
    """A real Docker engine (started here if none runs) and this checkout's job image; the
    container tests fail, never skip, when there is no engine."""
    import docker_engine

    try:
        docker_engine.ensure_engine()
        image = docker_engine.job_image()
    except (docker_engine.EngineUnavailable, OSError, subprocess.CalledProcessError) as exc:
        exc = getattr(exc, "stderr", None) or exc
        pytest.fail(f"the container tests need a Docker engine: {exc}", pytrace=False)
    try:
        yield image
    finally:
        docker_engine.remove_job_containers()
        docker_engine.stop()
        timings = Path(tempfile.gettempdir()) / "spotgpu-test-docker-timings.json"
        timings.write_text(json.dumps(docker_engine.TIMINGS))  # (for the container work's notes)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """S3 through moto's server mode, over HTTP on a loopback port, for the session."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def sandbox() -> Iterator[Path]:
    """A directory job users can traverse (pytest's own tmp_path is closed to them)."""
    base = Path(tempfile.mkdtemp(prefix="spotgpu-sandbox-"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def registry(job_image):
    """A registry (Debian's docker-registry) on a loopback port for this session, after the
    engine (``job_image``): the pull tests fail, never skip, without one."""
    import docker_engine

    try:
        started = docker_engine.start_registry()
    except docker_engine.EngineUnavailable as exc:
        pytest.fail(f"the pull tests need a registry: {exc}", pytrace=False)
    yield started
    started.stop()


@pytest.fixture(scope="session")
def flow_image(job_image) -> str:
    """A Prefect job image of this checkout with the test flow (Prefect from PyPI: ~30 s the
    first time, cached by the engine after)."""
    import docker_engine

    try:
        return docker_engine.flow_image()
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the flow image did not build: {exc.stderr}", pytrace=False)


def one_database(reason: str):
    """Run a service test on SQLite only. The service's tests run on SQLite and PostgreSQL
    (``db_url``) wherever the behaviour can differ between them (locking, isolation, types,
    ordering, what a kill -9 leaves); a test whose behaviour is decided before any query (a
    422, a role, an in-memory cap) or is the rendering of a reply runs once, and ``reason``
    says why (the ``one_database`` marker keeps it)."""

    def apply(test):
        test = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)(test)
        return pytest.mark.one_database(reason)(test)

    return apply


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> Iterator[str]:
    """A new, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'market.db'}"
        return
    url, drop = fresh_postgres_schema(request.getfixturevalue("postgres_url"))
    yield url
    drop()


@dataclass
class Service:
    """A running market service and clients for it."""

    base_url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread
    clients: list[httpx.Client] = field(default_factory=list)
    clock: object = None  # a ManualClock, when the test drives time (``advance``)

    def advance(self, seconds: float, step: float | None = None) -> None:
        """Move the service's ``ManualClock`` on by ``seconds``, a tick every ``step`` (the
        tick interval unless given), each tick done before the next step: what the market does
        in that time, without waiting it. A tick that fails (SQLite busy under a loaded
        machine) is tried again at the next step, as the ticker does on the wall clock."""
        ticker = self.app.state.ticker
        step = step or ticker.settings.tick_seconds
        moved = 0.0
        while moved < seconds - 1e-9:
            self.clock.advance(min(step, seconds - moved))
            moved += step
            at = self.clock.time()  # a pass that began before the move does not count
            wait_for(lambda at=at: ticker.round_at >= at, 30, "a tick at the new time", 0.002)

    def flushed(self) -> None:
        """Until the tick loop has written its charges of this moment (a charge flush after
        it): what a test reads of balances then includes everything billed so far."""
        ticker = self.app.state.ticker
        at = self.clock.time() if self.clock is not None else time.time()
        if self.clock is not None:
            self.advance(ticker.settings.charge_flush_seconds)
        wait_for(lambda: ticker.last_flush >= at, 30, "a charge flush", 0.01)

    def ticked(self, ticks: int = 2) -> None:
        """Until ``ticks`` more ticks are done: what a request changed has reached the market
        and its answer the database (a test that asserts nothing happened waits for this)."""
        ticker = self.app.state.ticker
        if self.clock is not None:
            return self.advance(ticks * ticker.settings.tick_seconds)
        done = ticker.ticks + ticks
        wait_for(lambda: ticker.ticks >= done, 30, f"{ticks} ticks", 0.01)

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        client = httpx.Client(
            base_url=self.base_url + "/api/v1", headers=headers, timeout=30, verify=tls()
        )
        self.clients.append(client)
        return client

    @property
    def admin(self) -> httpx.Client:
        return self.client(ADMIN_KEY)

    def tenant(self, name: str | None = None, credit: float | None = None) -> httpx.Client:
        body = {"name": name or f"t{uuid.uuid4().hex[:8]}"}
        if credit is not None:
            body["starting_credit"] = credit
        response = self.admin.post("/tenants", json=body)
        assert response.status_code == 201, response.text
        client = self.client(response.json()["api_key"])
        client.tenant_id = response.json()["id"]
        return client

    def grant_provider(self, tenant: httpx.Client) -> None:
        """Make a tenant a provider (the operator's vetting), so it may register nodes."""
        response = self.admin.put(f"/tenants/{tenant.tenant_id}/provider", json={"provider": True})
        assert response.status_code == 200, response.text

    def node(
        self,
        owner: httpx.Client,
        gpu_model="A100-80G",
        region="eu-west",
        gpus=8,
        reserve=0.9,
        name=None,
        capacity="spot",
        **terms,
    ) -> tuple[dict, httpx.Client]:
        """A node of ``owner`` (made a provider); ``terms``: more of ``NodeCreate`` (runner)."""
        body = {
            "name": name or f"n{uuid.uuid4().hex[:8]}",
            "gpu_model": gpu_model,
            "region": region,
            "gpu_count": gpus,
            "capacity": capacity,
            **terms,
        }
        if capacity == "spot":
            body["reserve_price"] = reserve
        self.grant_provider(owner)
        response = owner.post("/nodes", json=body)
        assert response.status_code == 201, response.text
        node = response.json()
        return node, self.client(node["token"])

    def wait_for(self, predicate, timeout: float = 10.0):
        return wait_for(predicate, timeout)

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_service(db_url: str, home, port: int | None = None, clock=None, **overrides) -> Service:
    """The service on a loopback port; ``clock``: a ``ManualClock`` the test drives
    (``Service.advance``) instead of the wall clock."""
    from prefect_spotgpu.service.api import create_app
    from prefect_spotgpu.service.clock import SYSTEM
    from prefect_spotgpu.service.server import uvicorn_config
    from prefect_spotgpu.service.settings import ServiceSettings

    # webhooks go to loopback receivers in tests: private destinations are allowed unless a
    # test asks for the default (refused; tests/test_webhook_destinations.py)
    overrides.setdefault("webhook_allow_private", True)
    settings = ServiceSettings(
        db_url=db_url,
        home=home,
        admin_key=ADMIN_KEY,
        tick_seconds=0.1,
        charge_flush_seconds=0.5,
        webhook_backoff_seconds=0.2,
        **overrides,
    )
    app = create_app(settings, clock=clock or SYSTEM)
    port = port or free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # (generous: a loaded 2-core machine)
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the service did not start")
        time.sleep(0.02)
    service = Service(f"http://127.0.0.1:{port}", app, server, thread, clock=clock)
    # wait until this replica leads the tick loop (on a manual clock: and its first tick is
    # done, so that the test's first step is the next tick's)
    service.wait_for(lambda: service.client().get("/health").json()["leader"], timeout=60)
    if clock is not None:
        service.wait_for(lambda: app.state.ticker.rounds >= 1, timeout=60)
    return service


@pytest.fixture
def service(db_url, tmp_path) -> Iterator[Service]:
    svc = start_service(db_url, tmp_path / "home")
    yield svc
    svc.stop()


@pytest.fixture
def driven(db_url, tmp_path) -> Iterator[Service]:
    """The service on a ``ManualClock``: nothing ticks until the test ``advance``s it."""
    from prefect_spotgpu.service.clock import ManualClock

    svc = start_service(db_url, tmp_path / "home", clock=ManualClock())
    yield svc
    svc.stop()


class SyncASGITransport(httpx.BaseTransport):
    """httpx's ASGI transport (``httpx.ASGITransport``, which Prefect's own test fixtures use)
    for a synchronous ``httpx.Client``: each request runs on one event loop of its own thread."""

    def __init__(self, app) -> None:
        from anyio.from_thread import start_blocking_portal

        self._asgi = httpx.ASGITransport(app=app)
        self._portal_context = start_blocking_portal()
        self._portal = self._portal_context.__enter__()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def send() -> httpx.Response:
            response = await self._asgi.handle_async_request(request)
            body = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=body)

        return self._portal.call(send)

    def close(self) -> None:
        self._portal_context.__exit__(None, None, None)


class InProcessService(Service):
    """The service's app called in this process, over httpx's ASGI transport: no server, no
    tick, no leader."""

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        client = httpx.Client(
            transport=SyncASGITransport(self.app),
            base_url=self.base_url + "/api/v1",
            headers=headers,
        )
        self.clients.append(client)
        return client

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.app.state.engine.dispose()


@pytest.fixture
def api(tmp_path) -> Iterator[Service]:
    """The service for tests of request and response shape only (a 422 naming the field, a
    header, a schema): its app in process on SQLite, without the tick. Such behaviour is
    decided before any query, so it cannot differ between the databases; anything about the
    tick, leadership, locking or a real server uses ``service``."""
    from prefect_spotgpu.service.api import create_app
    from prefect_spotgpu.service.settings import ServiceSettings

    settings = ServiceSettings(
        db_url=f"sqlite:///{tmp_path / 'market.db'}", home=tmp_path / "home", admin_key=ADMIN_KEY
    )
    app = create_app(settings, background=False)
    svc = InProcessService("http://testserver", app, server=None, thread=None)
    yield svc
    svc.stop()


def pytest_collection_modifyitems(config, items):
    """In parallel workers (``--dist loadgroup``), the tests that run the whole stack are
    grouped: every test of the Docker engine in one worker, the ``docker`` group (they share
    the engine, its job containers, found by label, its networks and the registry); the tests
    of a Prefect server or a demo by module (``stack-<module>``: a module's stack fixtures are
    set up in one worker, once). The service's and the pure tests share out over the workers.

    xdist's own ``xdist_group`` marker works by appending ``@group`` to each test's id, which
    pytest 9.2 no longer lets it do (it sets ``item._nodeid``; the id is now ``item._id``), so
    the suffix is put on here, the way xdist's scheduler reads it."""
    if not getattr(config.option, "loadgroup", False):  # (set in xdist's workers only)
        return
    from _pytest.nodeid import NodeId

    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if DOCKER_FIXTURES & fixtures:
            group = "docker"
        elif STACK_FIXTURES & fixtures or item.path.name in STACK_MODULES:
            group = f"stack-{item.path.stem}"
        else:
            continue
        if "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran on a :class:`LocalStack` (its ``stack`` fixture) shows the tail
    of every process's log (the market, the agents, the worker, Prefect's server) beside its
    traceback: an end-to-end failure that does not reproduce alone is read from them."""
    from prefect_spotgpu.cli.stack import LocalStack

    report = yield
    stack = getattr(item, "funcargs", {}).get("stack")
    if report.failed and isinstance(stack, LocalStack) and stack.logs.is_dir():
        for path in sorted(stack.logs.glob("*.log")):
            report.sections.append((f"stack log {path.name}", stack.log(path.stem, 6000)))
    return report
