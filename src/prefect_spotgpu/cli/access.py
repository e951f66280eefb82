"""``spotgpu admin ...`` and ``spotgpu keys ...``: tenants, providers, keys, node tokens (and,
under ``admin image``, the image catalogue: ``cli/images.py``).

The operator creates tenants, vets who supplies GPUs (``grant-provider``), revokes keys and node
tokens; a tenant rotates its own key; a provider gets a fresh token for its node's agent. Every
key is read from the environment or a file, never from the command line (``ps`` shows argv to
every user).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from prefect_spotgpu.cli.common import (
    API_KEY_FILE,
    MARKET,
    WRITE_KEY,
    admin_client,
    call,
    console,
    fail,
    market_client,
    parsed,
    tenant_key,
    write_key,
)
from prefect_spotgpu.cli.images import image_app

if TYPE_CHECKING:
    from prefect_spotgpu.messages import TenantResponse

admin_app = typer.Typer(help="Administer a running market service.", no_args_is_help=True)
admin_app.add_typer(image_app, name="image")
keys_app = typer.Typer(
    help="Rotate your API key, or your node's agent token.", no_args_is_help=True
)


def _tenant(client, name: str) -> TenantResponse:
    from prefect_spotgpu import messages

    for tenant in call(client, "GET", "/tenants", 200, reply=list[messages.TenantResponse]):
        if tenant.name == name:
            return tenant
    console.print(f"no tenant named {name!r}", style="red", markup=False)
    raise typer.Exit(1)


def _tenant_id(client, name: str) -> int:
    return _tenant(client, name).id


@admin_app.command("grant-provider")
def grant_provider(
    name: str = typer.Argument(..., help="The tenant that may now register nodes."),
    market: str = MARKET,
) -> None:
    """Make a tenant a provider: it may register nodes and sell their GPUs."""
    _set_provider(name, True, market)


@admin_app.command("revoke-provider")
def revoke_provider(
    name: str = typer.Argument(..., help="The tenant that may no longer register nodes."),
    market: str = MARKET,
) -> None:
    """Take the provider role back; the tenant's live nodes drain (no new work)."""
    _set_provider(name, False, market)


def _set_provider(name: str, provider: bool, market: str) -> None:
    with admin_client(market) as client:
        tenant_id = _tenant_id(client, name)
        call(client, "PUT", f"/tenants/{tenant_id}/provider", 200, json={"provider": provider})
    role = "is now a provider" if provider else "is no longer a provider (its nodes drain)"
    console.print(f"[bold]{escape(name)}[/bold] {role}")


@admin_app.command("revoke-keys")
def revoke_keys(
    name: str = typer.Argument(..., help="The tenant whose API keys stop working now."),
    market: str = MARKET,
) -> None:
    """Revoke every API key of a tenant (refused at once); issue-key gives it a new one."""
    from prefect_spotgpu import messages

    with admin_client(market) as client:
        tenant_id = _tenant_id(client, name)
        revoked = call(
            client, "POST", f"/tenants/{tenant_id}/keys/revoke", reply=messages.KeysRevoked
        )
    console.print(f"revoked {revoked.revoked} key(s) of [bold]{escape(name)}[/bold]")


@admin_app.command("issue-key")
def issue_key(
    name: str = typer.Argument(..., help="The tenant to give a new API key."),
    market: str = MARKET,
) -> None:
    """Issue a tenant a new API key (printed once); its older keys are revoked."""
    from prefect_spotgpu import messages

    with admin_client(market) as client:
        tenant_id = _tenant_id(client, name)
        issued = call(client, "POST", f"/tenants/{tenant_id}/keys", 201, reply=messages.KeyIssued)
    console.print(f"API key of [bold]{escape(name)}[/bold]: {escape(issued.api_key)}")


@admin_app.command("revoke-node")
def revoke_node(
    node_id: int = typer.Argument(..., min=1, help="The node whose agent token stops now."),
    market: str = MARKET,
) -> None:
    """Revoke a node's agent token: the agent can no longer act; the node is lost after
    the heartbeat timeout (its jobs' tenants are compensated as for any lost node)."""
    from prefect_spotgpu import messages

    with admin_client(market) as client:
        node = call(client, "POST", f"/nodes/{node_id}/token/revoke", reply=messages.NodeResponse)
    console.print(f"node {node.id} ({node.name}): agent token revoked", markup=False)


