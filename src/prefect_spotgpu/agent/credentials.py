"""The agent's credential is its node's token (``sgn_...``), never the owner's tenant key.

An owner key (``sgk_...``) is used once, to register this host as a node — or, when the owner
already has a node of that name, to find it and ask for a new token (which revokes the old one).
The node token is then kept in ``<state dir>/node.json`` (mode 0600, written atomically) with
the market and node it belongs to, and the agent uses nothing else; the owner key is dropped.

The event cursor belongs to the node: it is kept with the node's identity (market, node id) in
``<state dir>/cursor``, and an agent that finds a cursor of another market or node starts at 0
(writing ``node.json`` for another node removes it). A stale cursor would skip the new node's
first events.

``register_node`` is the whole registration: the token given, else the one kept, else one
obtained with the owner's key; then the market's record of the node, which must sell this
host's GPUs. The market's replies are parsed into ``messages``' models; one that lacks a field
the agent needs is a ``CredentialError`` naming it, and so is a market that refuses this
agent's version (426: the error says which version it needs, and how to install it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from prefect_spotgpu.messages import (
    NodeCreated,
    NodeRegistration,
    NodeResponse,
    NodeToken,
    VersionRefusal,
)
from prefect_spotgpu.protocol import Capacity

NODE_FILE = "node.json"
CURSOR_FILE = "cursor"

logger = logging.getLogger("prefect_spotgpu.agent")

M = TypeVar("M", bound=BaseModel)


class CredentialError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class NodeRecord:
    market: str
    node_id: int
    token: str


_NODE_FILE = TypeAdapter(NodeRecord)


def load_record(state_dir: Path, market: str) -> NodeRecord | None:
    """The node token this state directory holds for ``market``, if any."""
    try:
        record = _NODE_FILE.validate_json((state_dir / NODE_FILE).read_bytes())
    except (OSError, ValueError):  # (missing, or not a record: pydantic's errors are these)
        return None
    return record if record.market == market else None


def save_record(state_dir: Path, record: NodeRecord) -> None:
    """Keep the node token (0600, atomically); a cursor of another node is dropped."""
    previous = _read_json(state_dir / NODE_FILE)
    _write_private(state_dir / NODE_FILE, json.dumps(asdict(record)))
    if (previous.get("market"), previous.get("node_id")) != (record.market, record.node_id):
        (state_dir / CURSOR_FILE).unlink(missing_ok=True)


def load_cursor(state_dir: Path, market: str, node_id: int) -> int:
    """The node's event cursor, or 0 when the saved one belongs to another market or node
    (or is an older agent's bare number, whose node is unknown)."""
    saved = _read_json(state_dir / CURSOR_FILE)
    if (saved.get("market"), saved.get("node_id")) != (market, node_id):
        return 0
    cursor = saved.get("cursor")
    return cursor if isinstance(cursor, int) and cursor >= 0 else 0


def save_cursor(state_dir: Path, market: str, node_id: int, cursor: int) -> None:
    payload = {"market": market, "node_id": node_id, "cursor": cursor}
    _write_private(state_dir / CURSOR_FILE, json.dumps(payload))


def obtain_node_token(
    client: httpx.Client, market: str, registration: NodeRegistration
) -> NodeRecord:
    """Register this host with the owner's ``client``, or, if the owner already has a node of
    that name, issue that node a new token (the old one stops working)."""
    response = client.post("/nodes", json=registration.body())
    _check_version(response)
    if response.status_code == 201:
        created = _parse(NodeCreated, response.json(), "registration")
        return NodeRecord(market, created.id, created.token)
    if response.status_code != 409:
        raise CredentialError(
            f"registering node {registration.name!r} failed: "
            f"{response.status_code} {response.text[:300]}"
        )
    listed = client.get("/nodes")
    if listed.status_code != 200:
        raise CredentialError(f"listing your nodes failed: {listed.status_code}")
    nodes = [_parse(NodeResponse, n, "list of nodes") for n in listed.json()]
    named = [n for n in nodes if n.name == registration.name]
    if not named:
        raise CredentialError(f"node {registration.name!r}: {response.text[:300]}")
    node_id = named[0].id
    issued = client.post(f"/nodes/{node_id}/token")
    if issued.status_code not in (200, 201):
        raise CredentialError(
            f"a new token for node {node_id} was refused: {issued.status_code} {issued.text[:300]}"
        )
    return NodeRecord(market, node_id, _parse(NodeToken, issued.json(), "new token").token)


def register_node(
    *,
    market: str,
    key: str | None,
    state_dir: Path,
    registration: NodeRegistration,
    http: Callable[[str], httpx.Client],
) -> tuple[str, NodeResponse]:
    """The node's token and the market's record of the node (``GET /nodes/me``).

    ``key`` is a node token (``sgn_...``), the owner's API key, or None (the token kept in
    ``state_dir``); the owner's key registers the host (``registration``: the body of ``POST
    /nodes``) when no kept token works. ``http(token)`` makes a client of the market."""
    state_dir.mkdir(parents=True, exist_ok=True)
    token = key if key and key.startswith("sgn_") else None
    owner_key = None if token or not key else key
    if token is None:
        record = load_record(state_dir, market)
        token = record.token if record else None
    me = _me(http, token) if token else None
    if me is None or (me.status_code == 401 and owner_key):
        if not owner_key:
            raise CredentialError(
                "no token: give the node's token or the owner's API key "
                "(--token-file or SPOTGPU_AGENT_TOKEN)"
            )
        token = _register_with(http, owner_key, market, state_dir, registration)
        me = _me(http, token)
    _check_version(me)
    if me.status_code != 200:
        raise CredentialError(f"the market refused this node's token: {me.status_code} {me.text}")
    node = _parse(NodeResponse, me.json(), "node record")
    if (node.gpu_count, node.gpu_model) != (registration.gpu_count, registration.gpu_model):
        raise CredentialError(
            f"node {node.id} sells {node.gpu_count} x {node.gpu_model}, this host "
            f"has {registration.gpu_count} x {registration.gpu_model}"
        )
    return token, node


def _parse(model: type[M], reply: object, what: str) -> M:
    """The market's ``reply`` as ``model``; one without a field the agent needs (an older or a
    foreign market) is a ``CredentialError`` naming the field."""
    try:
        return model.model_validate(reply)
    except ValidationError as exc:
        raise CredentialError(
            f"the market's {what} does not parse as {model.__name__}: {exc}"
        ) from None


def _check_version(response: httpx.Response) -> None:
    """A market that refuses this agent's version: a ``CredentialError`` with its words."""
    if response.status_code != httpx.codes.UPGRADE_REQUIRED:
        return
    try:
        said = VersionRefusal.model_validate(response.json()).detail
    except ValueError:  # (not JSON, or not a refusal: pydantic's errors are ValueErrors)
        said = response.text[:300]
    raise CredentialError(f"the market refuses this agent's version: {said}")


def _me(http: Callable[[str], httpx.Client], token: str) -> httpx.Response:
    with http(token) as client:
        return client.get("/nodes/me")


def _register_with(
    http: Callable[[str], httpx.Client],
    owner_key: str,
    market: str,
    state_dir: Path,
    registration: NodeRegistration,
) -> str:
    spot = registration.capacity == Capacity.SPOT
    if not registration.region or (spot and not registration.reserve_price):
        raise CredentialError(
            "registering a spot node needs --region and --reserve-price "
            "(an on-demand node needs --region)"
        )
    with http(owner_key) as owner:
        record = obtain_node_token(owner, market, registration)
    save_record(state_dir, record)
    logger.info("node %s: token kept in %s", record.node_id, state_dir / "node.json")
    return record.token


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by the agent's user only: a new 0600 file, fsynced, renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
