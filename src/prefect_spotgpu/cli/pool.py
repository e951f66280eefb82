"""``spotgpu blocks save`` and ``spotgpu pool setup|check``: the Prefect side of the manual path.

``blocks save`` saves the two block documents a spot-gpu pool needs (the market's URL with your
key; where checkpoints go). ``pool setup`` makes the pool of type ``spot-gpu`` (creating it if
missing) and links those blocks as its ``market`` and ``checkpoint_storage`` defaults — what the
UI's form does by hand — keeping the pool's other defaults; it also writes the market's image
catalogue's flow-ready images (``GET /images``, ``runs_flows``: a pool's runs are flow runs)
as the choices of the pool's ``image`` variable (``offer_images``), so the form offers what a
flow can run in. A market that does not answer leaves the choices
as they were. ``pool check`` says what is wrong with a pool, one line each: a pool of another
type (a ``process`` pool, made by starting a worker before the pool existed, runs spot runs on
the worker's own host, outside the market), blocks not linked, a market that does not answer,
image choices the market's catalogue no longer holds. Both talk to the Prefect API of
``PREFECT_API_URL``.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import typer

from prefect_spotgpu.cli.common import API_KEY_FILE, MARKET, console, tenant_key
from prefect_spotgpu.messages import ImageResponse
from prefect_spotgpu.protocol import IMAGE_BUILD_COMMAND, IMAGE_NAME_PATTERN, PROCESS_IMAGE

blocks_app = typer.Typer(help="Save the Prefect blocks a spot-gpu pool uses.", no_args_is_help=True)
pool_app = typer.Typer(help="Set up or check a spot-gpu work pool.", no_args_is_help=True)

POOL = typer.Argument("spot", help="The work pool's name.")
MARKET_BLOCK = typer.Option("spot-market", help="The Spot Market block document's name.")
STORAGE_BLOCK = typer.Option("spot-checkpoints", help="The checkpoint storage block's name.")
CHECKPOINTS = typer.Option(None, help="A directory every node reaches.")
BUCKET = typer.Option(None, help="An S3 bucket instead of a directory.")
PREFIX = typer.Option("", help="Key prefix in the bucket.")
LINKED = ("market", "checkpoint_storage")
CATALOGUE_TITLE = "Catalogue image"
REFERENCE_TITLE = "Image reference"
CATALOGUE_SECONDS = 10.0
"""How long ``pool setup`` and ``pool check`` wait for the market's catalogue."""


@blocks_app.command("save")
def blocks_save(
    market_url: str = MARKET,
    api_key_file: Path | None = API_KEY_FILE,
    checkpoints: Path | None = CHECKPOINTS,
    bucket: str | None = BUCKET,
    prefix: str = PREFIX,
    endpoint_url: str | None = typer.Option(
        None, envvar="AWS_ENDPOINT_URL_S3", help="S3 endpoint (MinIO, moto...)."
    ),
    market_name: str = MARKET_BLOCK,
    storage_name: str = STORAGE_BLOCK,
) -> None:
    """Save the Spot Market block (URL and key) and the checkpoint storage block (a directory,
    or an S3 bucket with credentials from the AWS_* variables), overwriting same-named ones."""
    if (checkpoints is None) == (bucket is None):
        console.print("[red]give --checkpoints DIR or --bucket NAME[/red]")
        raise typer.Exit(2)
    save_blocks(
        market_url=market_url,
        api_key=tenant_key(api_key_file),
        checkpoints=checkpoints,
        bucket=bucket,
        prefix=prefix,
        endpoint_url=endpoint_url,
        market_name=market_name,
        storage_name=storage_name,
    )
    console.print(
        f"saved Spot Market {market_name!r} and Spot Checkpoint Storage {storage_name!r}",
        markup=False,
    )


def save_blocks(
    *,
    market_url: str,
    api_key: str,
    checkpoints: Path | str | None,
    bucket: str | None,
    prefix: str = "",
    endpoint_url: str | None = None,
    market_name: str = "spot-market",
    storage_name: str = "spot-checkpoints",
) -> None:
    """Save the two block documents (S3 credentials from the AWS_* variables)."""
    from pydantic import SecretStr

    from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket

    SpotMarket(url=market_url, api_key=SecretStr(api_key)).save(market_name, overwrite=True)
    if bucket:
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
        storage = CheckpointStorage(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=endpoint_url,
            region_name=os.environ.get("AWS_DEFAULT_REGION"),
            aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=SecretStr(secret) if secret else None,
        )
    else:
        storage = CheckpointStorage(path=str(Path(checkpoints).absolute()))
    storage.save(storage_name, overwrite=True)


