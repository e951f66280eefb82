"""The ``spotgpu`` command (typer + rich, as Prefect's own CLI): the app, its groups, and the
few commands that need no market.

The commands live by what they touch: ``service_cmds`` (``server start``), ``agent_cmds``
(``agent start``), ``access`` (``admin ...``, ``keys ...``), ``nodes`` (``node ...``), ``pool``
(``pool ...``, ``blocks save``) and ``market_cmds`` (``prices``, ``estimate``, ``bids``,
``nodes``); ``common`` holds what they share. Each imports its heavy parts (Prefect, the
service, the agent) inside the command, so ``spotgpu --help`` starts fast.
"""

from __future__ import annotations

import typer
from rich.table import Table

import prefect_spotgpu
from prefect_spotgpu.cli import (
    access,
    agent_cmds,
    key_rotation,
    market_cmds,
    nodes,
    pool,
    service_cmds,
)
from prefect_spotgpu.cli.common import console

app = typer.Typer(
    name="spotgpu",
    help="A spot market for idle GPUs, used from Prefect.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(agent_cmds.agent_app, name="agent")
app.add_typer(service_cmds.server_app, name="server")
service_cmds.server_app.command("rotate-key")(key_rotation.rotate_key)
app.add_typer(access.admin_app, name="admin")
app.add_typer(access.keys_app, name="keys")
app.add_typer(nodes.node_app, name="node")
app.add_typer(pool.pool_app, name="pool")
app.add_typer(pool.blocks_app, name="blocks")


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
    prefect_database_url: str = typer.Option(
        None,
        help="The Prefect server's database (postgresql+asyncpg://...): use PostgreSQL to fan "
        "out to more than a few dozen children at once (default: SQLite under --home).",
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
        run_demo(
            console,
            directory,
            steps=steps,
            keep_running=keep_running,
            prefect_database_url=prefect_database_url,
        )
    except DemoError as exc:
        console.print(f"demo failed: {exc}", style="red", markup=False, soft_wrap=True)
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


app.command()(market_cmds.prices)
app.command()(market_cmds.estimate)
app.command()(market_cmds.bids)
app.command()(market_cmds.nodes)


if __name__ == "__main__":  # pragma: no cover
    app()