@admin_app.command("new-secret-key")
def new_secret_key() -> None:
    """Print a new key for SPOTGPU_SECRET_KEY (seals job environments; every replica of
    a market needs the same one). Changing it makes open bids' sealed environments
    unreadable: set it before the market takes bids."""
    from prefect_spotgpu.service.sealing import new_key

    typer.echo(new_key())


@admin_app.command("create-tenant")
def create_tenant(
    name: str = typer.Argument(..., help="Tenant name (letters, digits, '-', '_', '.')."),
    credit: float = typer.Option(None, help="Starting credit (default: the service's, 10)."),
    market: str = MARKET,
    key_file: Path | None = WRITE_KEY,
) -> None:
    """Create a tenant and print its API key (shown once), or write it to --key-file."""
    import httpx

    from prefect_spotgpu import messages

    body = {"name": name}
    if credit is not None:
        body["starting_credit"] = credit
    try:
        with admin_client(market) as client:
            response = client.post("/tenants", json=body)
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot reach the market at {escape(market)}[/red]: {escape(str(exc))}")
        raise typer.Exit(1) from None
    if response.status_code != 201:
        fail(response)
    tenant = parsed(messages.TenantCreated, response.json(), "POST /tenants")
    console.print(
        f"tenant [bold]{escape(tenant.name)}[/bold] (id {tenant.id}), balance {tenant.balance:.2f}"
    )
    if key_file is None:
        console.print(f"API key: {escape(tenant.api_key)}")
        return
    write_key(key_file, tenant.api_key)
    console.print(f"API key written to {key_file}")


@admin_app.command("tenants")
def tenants(market: str = MARKET) -> None:
    """List tenants and their balances."""
    from prefect_spotgpu import messages

    with admin_client(market) as client:
        listed = call(client, "GET", "/tenants", 200, reply=list[messages.TenantResponse])
    table = Table(title="tenants")
    for column in ("id", "name", "balance"):
        table.add_column(column)
    for t in listed:
        table.add_row(str(t.id), escape(t.name), f"{t.balance:.4f}")
    console.print(table)


@admin_app.command("credit")
def credit(
    tenant: str = typer.Argument(..., help="The tenant's name."),
    amount: float = typer.Argument(..., help="Units to add to its balance (> 0)."),
    reason: str = typer.Option(..., "--reason", help="Why: the tenant sees it in its ledger."),
    market: str = MARKET,
) -> None:
    """Credit a tenant's balance: one ledger entry, with the reason the tenant reads."""
    from prefect_spotgpu import messages

    with admin_client(market) as client:
        entry = call(
            client,
            "POST",
            f"/tenants/{_tenant_id(client, tenant)}/credits",
            201,
            reply=messages.LedgerEntryResponse,
            json={"amount": amount, "reason": reason},
        )
        balance = _tenant(client, tenant).balance
    console.print(
        f"credited [bold]{escape(tenant)}[/bold] {entry.amount:.6f} (ledger entry {entry.id}); "
        f"balance {balance:.4f}"
    )


@keys_app.command("rotate")
def rotate(
    api_key_file: Path | None = API_KEY_FILE,
    market: str = MARKET,
    write: Path | None = WRITE_KEY,
) -> None:
    """Rotate your API key: prints (or writes) a new one; the old one is refused at once."""
    from prefect_spotgpu import messages

    with market_client(market, tenant_key(api_key_file)) as client:
        key = call(client, "POST", "/me/key", 201, reply=messages.KeyIssued).api_key
    if write is None:
        console.print(f"new API key (the old one no longer works): {key}")
        return
    write_key(write, key)
    console.print(f"new API key written to {write}; the old one no longer works")


@keys_app.command("node-token")
def node_token(
    node_id: int = typer.Argument(..., min=1, help="Your node."),
    api_key_file: Path | None = API_KEY_FILE,
    market: str = MARKET,
) -> None:
    """Print a new agent token for one of your nodes; the old token is refused at once
    (give it to the agent with --token-file or SPOTGPU_AGENT_TOKEN)."""
    from prefect_spotgpu.messages import NodeToken

    with market_client(market, tenant_key(api_key_file)) as client:
        token = call(client, "POST", f"/nodes/{node_id}/token", 201, reply=NodeToken).token
    console.print(f"agent token of node {node_id}: {token}")