@pool_app.command("setup")
def pool_setup(
    pool: str = POOL,
    market_block: str = MARKET_BLOCK,
    storage_block: str = STORAGE_BLOCK,
    replace: bool = typer.Option(
        False, help="Delete and recreate a pool of another type (its queued runs stay)."
    ),
) -> None:
    """Make POOL a spot-gpu pool whose runs use the named blocks (created if missing)."""
    for line in asyncio.run(_setup(pool, market_block, storage_block, replace)):
        console.print(line, markup=False, soft_wrap=True)


@pool_app.command("check")
def pool_check(pool: str = POOL) -> None:
    """Say what stands between POOL and a run on spot GPUs (exit 1 if anything does)."""
    problems, fine = asyncio.run(_check(pool))
    for line in fine:
        console.print(f"ok    {line}", markup=False, soft_wrap=True)
    for line in problems:
        console.print(f"FIX   {line}", style="red", markup=False, soft_wrap=True)
    if problems:
        raise typer.Exit(1)


async def _block_id(client, slug: str, name: str) -> str:
    from prefect.exceptions import ObjectNotFound

    try:
        document = await client.read_block_document_by_name(name, block_type_slug=slug)
    except ObjectNotFound:
        raise _Refused(
            f"no {slug} block named {name!r}: save it first with `spotgpu blocks save ...`"
        ) from None
    return str(document.id)


class _Refused(Exception):
    pass


async def _setup(pool: str, market_block: str, storage_block: str, replace: bool) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.client.schemas.objects import WorkPoolStorageConfiguration
    from prefect.exceptions import ObjectNotFound

    from prefect_spotgpu.blocks import CheckpointStorage, SpotMarket
    from prefect_spotgpu.bundles import storage_configuration
    from prefect_spotgpu.worker import SpotGPUWorker

    out = []
    async with get_client() as client:
        try:
            market_id = await _block_id(client, SpotMarket.get_block_type_slug(), market_block)
            storage_id = await _block_id(
                client, CheckpointStorage.get_block_type_slug(), storage_block
            )
        except _Refused as exc:
            raise typer.BadParameter(str(exc)) from None
        try:
            existing = await client.read_work_pool(pool)
        except ObjectNotFound:
            existing = None
        if existing is not None and existing.type != "spot-gpu":
            if not replace:
                raise typer.BadParameter(
                    f"work pool {pool!r} is of type {existing.type!r}: its workers would run "
                    f"spot runs outside the market. Run again with --replace to recreate it "
                    f"as spot-gpu"
                )
            await client.delete_work_pool(pool)
            out.append(f"deleted work pool {pool!r} of type {existing.type!r}")
            existing = None
        template = (
            existing.base_job_template
            if existing is not None
            else SpotGPUWorker.get_default_base_job_template()
        )
        properties = template["variables"]["properties"]
        properties["market"]["default"] = {"$ref": {"block_document_id": market_id}}
        properties["checkpoint_storage"]["default"] = {"$ref": {"block_document_id": storage_id}}
        try:
            listed = await _catalogue(await SpotMarket.aload(market_block))
        except _Unread as exc:
            out.append(f"{exc}: the form keeps its image choices ({_choices(properties)})")
        else:
            shape = SpotGPUWorker.get_default_base_job_template()["variables"]["properties"]
            catalogue = flow_ready(listed)
            properties["image"] = offer_images(
                properties.get("image", {}), shape["image"], catalogue
            )
            names = ", ".join(i.name for i in catalogue) or "none"
            out.append(
                f"its form offers {len(catalogue)} flow-ready catalogue image(s) ({names}) "
                f"and {PROCESS_IMAGE!r} (no container)" + _command_only(listed)
            )
        storage = WorkPoolStorageConfiguration(
            **storage_configuration(
                block_name=storage_block,
                url=(await CheckpointStorage.aload(storage_block)).url(),
                block_id=storage_id,
            )
        )
        if existing is None:
            await client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type="spot-gpu",
                    base_job_template=template,
                    storage_configuration=storage,
                )
            )
            out.append(f"created work pool {pool!r} of type spot-gpu")
        else:
            await client.update_work_pool(
                pool,
                WorkPoolUpdate(base_job_template=template, storage_configuration=storage),
            )
        out.append(
            f"flows decorated with @spot_gpu(work_pool={pool!r}) travel as bundles through "
            f"{storage_block!r}, which also keeps their results (prefect work-pool storage "
            f"inspect {pool})"
        )
        out.append(
            f"{pool!r} runs bid through {market_block!r} and checkpoint to {storage_block!r}; "
            f"start its worker with: prefect worker start --pool {pool} --type spot-gpu"
        )
    return out


