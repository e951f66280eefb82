"""The ``spotgpu`` command (typer + rich, as Prefect's own CLI)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

import prefect_spotgpu

app = typer.Typer(
    name="spotgpu",
    help="A spot market for idle GPUs, used from Prefect.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


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
    rounds: int = typer.Option(6, min=1, max=100, help="Clearing rounds to simulate."),
    seed: int = typer.Option(2026, help="Random seed for the simulated bids."),
) -> None:
    """Simulate a small market for a few rounds and print each pool's price.

    Bids arrive every round, the market clears, and in round 3 an owner reclaims a node:
    its jobs get a 5-minute notice and, where a free node exists, a migration reservation.
    """
    from prefect_spotgpu.demo import run_demo
    from prefect_spotgpu.market import DEFAULT_CATALOG

    for rnd in run_demo(rounds=rounds, seed=seed):
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
            f"charged {rnd.decision.charges.total():.4f} this round"
        )
        for event in rnd.events[:6]:
            console.print(f"  [yellow]{event}[/yellow]")
        if len(rnd.events) > 6:
            console.print(f"  [yellow]... and {len(rnd.events) - 6} more[/yellow]")
    console.print("[green]demo complete[/green]: the market cleared every round.")


if __name__ == "__main__":  # pragma: no cover
    app()
