"""``spotgpu admin image list|add|build|remove``: the operator's image catalogue.

The catalogue lives in the market (``GET /images`` for anyone; ``POST``, ``PUT`` and
``DELETE /images/...`` with the admin key, as every ``spotgpu admin`` command finds it:
``SPOTGPU_ADMIN_KEY`` or the key file the service generated). Names are checked here against
``protocol.IMAGE_NAME_PATTERN`` before any request, so a name never reaches a URL path it could
leave; everything else is the market's to judge. A refusal is one line (the status and what
the market said, a field named), exit 1; an unreachable market is one line too, never a
traceback.

Each entry says what it runs: ``flows`` (it holds prefect-spotgpu: a flow run may pick it) or
``command`` (a base: only a job's own command). ``image build`` (``cli/image_build.py``) makes
a flow-ready entry from any base.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from prefect_spotgpu.cli.common import MARKET, admin_client, console, market_client
from prefect_spotgpu.protocol import IMAGE_NAME_PATTERN, PROCESS_IMAGE

if TYPE_CHECKING:
    import httpx

image_app = typer.Typer(
    help="The image catalogue: the named environments a job may run in.", no_args_is_help=True
)


def _checked_name(name: str) -> str:
    if name == PROCESS_IMAGE:
        raise typer.BadParameter(
            f"{PROCESS_IMAGE!r} means no container (the job runs as a process on the node); "
            "it cannot name a catalogue image"
        )
    if not re.fullmatch(IMAGE_NAME_PATTERN, name):
        raise typer.BadParameter(
            f"{name!r} is not a catalogue name: 1 to 63 lower case letters, digits, '.', '_' "
            "and '-', starting with a letter or digit"
        )
    return name


NAME = typer.Argument(
    ...,
    callback=_checked_name,
    help="The catalogue name a deployment gives as its image, e.g. pytorch.",
)


def refusal(response: httpx.Response) -> str:
    """What the market said when it refused: its ``detail``, a validation error as
    ``field: message`` (the field as the request named it, ``body``/``path`` left off)."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = response.text
    if isinstance(detail, list):
        parts = []
        for error in detail:
            loc = [str(p) for p in error.get("loc", ()) if p not in ("body", "path")]
            parts.append(f"{'.'.join(loc) or 'request'}: {error.get('msg', '')}")
        detail = "; ".join(parts)
    return f"error {response.status_code}: {detail}"


def _refused(response: httpx.Response, hint: str = "") -> None:
    console.print(f"[red]{escape(refusal(response))}[/red]{escape(hint)}", soft_wrap=True)
    raise typer.Exit(1)


@image_app.command("list")
def list_images(market: str = MARKET) -> None:
    """List the catalogue: each image's name, what it runs (flows, or only a job's own
    command), reference, framework, CUDA and description. ('process', no container, is always
    offered besides.)"""
    with market_client(market) as client:
        response = client.get("/images")
    if response.status_code != 200:
        _refused(response)
    listed = response.json()
    if not listed:
        console.print("the catalogue is empty: add an image with `spotgpu admin image add`")
        return
    table = Table(title="image catalogue", title_justify="left")
    for column in ("name", "runs", "reference", "framework", "CUDA", "description"):
        table.add_column(column, overflow="fold")
    for image in listed:  # operator text: shown as text, never as rich markup
        cells = [Text(str(image.get(key) or "-")) for key in ("name", *SHOWN)]
        table.add_row(cells[0], Text(runs(image)), *cells[1:])
    console.print(table)
    if any(runs(image) == COMMAND_ONLY for image in listed):
        console.print(
            f"'{COMMAND_ONLY}' images run only a job's own command: a flow run that picks one "
            "is refused; `spotgpu admin image build NAME --wheelhouse DIR --registry "
            "HOST/PATH` makes one flow-ready",
            markup=False,
            soft_wrap=True,
        )


SHOWN = ("reference", "framework", "cuda_version", "description")
COMMAND_ONLY = "command"
RUNS = {"flows": "runs flows", COMMAND_ONLY: "runs only a job's own command"}


