"""The ``spotgpu`` command (typer + rich, as Prefect's own CLI)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer
from rich.console import Console
from rich.table import Table

import prefect_spotgpu
from prefect_spotgpu.cli import access as access_cli
from prefect_spotgpu.cli import nodes as node_cli
from prefect_spotgpu.cli import pool as pool_cli

if TYPE_CHECKING:
    import httpx

app = typer.Typer(
    name="spotgpu",
    help="A spot market for idle GPUs, used from Prefect.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
server_app = typer.Typer(help="Run the market service.", no_args_is_help=True)
admin_app = typer.Typer(help="Administer a running market service.", no_args_is_help=True)
agent_app = typer.Typer(help="Run the node agent on a GPU host.", no_args_is_help=True)
app.add_typer(agent_app, name="agent")
app.add_typer(server_app, name="server")
app.add_typer(admin_app, name="admin")
app.add_typer(access_cli.keys_app, name="keys")
app.add_typer(node_cli.node_app, name="node")
app.add_typer(pool_cli.pool_app, name="pool")
app.add_typer(pool_cli.blocks_app, name="blocks")
access_cli.register(admin_app)  # grant-provider, revoke-keys, revoke-node, ...

DEFAULT_MARKET = "http://127.0.0.1:4300"


@app.command()
def version() -> None:
    """Print the installed version."""
    console.print(prefect_spotgpu.__version__)


@app.command()
def models() -> None:
    """List the GPU models the market sells, with their reference on-demand prices."""
    from prefect_spotgpu.market import DEFAULT_CATALOG

    table = Table(title="GPU models")
    table.add_column("model")
    table.add_column("memory", justify="right")
    table.add_column("on-demand / GPU-hour", justify="right")
    table.add_column("also known as")
    for model in DEFAULT_CATALOG:
        table.add_row(
            model.name,
            f"{model.memory_gb} GB",
            f"{model.on_demand_price:.2f}",
            ", ".join(model.aliases),
        )
    console.print(table)


@app.command()
def demo(
    steps: int = typer.Option(500, min=20, max=100_000, help="Training steps of the run."),
    home: str = typer.Option(
        None, help="Directory for the stack's databases, logs and checkpoints (default: new)."
    ),
    keep_running: bool = typer.Option(
        True, help="Keep the stack up after the timeline, until Ctrl-C (to explore the UI)."
    ),
) -> None:
    """Run the whole stack locally and a pretraining flow through a reclaim.

    Starts a Prefect server with its UI, the market service (SQLite), two node agents with
    declared GPUs and a spot-gpu worker; deploys the example flows; runs the pretraining flow;
    reclaims its node mid-run; prints the timeline and the cost against on-demand. Ctrl-C
    stops every process it started.
    """
    import tempfile
    from pathlib import Path

    from prefect_spotgpu.cli.demo import DemoError, run_demo

    directory = Path(home) if home else Path(tempfile.mkdtemp(prefix="spotgpu-demo-"))
    try:
        run_demo(console, directory, steps=steps, keep_running=keep_running)
    except DemoError as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        raise typer.Exit(1) from None


@app.command()
def simulate(
    rounds: int = typer.Option(6, min=1, max=100, help="Clearing rounds to simulate."),
    seed: int = typer.Option(2026, help="Random seed for the simulated bids."),
) -> None:
    """Simulate a small market for a few rounds and print each pool's price (no processes).

    Bids arrive every round, the market clears, and in round 3 an owner reclaims a node:
    its jobs get a 5-minute notice and, where a free node exists, a migration reservation.
    """
    from prefect_spotgpu.cli.simulate import simulate
    from prefect_spotgpu.market import DEFAULT_CATALOG

    for rnd in simulate(rounds=rounds, seed=seed):
        table = Table(title=f"round {rnd.number}", title_justify="left")
        for column, justify in (
            ("pool", "left"),
            ("free/total", "right"),
            ("clearing", "right"),
            ("on-demand", "right"),
            ("discount", "right"),
            ("waiting", "right"),
        ):
            table.add_column(column, justify=justify)
        for quote in rnd.decision.quotes:
            on_demand = DEFAULT_CATALOG.get(quote.gpu_model).on_demand_price
            price = quote.clearing_price
            table.add_row(
                f"{quote.gpu_model} {quote.region}",
                f"{quote.gpus_free}/{quote.gpus_total}",
                "-" if price is None else f"{price:.2f}",
                f"{on_demand:.2f}",
                "-" if price is None else f"{1 - price / on_demand:.0%}",
                str(quote.waiting_bids),
            )
        console.print(table)
        placed = len(rnd.decision.placements)
        console.print(
            f"  {placed} placements, {len(rnd.decision.notices)} notices, "
            f"charged {rnd.decision.charges.total() / 1e6:.4f} this round"
        )
        for event in rnd.events[:6]:
            console.print(f"  [yellow]{event}[/yellow]")
        if len(rnd.events) > 6:
            console.print(f"  [yellow]... and {len(rnd.events) - 6} more[/yellow]")
    console.print("[green]simulation complete[/green]: the market cleared every round.")


@server_app.command("start")
def server_start(
    db: str = typer.Option(
        None,
        "--db",
        envvar="SPOTGPU_DB_URL",
        help="SQLAlchemy URL (default: SQLite in ~/.spotgpu). PostgreSQL: "
        "postgresql+psycopg://user@host/db",
    ),
    host: str = typer.Option("127.0.0.1", envvar="SPOTGPU_HOST", help="Interface to bind."),
    port: int = typer.Option(4300, envvar="SPOTGPU_PORT", min=1, max=65535, help="Port."),
    tick_seconds: float = typer.Option(None, help="Seconds between clearing ticks (1)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Start the market service: API, migrations, the per-second tick and webhooks.

    Run several against one PostgreSQL database for more API capacity: exactly one of them
    leads the tick loop at a time. The admin key is SPOTGPU_ADMIN_KEY, or generated once into
    ~/.spotgpu/admin_key.
    """
    from pydantic import ValidationError

    from prefect_spotgpu.service.server import serve
    from prefect_spotgpu.service.settings import ServiceSettings

    overrides = {"host": host, "port": port}
    if db is not None:
        overrides["db_url"] = db
    if tick_seconds is not None:
        overrides["tick_seconds"] = tick_seconds
    try:
        settings = ServiceSettings(**overrides)
    except ValidationError as exc:
        console.print(f"[red]bad setting[/red]: {exc}")
        raise typer.Exit(2) from None
    console.print(
        f"market service on http://{settings.host}:{settings.port} "
        f"(database: {settings.database_url().split('@')[-1]}); "
        f"API docs at /docs"
    )
    from prefect_spotgpu.service.db import DatabaseUnavailable

    try:
        serve(settings, log_level=log_level)
    except DatabaseUnavailable as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None