async def _check(pool: str) -> tuple[list[str], list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from prefect_spotgpu.blocks import SpotMarket

    problems, fine = [], []
    async with get_client() as client:
        try:
            found = await client.read_work_pool(pool)
        except ObjectNotFound:
            return [f"no work pool {pool!r}: spotgpu pool setup {pool}"], fine
        if found.type != "spot-gpu":
            problems.append(
                f"work pool {pool!r} is of type {found.type!r}: its workers run spot runs on "
                f"their own host, outside the market; recreate it: spotgpu pool setup {pool} "
                f"--replace"
            )
            return problems, fine
        fine.append(f"work pool {pool!r} is of type spot-gpu")
        properties = found.base_job_template.get("variables", {}).get("properties", {})
        refs = {}
        for name in LINKED:
            ref = (properties.get(name, {}).get("default") or {}).get("$ref", {})
            refs[name] = ref.get("block_document_id")
            if refs[name] is None:
                problems.append(
                    f"its {name} variable names no block: spotgpu pool setup {pool} "
                    f"(or give it per deployment in job_variables)"
                )
        if refs["market"]:
            document = await client.read_block_document(refs["market"])
            fine.append(f"its market block is {document.name!r}")
            market = await SpotMarket.aload(document.name)
            answer = await _market_answers(market)
            (fine if answer.startswith("market") else problems).append(answer)
            if answer.startswith("market"):
                line, ok = await _images_offered(pool, properties, market)
                (fine if ok else problems).append(line)
    return problems, fine


async def _market_answers(market) -> str:
    import httpx

    try:
        async with market.get_async_client() as http:
            me = await http.get("/me")
    except httpx.HTTPError as exc:
        return f"the market at {market.url} does not answer ({type(exc).__name__})"
    if me.status_code != 200:
        return f"the market at {market.url} refuses the block's key (HTTP {me.status_code})"
    body = me.json()
    return f"market at {market.url} answers: tenant {body['name']}, balance {body['balance']:.2f}"


# ---------------------------------------------------------------- the form's image choices


class _Unread(Exception):
    """The market's catalogue could not be read (the message says why)."""


async def _catalogue(market) -> list[ImageResponse]:
    """The market's image catalogue (``GET /images``), entries whose name a form can offer
    (``IMAGE_NAME_PATTERN``, never ``process``), in the market's order; ``_Unread`` if not.
    An entry that does not parse as an ``ImageResponse`` is left out."""
    import httpx
    from pydantic import ValidationError

    try:
        async with market.get_async_client(timeout=CATALOGUE_SECONDS) as http:
            response = await http.get("/images")
        listed = response.json() if response.status_code == 200 else None
    except httpx.HTTPError as exc:
        raise _Unread(
            f"the market at {market.url} does not answer ({type(exc).__name__})"
        ) from None
    except ValueError:
        listed = None
    if not isinstance(listed, list):
        raise _Unread(
            f"the market at {market.url} did not list its images (HTTP {response.status_code})"
        )
    entries = []
    for entry in listed:
        try:
            image = ImageResponse.model_validate(entry)
        except ValidationError:
            continue
        if re.fullmatch(IMAGE_NAME_PATTERN, image.name) and image.name != PROCESS_IMAGE:
            entries.append(image)
    return entries


def flow_ready(catalogue: list[ImageResponse]) -> list[ImageResponse]:
    """The entries a flow run can pick: those that hold prefect-spotgpu (``runs_flows``; a
    market that does not say is taken at its word, as ``messages.ImageResponse`` does)."""
    return [image for image in catalogue if image.runs_flows]


def _command_only(catalogue: list[ImageResponse]) -> str:
    """The rest of a setup's line: the entries that run only a job's own command, not offered
    for flows, and the command that makes one flow-ready ("" when there are none)."""
    others = [image.name for image in catalogue if not image.runs_flows]
    if not others:
        return ""
    return (
        f"; not offered, they run only a job's own command: {', '.join(others)} "
        f"({IMAGE_BUILD_COMMAND} NAME --wheelhouse DIR --registry HOST/PATH makes one flow-ready)"
    )


def offer_images(current: dict, shape: dict, catalogue: list[ImageResponse]) -> dict:
    """The pool's ``image`` variable offering ``process`` and the catalogue's names as its
    choices, any image reference still accepted, and each image's framework and CUDA in its
    description (the Prefect UI shows a variable's description, not a choice's).

    ``shape`` is the worker's own variable (``SpotGPUJobConfiguration.image``): ``anyOf`` of an
    ``enum`` branch and a ``pattern`` branch; only the enum, the branches' titles (the labels
    of the form's toggle) and the description change. ``current`` is the pool's variable now:
    its default stays where it is still a choice or a reference, else the worker's is used.
    Pure: the same inputs give the same schema (setting up twice changes nothing).

    >>> from datetime import UTC, datetime
    >>> pytorch = ImageResponse(name="pytorch", reference="pytorch/pytorch:2.5.1",
    ...     framework="PyTorch 2.5.1", cuda_version="12.4", description="",
    ...     updated_at=datetime(2026, 1, 1, tzinfo=UTC))
    >>> image = offer_images({}, {"anyOf": [{"enum": ["process"], "type": "string"},
    ...     {"pattern": "/", "type": "string"}], "default": "process", "description": "Image."},
    ...     [pytorch])
    >>> image["anyOf"][0]["enum"], image["description"]
    (['process', 'pytorch'], 'Image. Catalogue: pytorch (PyTorch 2.5.1, CUDA 12.4).')
    """
    names = [PROCESS_IMAGE, *(image.name for image in catalogue)]
    branches = []
    for branch in shape.get("anyOf", []):
        if "enum" in branch:
            branches.append({**branch, "enum": names, "title": CATALOGUE_TITLE})
        else:
            branches.append({"title": REFERENCE_TITLE, **branch})
    offered = [f"{image.name} ({_what(image)})" for image in catalogue]
    description = shape.get("description", "")
    if offered:
        description = f"{description} Catalogue: {'; '.join(offered)}."
    default = current.get("default", shape.get("default", PROCESS_IMAGE))
    if not isinstance(default, str) or (default not in names and not re.search("[/:]", default)):
        default = shape.get("default", PROCESS_IMAGE)
    return {**shape, "anyOf": branches, "default": default, "description": description.strip()}


def _what(image: ImageResponse) -> str:
    framework = image.framework.strip()
    parts = [framework] if framework else []
    parts.append(f"CUDA {image.cuda_version}" if image.cuda_version else "no CUDA version given")
    return ", ".join(parts)


def offered_names(properties: dict) -> list[str]:
    """The catalogue names the pool's ``image`` variable offers (its ``enum``, less
    ``process``)."""
    for branch in properties.get("image", {}).get("anyOf", []):
        if "enum" in branch:
            return [name for name in branch["enum"] if name != PROCESS_IMAGE]
    return []


def _choices(properties: dict) -> str:
    names = offered_names(properties)
    return f"{len(names)} catalogue image(s): {', '.join(names) or 'none'}"


async def _images_offered(pool: str, properties: dict, market) -> tuple[str, bool]:
    """One line on the pool's image choices against the market's catalogue, and whether they
    stand in no run's way: a choice the catalogue no longer holds does (the market refuses a
    bid for it); a catalogue image the form does not offer yet does not (a deployment may
    still name it), but the line says how to offer it."""
    offered = offered_names(properties)
    try:
        listed = [image.name for image in flow_ready(await _catalogue(market))]
    except _Unread as exc:
        return f"{exc}: its image choices cannot be checked", False
    gone = [name for name in offered if name not in listed]
    if gone:
        return (
            f"its form offers image(s) the market's catalogue no longer holds as flow-ready "
            f"({', '.join(gone)}): "
            f"runs that pick them are refused; spotgpu pool setup {pool}"
        ), False
    missing = [name for name in listed if name not in offered]
    if missing:
        return (
            f"its form offers {len(offered)} of the market's {len(listed)} flow-ready catalogue "
            "image(s) "
            f"(not yet: {', '.join(missing)}; spotgpu pool setup {pool} offers them)"
        ), True
    return f"its form offers the market's {len(listed)} flow-ready catalogue image(s)", True
