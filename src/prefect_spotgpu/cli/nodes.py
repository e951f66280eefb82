"""``spotgpu node ...``: a provider takes its node back, drains it, or offers it again.

``reclaim`` gives every job on the node its 5-minute notice (each saves a final checkpoint and
resumes elsewhere; the market reserves a free node for it at once when there is one); ``drain``
lets running jobs finish and takes no new ones; ``live`` offers the node's GPUs again. NODE is
the node's id or its name. The key is the provider's own (SPOTGPU_API_KEY or --api-key-file).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from prefect_spotgpu.cli.common import (
    API_KEY_FILE,
    MARKET,
    busy_gpus,
    call,
    console,
    market_client,
    tenant_key,
)
from prefect_spotgpu.protocol import NodeState

if TYPE_CHECKING:
    from prefect_spotgpu.messages import NodeResponse

node_app = typer.Typer(
    help="Take your node back (reclaim), drain it, or offer it again (live).",
    no_args_is_help=True,
)
NODE = typer.Argument(..., help="Your node: its id or its name.")

WHAT_HAPPENS = {
    NodeState.RECLAIMED: "every job on it gets its notice now (SIGUSR1, a webhook, a Prefect "
    "event), saves a final checkpoint and resumes on another node",
    NodeState.DRAINING: "its running jobs finish; it takes no new ones",
    NodeState.LIVE: "its GPUs are offered again from the next tick",
}


def _node(client, node: str) -> NodeResponse:
    from prefect_spotgpu.messages import NodeResponse

    mine = call(client, "GET", "/nodes", 200, reply=list[NodeResponse])
    for row in mine:
        if str(row.id) == node or row.name == node:
            return row
    known = ", ".join(f"{n.id} ({n.name})" for n in mine) or "none"
    console.print(
        f"you have no node {node!r}; yours: {known}", style="red", soft_wrap=True, markup=False
    )
    raise typer.Exit(1)


def _set_state(node: str, state: str, api_key_file: Path | None, market: str) -> None:
    with market_client(market, tenant_key(api_key_file)) as client:
        row = _node(client, node)
        busy = busy_gpus(client)
        changed = call(
            client, "PATCH", f"/nodes/{row.id}", 200, reply=type(row), json={"state": state}
        )
    used = busy.get(row.id, 0)
    console.print(
        f"node {row.id} ({row.name}): {row.state} -> {changed.state}; "
        f"{used} of {row.gpu_count} GPUs in use: {WHAT_HAPPENS[state]}",
        soft_wrap=True,
        markup=False,
    )


@node_app.command("reclaim")
def reclaim(node: str = NODE, api_key_file: Path | None = API_KEY_FILE, market: str = MARKET):
    """Take the node back: its jobs get their notice and resume elsewhere."""
    _set_state(node, NodeState.RECLAIMED, api_key_file, market)


@node_app.command("drain")
def drain(node: str = NODE, api_key_file: Path | None = API_KEY_FILE, market: str = MARKET):
    """Let the node's running jobs finish, and take no new ones."""
    _set_state(node, NodeState.DRAINING, api_key_file, market)


@node_app.command("live")
def live(node: str = NODE, api_key_file: Path | None = API_KEY_FILE, market: str = MARKET):
    """Offer the node's GPUs again."""
    _set_state(node, NodeState.LIVE, api_key_file, market)
