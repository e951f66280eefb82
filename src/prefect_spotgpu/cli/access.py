"""``spotgpu admin ...`` access commands and ``spotgpu keys ...``: providers, keys, node tokens.

The operator vets who supplies GPUs (``grant-provider``), revokes keys and node tokens; a tenant
rotates its own key; a provider gets a fresh token for its node's agent. Every key is read from
the environment or a file, never from the command line (``ps`` shows argv to every user).
"""

from __future__ import annotations

from pathlib import Path

import typer

keys_app = typer.Typer(
    help="Rotate your API key, or your node's agent token.", no_args_is_help=True
)

MARKET = typer.Option(
    "http://127.0.0.1:4300", envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
)
API_KEY_FILE = typer.Option(
    None,
    "--api-key-file",
    help="A file holding your API key (default: the SPOTGPU_API_KEY environment variable).",
)

WRITE_KEY = typer.Option(
    None, help="Write the new key to this file (mode 0600) instead of printing it."
)


def write_key(path: Path, key: str) -> None:
    """Write a key to ``path``, mode 0600 (also when the file existed with a wider mode)."""
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(key + "\n")


def tenant_key(path: Path | None) -> str:
    """The caller's API key from ``--api-key-file``, else ``SPOTGPU_API_KEY`` (never argv:
    every user of the host can read a command line)."""
    import os

    from prefect_spotgpu.cli.app import console

    key = path.read_text().strip() if path else os.environ.get("SPOTGPU_API_KEY", "")
    if not key:
        console.print("[red]no API key[/red]: set SPOTGPU_API_KEY or pass --api-key-file")
        raise typer.Exit(2)
    return key


def _call(client, method: str, path: str, ok: int, **kwargs) -> dict:
    from prefect_spotgpu.cli.app import _fail

    response = client.request(method, path, **kwargs)
    if response.status_code != ok:
        _fail(response)
    return response.json()


def _tenant_id(client, name: str) -> int:
    from prefect_spotgpu.cli.app import console

    for tenant in _call(client, "GET", "/tenants", 200):
        if tenant["name"] == name:
            return tenant["id"]
    console.print(f"[red]no tenant named {name!r}[/red]")
    raise typer.Exit(1)


def register(admin_app: typer.Typer) -> None:
    """Add the access commands to ``spotgpu admin``."""

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

    @admin_app.command("revoke-keys")
    def revoke_keys(
        name: str = typer.Argument(..., help="The tenant whose API keys stop working now."),
        market: str = MARKET,
    ) -> None:
        """Revoke every API key of a tenant (refused at once); issue-key gives it a new one."""
        from prefect_spotgpu.cli.app import _admin_client, console

        with _admin_client(market) as client:
            tenant_id = _tenant_id(client, name)
            revoked = _call(client, "POST", f"/tenants/{tenant_id}/keys/revoke", 200)
        console.print(f"revoked {revoked['revoked']} key(s) of [bold]{name}[/bold]")

    @admin_app.command("issue-key")
    def issue_key(
        name: str = typer.Argument(..., help="The tenant to give a new API key."),
        market: str = MARKET,
    ) -> None:
        """Issue a tenant a new API key (printed once); its older keys are revoked."""
        from prefect_spotgpu.cli.app import _admin_client, console

        with _admin_client(market) as client:
            tenant_id = _tenant_id(client, name)
            issued = _call(client, "POST", f"/tenants/{tenant_id}/keys", 201)
        console.print(f"API key of [bold]{name}[/bold]: {issued['api_key']}")

    @admin_app.command("revoke-node")
    def revoke_node(
        node_id: int = typer.Argument(..., min=1, help="The node whose agent token stops now."),
        market: str = MARKET,
    ) -> None:
        """Revoke a node's agent token: the agent can no longer act; the node is lost after
        the heartbeat timeout (its jobs' tenants are compensated as for any lost node)."""
        from prefect_spotgpu.cli.app import _admin_client, console

        with _admin_client(market) as client:
            node = _call(client, "POST", f"/nodes/{node_id}/token/revoke", 200)
        console.print(f"node {node['id']} ({node['name']}): agent token revoked")

    @admin_app.command("new-secret-key")
    def new_secret_key() -> None:
        """Print a new key for SPOTGPU_SECRET_KEY (seals job environments; every replica of
        a market needs the same one). Changing it makes open bids' sealed environments
        unreadable: set it before the market takes bids."""
        from prefect_spotgpu.service.sealing import new_key

        typer.echo(new_key())


def _set_provider(name: str, provider: bool, market: str) -> None:
    from prefect_spotgpu.cli.app import _admin_client, console

    with _admin_client(market) as client:
        tenant_id = _tenant_id(client, name)
        _call(client, "PUT", f"/tenants/{tenant_id}/provider", 200, json={"provider": provider})
    role = "is now a provider" if provider else "is no longer a provider (its nodes drain)"
    console.print(f"[bold]{name}[/bold] {role}")


@keys_app.command("rotate")
def rotate(
    api_key_file: Path | None = API_KEY_FILE,
    market: str = MARKET,
    write: Path | None = WRITE_KEY,
) -> None:
    """Rotate your API key: prints (or writes) a new one; the old one is refused at once."""
    from prefect_spotgpu.cli.app import _market_client, console

    with _market_client(market, tenant_key(api_key_file)) as client:
        key = _call(client, "POST", "/me/key", 201)["api_key"]
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
    from prefect_spotgpu.cli.app import _market_client, console

    with _market_client(market, tenant_key(api_key_file)) as client:
        token = _call(client, "POST", f"/nodes/{node_id}/token", 201)["token"]
    console.print(f"agent token of node {node_id}: {token}")
