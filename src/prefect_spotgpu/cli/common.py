"""What every ``spotgpu`` command module shares: the console, the one-line failure, the market
and admin clients, the common options and where a key comes from.

A command talks to the market only through ``market_client`` (a tenant's key) or
``admin_client`` (the admin key), both built by ``api_client``; a refused request ends the
command with ``fail`` (one red line, exit 1). Keys are read from the environment or a file,
never from the command line (``ps`` shows argv to every user). Light on purpose (typer and
rich only at import): the CLI starts fast, and each command imports what it needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

if TYPE_CHECKING:
    import httpx

console = Console()

DEFAULT_MARKET = "http://127.0.0.1:4300"

MARKET = typer.Option(
    DEFAULT_MARKET, envvar="SPOTGPU_MARKET_URL", help="URL of the market service."
)
API_KEY_FILE = typer.Option(
    None,
    "--api-key-file",
    help="A file holding your API key (default: the SPOTGPU_API_KEY environment variable).",
)
WRITE_KEY = typer.Option(
    None, help="Write the new key to this file (mode 0600) instead of printing it."
)


@contextlib.contextmanager
def market_client(market: str, api_key: str | None = None) -> Iterator[httpx.Client]:
    """A client of the market's API; an unreachable market is a one-line error naming it."""
    import httpx

    from prefect_spotgpu.api_client import api_client

    try:
        with api_client(market, api_key) as client:
            yield client
    except httpx.TransportError as exc:
        console.print(
            f"cannot reach the market at {market}: {exc}", style="red", markup=False, soft_wrap=True
        )
        raise typer.Exit(1) from None


def admin_client(market: str):
    """A client of the market's API as its admin (``SPOTGPU_ADMIN_KEY``, or the key file the
    service generated), as a context manager; an unreachable market is one line
    (:func:`market_client`). Without a key the command ends at once, saying where one goes
    (never a new key: the market would refuse it)."""
    from prefect_spotgpu.service.settings import NoAdminKey, ServiceSettings

    try:
        key = ServiceSettings().existing_admin_key()
    except NoAdminKey as exc:
        console.print(str(exc), style="red", soft_wrap=True, markup=False)
        raise typer.Exit(2) from None
    return market_client(market, key)


def fail(response: httpx.Response) -> None:
    """End the command: the market refused (its status and ``detail``, exit 1). The detail
    is printed as text: it may quote what a caller sent, markup included."""
    from rich.markup import escape

    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    console.print(f"[red]error {response.status_code}[/red]: {escape(str(detail))}")
    raise typer.Exit(1)


def call(client: httpx.Client, method: str, path: str, ok: int = 200, *, reply=None, **kwargs):
    """The JSON body of one request, or ``fail`` when its status is not ``ok``; with
    ``reply`` (a model of the shared vocabulary, ``prefect_spotgpu.messages``, or a list of
    one), the body parsed into it (:func:`parsed`)."""
    response = client.request(method, path, **kwargs)
    if response.status_code != ok:
        fail(response)
    return response.json() if reply is None else parsed(reply, response.json(), f"{method} {path}")


def busy_gpus(client: httpx.Client) -> dict[int, int]:
    """Each node's GPUs held by an allocation now, by node id (``GET /market/nodes``)."""
    from prefect_spotgpu.messages import MarketNodeResponse

    listed = call(client, "GET", "/market/nodes", reply=list[MarketNodeResponse])
    return {node.id: node.gpus_busy for node in listed}


def parsed(reply, body, what: str):
    """``body`` as ``reply`` (a model, or ``list[Model]``); a reply that does not parse ends
    the command naming the field and what answered it (one red line, exit 1), never a
    ``KeyError`` traceback."""
    from pydantic import TypeAdapter, ValidationError
    from rich.markup import escape

    try:
        return TypeAdapter(reply).validate_python(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "the body"
        console.print(
            f"[red]the market's reply to {escape(what)} does not parse[/red]: "
            f"{escape(field)}: {escape(error['msg'])}",
            soft_wrap=True,
        )
        raise typer.Exit(1) from None


def tenant_key(path: Path | None) -> str:
    """The caller's API key from ``--api-key-file``, else ``SPOTGPU_API_KEY`` (never argv:
    every user of the host can read a command line)."""
    import os

    key = path.read_text().strip() if path else os.environ.get("SPOTGPU_API_KEY", "")
    if not key:
        console.print("[red]no API key[/red]: set SPOTGPU_API_KEY or pass --api-key-file")
        raise typer.Exit(2)
    return key


def write_key(path: Path, key: str) -> None:
    """Write a key to ``path``, mode 0600 (also when the file existed with a wider mode)."""
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(key + "\n")