def runs(image: dict) -> str:
    """What a listed entry runs: ``flows`` or ``command`` (a market that does not say: flows,
    as ``messages.ImageResponse`` takes it)."""
    return "flows" if image.get("runs_flows", True) is not False else COMMAND_ONLY


@image_app.command("add")
def add_image(
    name: str = NAME,
    reference: str = typer.Argument(
        ...,
        help="The container image nodes pull, as Docker writes it: registry/repo/name:tag, "
        "optionally pinned with @sha256:DIGEST.",
    ),
    framework: str = typer.Option(..., help="What the image provides, e.g. 'PyTorch 2.5.1'."),
    cuda: str | None = typer.Option(None, help="The CUDA version it is built on, e.g. 12.4."),
    description: str = typer.Option("", help="One line on what the image is for."),
    replace: bool = typer.Option(
        False, help="Replace the entry of the same name (without it, a taken name is refused)."
    ),
    runs_flows: bool = typer.Option(
        False,
        "--runs-flows/--command-only",
        help="Whether the image holds prefect-spotgpu, so flow runs may pick it (as `spotgpu "
        "admin image build` makes them); a base without it runs only a job's own command.",
    ),
    market: str = MARKET,
) -> None:
    """Add an image to the catalogue (or, with --replace, add or replace it). Bids already
    placed keep the reference they were accepted with. To make a flow-ready image from a
    base, use `spotgpu admin image build`."""
    body = {
        "reference": reference,
        "framework": framework,
        "cuda_version": cuda,
        "description": description,
        "runs_flows": runs_flows,
    }
    with admin_client(market) as client:
        if replace:
            response = client.put(f"/images/{name}", json=body)
        else:
            response = client.post("/images", json={"name": name, **body})
    if response.status_code == 409:
        _refused(response, "; run again with --replace to replace it")
    if response.status_code not in (200, 201):
        _refused(response)
    added = response.json()
    done = "added" if response.status_code == 201 else "replaced"
    console.print(
        f"{done} image {added['name']!r}: {added['reference']} ({added['framework']}; "
        f"{RUNS[runs(added)]})",
        markup=False,
        soft_wrap=True,
    )


WHEELHOUSE = typer.Option(
    ...,
    help="A folder of wheels holding prefect-spotgpu and its dependencies for the base's "
    "Python: pip wheel prefect-spotgpu -w DIR (docs/operators/image-catalogue.md).",
)


@image_app.command("build")
def build_image(
    name: str = NAME,
    base: str | None = typer.Option(
        None,
        help="The image to start from, as Docker writes it (default: the catalogue entry "
        "NAME's reference, e.g. the seeded pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime).",
    ),
    wheelhouse: Path = WHEELHOUSE,
    registry: str = typer.Option(
        ...,
        help="Where the image is pushed, HOST[:PORT]/PATH (e.g. registry.example.com/spotgpu): "
        "the image is REGISTRY/NAME:TAG, and the nodes pull it from there.",
    ),
    tag: str | None = typer.Option(
        None, help="The image's tag (default: the base's tag + -spotgpu + the version)."
    ),
    framework: str | None = typer.Option(
        None, help="What the image provides (default: the catalogue entry's)."
    ),
    cuda: str | None = typer.Option(None, help="Its CUDA version (default: the entry's)."),
    description: str | None = typer.Option(None, help="One line (default: the entry's)."),
    market: str = MARKET,
) -> None:
    """Make a flow-ready image from a base: the base plus prefect-spotgpu from a wheelhouse
    (no package index needed), checked, pushed to your registry and put in the catalogue as
    running flows (replacing the entry NAME, if there is one). A flow's own code is never
    baked in: it travels by its bundle or its deployment's pull step."""
    from prefect_spotgpu.cli import image_build

    image_build.build_image(
        name, base, wheelhouse, registry, tag, framework, cuda, description, market
    )


@image_app.command("remove")
def remove_image(name: str = NAME, market: str = MARKET) -> None:
    """Remove an image from the catalogue: new bids for it are refused; bids already placed
    keep theirs."""
    with admin_client(market) as client:
        response = client.delete(f"/images/{name}")
    if response.status_code != 204:
        _refused(response)
    console.print(f"removed image {name!r} from the catalogue", markup=False)