def _admin_client(market: str):
    import httpx

    from prefect_spotgpu.service.settings import ServiceSettings

    key = ServiceSettings().resolved_admin_key()
    return httpx.Client(
        base_url=market.rstrip("/") + "/api/v1",
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
    )


@contextlib.contextmanager
def _market_client(market: str, api_key: str | None = None) -> Iterator[httpx.Client]:
    """A client of the market's API; an unreachable market is a one-line error naming it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(
            base_url=market.rstrip("/") + "/api/v1", timeout=30, headers=headers
        ) as client:
            yield client
    except httpx.TransportError as exc:
        console.print(f"[red]cannot reach the market at {market}[/red]: {exc}", soft_wrap=True)
        raise typer.Exit(1) from None


def _fail(response) -> None:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    console.print(f"[red]error {response.status_code}[/red]: {detail}")
    raise typer.Exit(1)


@admin_app.command("create-tenant")
def admin_create_tenant(
    name: str = typer.Argument(..., help="Tenant name (letters, digits, '-', '_', '.')."),
    credit: float = typer.Option(None, help="Starting credit (default: the service's, 10)."),
    market: str = typer.Option(
        DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
    ),
    key_file: Path | None = access_cli.WRITE_KEY,
) -> None:
    """Create a tenant and print its API key (shown once), or write it to --key-file."""
    import httpx

    body = {"name": name}
    if credit is not None:
        body["starting_credit"] = credit
    try:
        with _admin_client(market) as client:
            response = client.post("/tenants", json=body)
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot reach the market at {market}[/red]: {exc}")
        raise typer.Exit(1) from None
    if response.status_code != 201:
        _fail(response)
    tenant = response.json()
    console.print(
        f"tenant [bold]{tenant['name']}[/bold] (id {tenant['id']}), balance {tenant['balance']:.2f}"
    )
    if key_file is None:
        console.print(f"API key: {tenant['api_key']}")
        return
    access_cli.write_key(key_file, tenant["api_key"])
    console.print(f"API key written to {key_file}")


@admin_app.command("tenants")
def admin_tenants(
    market: str = typer.Option(
        DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
    ),
) -> None:
    """List tenants and their balances."""
    with _admin_client(market) as client:
        response = client.get("/tenants")
    if response.status_code != 200:
        _fail(response)
    table = Table(title="tenants")
    for column in ("id", "name", "balance"):
        table.add_column(column)
    for t in response.json():
        table.add_row(str(t["id"]), t["name"], f"{t['balance']:.4f}")
    console.print(table)


@agent_app.command("start")
def agent_start(
    market: str = typer.Option(
        DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
    ),
    token_file: str = typer.Option(
        None,
        help="File holding the node's agent token (sgn_...), or the owner's API key (sgk_...) "
        "to register this host as a node (or to issue a new token to the owner's node of this "
        "name). Default: the SPOTGPU_AGENT_TOKEN environment variable. Never on the command "
        "line, which every user of the host can read. The node's token is then kept in the "
        "state directory, and neither is needed again.",
    ),
    runner: str = typer.Option(
        "process",
        help="process (default: local processes; the single-tenant choice) or docker "
        "(containers: the multi-tenant runner).",
    ),
    gpus: str = typer.Option(
        None,
        help="Declare an inventory instead of NVML discovery, "
        "e.g. A100-80G:2 (machines without NVIDIA GPUs).",
    ),
    name: str = typer.Option(None, help="Node name when registering (default: hostname)."),
    region: str = typer.Option(None, help="Region when registering, e.g. eu-west."),
    reserve_price: float = typer.Option(None, help="Reserve price per GPU-hour when registering."),
    capacity: str = typer.Option(
        "spot",
        help="spot (default: idle GPUs, auctioned, preemptible) or on_demand (sold at the "
        "model's on-demand price, never outbid) when registering.",
    ),
    state_dir: str = typer.Option(
        None,
        help="Agent state: the node token, the jobs' directories (default "
        "$SPOTGPU_HOME/agent-NAME; SPOTGPU_HOME is ~/.spotgpu, or /var/lib/spotgpu for root).",
    ),
    checkpoint_root: str = typer.Option(
        None,
        help="Where jobs' local checkpoints go: one directory per tenant (tenant-ID), which "
        "containers see at /spotgpu/checkpoints; a job's own local path is never used. Point "
        "it at storage every node shares, or a run resumes elsewhere without its local "
        "checkpoints. Default: STATE_DIR/checkpoints for the docker runner and for process "
        "jobs isolated under root; otherwise process jobs keep their own checkpoint path.",
    ),
    job_user: str = typer.Option(
        "auto",
        help="Who jobs run as when the agent runs as root. auto: each job its own uid "
        "(--job-uid-base + allocation id mod 100000) and one group per tenant (base + tenant "
        "id). A user name or uid: every job as that user (weaker: jobs share a uid, so one "
        "may read another's environment). Not as root, jobs run as the agent's user and are "
        "not isolated.",
    ),
    job_uid_base: int = typer.Option(
        200_000,
        help="First uid of --job-user auto, also the base of the tenant gids; "
        "uids BASE..BASE+99999 and gids BASE+TENANT must be unused on the host.",
    ),
    job_pids_limit: int = typer.Option(
        4096, min=16, help="Docker runner: the most processes (and threads) per container."
    ),
    job_memory: str = typer.Option(
        None,
        help="Docker runner: memory limit per container, e.g. 64g (default: none; a GPU "
        "job's host memory varies too much for one default).",
    ),
    heartbeat_seconds: float = typer.Option(5.0, min=0.1, help="Seconds between heartbeats."),
    grace_seconds: float = typer.Option(
        5.0, min=0.0, help="SIGTERM-to-SIGKILL grace when stopping a job."
    ),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Run the node agent: discover GPUs, register, heartbeat, run assigned jobs.

    On a notice it sends SIGUSR1 to the job's main process and writes the notice file; after
    the job's final save (or at the deadline) it stops the job and reports the outcome. Run as
    root, it runs each job as an unprivileged user of its own (see --job-user).
    """
    import logging
    import signal as signals
    import socket
    from pathlib import Path

    from prefect_spotgpu.agent.agent import Agent, AgentError
    from prefect_spotgpu.agent.configure import (
        RunnerOptions,
        agent_token,
        build_runner,
        default_state_dir,
    )
    from prefect_spotgpu.agent.discovery import (
        DiscoveryError,
        discover_nvml,
        parse_declared,
        telemetry_nvml,
    )

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if log_level.lower() != "debug":  # a line per request (one a second, at least): noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    name = name or socket.gethostname()
    state = Path(state_dir).absolute() if state_dir else default_state_dir(name)
    options = RunnerOptions(
        kind=runner,
        checkpoint_root=Path(checkpoint_root) if checkpoint_root else None,
        job_user=job_user,
        job_uid_base=job_uid_base,
        pids_limit=job_pids_limit,
        memory=job_memory,
    )
    try:
        token = agent_token(token_file)
        inventory = parse_declared(gpus) if gpus else discover_nvml()
        job_runner = build_runner(options, state)
    except (DiscoveryError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    agent = Agent(
        market=market,
        token=token,
        runner=job_runner,
        gpus=inventory,
        declared=bool(gpus),
        state_dir=state,
        name=name,
        region=region,
        reserve_price=reserve_price,
        capacity=capacity.replace("-", "_"),
        heartbeat_seconds=heartbeat_seconds,
        grace_seconds=grace_seconds,
        telemetry=None if gpus else telemetry_nvml,
    )
    signals.signal(signals.SIGTERM, lambda *_: agent.shutdown())
    try:
        agent.run()
    except AgentError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        agent.shutdown()


# ---------------------------------------------------------------- prices and estimates


@app.command()
def prices(
    market: str = typer.Option(
        DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
    ),
    forecast: bool = typer.Option(False, help="Add each pool's forecast for the next hours."),
    hours: int = typer.Option(24, min=1, max=336, help="Hours ahead to forecast."),
) -> None:
    """Every pool's current quote and a sparkline of its clearing price over the last 24 hours
    (hourly closes; on-demand pools sell at a fixed price); with --forecast, its expected price
    ahead and the forecast's error measured on held-back history."""
    with _market_client(market) as client:
        response = client.get("/prices")
        if response.status_code != 200:
            _fail(response)
        table = Table(title="Spot prices per GPU-hour", title_justify="left")
        columns = ["pool", "free/total", "clearing", "last 24 h", "on-demand", "discount"]
        columns += ["waiting bids"]
        if forecast:
            columns += [f"next {hours} h: low / mean / high", "cheapest hour", "error (MAE)"]
        for name in columns:
            table.add_column(
                name,
                justify="left" if name in ("pool", "last 24 h") else "right",
                no_wrap=name == "last 24 h",
            )
        for q in response.json():
            price = q["clearing_price"] or q["reserve_price"]
            spot = q.get("capacity", "spot") == "spot"
            row = [
                f"{q['gpu_model']} {q['region']}" + ("" if spot else " (on-demand)"),
                f"{q['gpus_free']}/{q['gpus_total']}",
                "-" if price is None else f"{price:.2f}",
                _sparkline_cell(client, q["gpu_model"], q["region"]) if spot else "fixed",
                f"{q['on_demand_price']:.2f}",
                "-" if price is None else f"{1 - price / q['on_demand_price']:.0%}",
                str(q["waiting_bids"]),
            ]
            if forecast and spot:
                row += _forecast_cells(client, q["gpu_model"], q["region"], hours)
            elif forecast:
                row += ["fixed price", "-", "-"]
            table.add_row(*row)
        console.print(table)


def _sparkline_cell(client, gpu_model: str, region: str) -> str:
    import time

    from prefect_spotgpu.cli.views import hourly_closes, sparkline, squeeze

    response = client.get(f"/prices/{gpu_model}/{region}/hourly", params={"days": 1})
    if response.status_code == 409:
        return "no history yet"
    if response.status_code != 200:
        _fail(response)
    closes = hourly_closes(response.json(), now=time.time())
    return sparkline(squeeze(closes, 24 if console.width >= 120 else 12))


def _forecast_cells(client, gpu_model: str, region: str, hours: int) -> list[str]:
    response = client.get(f"/prices/{gpu_model}/{region}/forecast", params={"hours": hours})
    if response.status_code == 409:
        return ["no history yet", "-", "-"]
    if response.status_code != 200:
        _fail(response)
    body = response.json()
    expected = [p["expected"] for p in body["points"]]
    cheapest = min(body["points"], key=lambda p: p["expected"])
    error = body["error"]
    return [
        f"{min(p['low'] for p in body['points']):.2f} / {sum(expected) / len(expected):.2f} / "
        f"{max(p['high'] for p in body['points']):.2f}",
        f"{cheapest['at'][5:16].replace('T', ' ')} UTC ({cheapest['expected']:.2f})",
        "-" if error is None else f"{error['mae']:.3f} (naive {error['naive_mae']:.3f})",
    ]


@app.command()
def estimate(
    gpu_model: str = typer.Option(..., "--model", help="GPU model, e.g. A100-80G."),
    gpu_hours: float = typer.Option(..., min=0.001, help="GPU-hours of work."),
    max_price: float = typer.Option(..., "--cap", min=0.001, help="Spot cap per GPU-hour."),
    deadline: str = typer.Option(..., help="Finish by, ISO 8601 with a timezone."),
    gpus: int = typer.Option(1, min=1, max=16, help="GPUs on one node."),
    region: str = typer.Option("any", help="Region, or any."),
    start: str = typer.Option(None, help="Not before (ISO 8601; default now)."),
    market: str = typer.Option(
        DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
    ),
) -> None:
    """Expected cost and finish of some GPU-hours by a deadline, against on-demand."""
    body = {"gpu_model": gpu_model, "gpu_hours": gpu_hours, "max_price": max_price,
            "deadline": deadline, "gpus": gpus, "region": region}  # fmt: skip
    if start:
        body["start"] = start
    with _market_client(market) as client:
        response = client.post("/estimate", json=body)
    if response.status_code != 200:
        _fail(response)
    e = response.json()
    finish = e["expected_finish"] or "not on spot alone before the deadline"
    console.print(
        f"{gpu_hours:g} GPU-hours of {e['gpu_model']} at most {max_price:.2f}/GPU-h "
        f"by {deadline}:\n"
        f"  expected cost   {e['expected_cost']:.2f} (on-demand {e['on_demand_cost']:.2f}, "
        f"saving {e['saving']:.0%})\n"
        f"  expected finish {finish}\n"
        f"  P(deadline met on spot alone) {e['p_meet_deadline_on_spot']:.0%}; expected "
        f"on-demand fallback {e['expected_on_demand_gpu_hours']:g} GPU-hours"
    )


# ---------------------------------------------------------------- bids and nodes

MARKET = typer.Option(
    DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
)


@app.command()
def bids(
    status: Literal["open", "held", "cancelled", "finished"] | None = typer.Option(
        None, help="Only bids in this status."
    ),
    limit: int = typer.Option(50, min=1, max=10_000, help="Show the latest N bids."),
    api_key_file: Path | None = access_cli.API_KEY_FILE,
    market: str = MARKET,
) -> None:
    """Your bids: each one's current allocation, price and cost so far, and your balance."""
    from prefect_spotgpu.cli.views import bids_table, parse_time

    with _market_client(market, access_cli.tenant_key(api_key_file)) as client:
        me = _get(client, "/me")
        params = {"limit": min(limit, PAGE_SIZE), **({"status": status} if status else {})}
        shown = _get_pages(client, "/bids", params, up_to=limit)  # newest first
        allocations: dict[int, list[dict]] = {b["id"]: [] for b in shown}
        # every allocation of a shown bid started after that bid was made: page back to there
        since = min((parse_time(b["created_at"]) for b in shown), default=float("inf"))
        for page in _pages(client, "/allocations", {"limit": 1000}):
            for a in page:
                if a["bid_id"] in allocations:
                    allocations[a["bid_id"]].append(a)
            if not page or page[-1]["started_at"] < since - 1:
                break
        for attempts in allocations.values():
            attempts.sort(key=lambda a: a["id"])
    console.print(bids_table(shown[::-1], allocations, tenant=me))


@app.command()
def nodes(api_key_file: Path | None = access_cli.API_KEY_FILE, market: str = MARKET) -> None:
    """Your nodes (every node, with the admin key): state, GPUs in use, the agent's last
    telemetry, reserve price and the age of the last heartbeat."""
    import time

    from prefect_spotgpu.cli.views import nodes_table

    with _market_client(market, access_cli.tenant_key(api_key_file)) as client:
        listed = _get(client, "/nodes")
        busy = {n["id"]: n["gpus_busy"] for n in _get(client, "/market/nodes")}
    console.print(nodes_table(listed, busy, now=time.time()))


def _get(client: httpx.Client, path: str, params: dict | None = None):
    response = client.get(path, params=params)
    if response.status_code != 200:
        _fail(response)
    return response.json()


PAGE_SIZE = 100
"""Rows the CLI asks for in one page of a paged list."""


def _pages(client: httpx.Client, path: str, params: dict) -> Iterator[list[dict]]:
    """Each page of a paged list (newest first), following the ``Link: rel="next"`` header."""
    response = client.get(path, params=params)
    while True:
        if response.status_code != 200:
            _fail(response)
        yield response.json()
        following = response.links.get("next", {}).get("url")
        if not following:
            return
        response = client.get(following)


def _get_pages(client: httpx.Client, path: str, params: dict, up_to: int) -> list[dict]:
    """The newest ``up_to`` rows of a paged list."""
    rows: list[dict] = []
    for page in _pages(client, path, params):
        rows += page
        if len(rows) >= up_to:
            break
    return rows[:up_to]


if __name__ == "__main__":  # pragma: no cover
    app()
