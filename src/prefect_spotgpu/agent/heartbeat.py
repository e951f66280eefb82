"""A node's heartbeat (``POST /nodes/{id}/heartbeat``): it is alive, its telemetry, and the
images it holds (``images``: the market's placement prefers, among equal fits, a node that has
a bid's image already). A field the market refuses (a 422 naming it: a GPU reading out of its
schema, say) is left out and the heartbeat sent again: the node must not look lost over it.

Listing them is a call to the Docker engine, too much for every heartbeat: the list is read at
the first heartbeat, after every pull (``pulled``), and otherwise at most every
``REFRESH_SECONDS``; a heartbeat carries it only when it differs from the list the market last
accepted (``accepted``), so most heartbeats carry none (the market keeps what it has).

Each heartbeat is counted by what became of it (``metrics``: accepted, refused, unanswered); a
market that refuses this agent's version (426) says which one it needs, logged as an error.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import httpx

from prefect_spotgpu.agent.metrics import AgentMetrics, Beat
from prefect_spotgpu.messages import ErrorResponse, Heartbeat, RunnerTerms

logger = logging.getLogger("prefect_spotgpu.agent")
TELEMETRY_GPUS = "gpus"
"""The key of a heartbeat's telemetry that holds each GPU's figures (an older market may
refuse them: the heartbeat goes again without)."""

REFRESH_SECONDS = 60.0


class NodeImages:
    """The node's image list; ``read`` lists them (``Runner.local_images``). Used by the
    heartbeat thread; ``pulled`` may be called from any thread."""

    def __init__(
        self,
        read: Callable[[], list[str]],
        *,
        refresh_seconds: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._stale = threading.Event()
        self._stale.set()  # read at the first heartbeat
        self._read_at = clock()
        self._images: list[str] | None = None
        self._accepted: list[str] | None = None

    def pulled(self) -> None:
        """An image was pulled (or a pull failed half-way): read the list again."""
        self._stale.set()

    def to_send(self) -> list[str] | None:
        """The list for this heartbeat, read again if due; None when the market has it (or it
        could not be read)."""
        if self._stale.is_set() or self._clock() - self._read_at >= self.refresh_seconds:
            self._stale.clear()  # (a pull that ends during the read sets it again)
            self._read_at = self._clock()
            try:
                self._images = list(self._read())
            except Exception as exc:  # the engine is down, say: keep what the market has
                logger.warning("the node's images could not be listed: %s", exc)
        return None if self._images == self._accepted else self._images

    def accepted(self, images: list[str]) -> None:
        """The market took (or refused: it is not offered again until it changes) ``images``."""
        self._accepted = images


def node_telemetry(jobs: int, declared: bool, read_gpus: Callable[[], list] | None) -> dict:
    """A heartbeat's telemetry: the jobs running, whether the GPUs were declared, and each
    GPU's readings (``read_gpus``: ``discovery.telemetry_nvml``; left out if it fails)."""
    telemetry = {"jobs": jobs, "declared": declared}
    if read_gpus is not None:
        with contextlib.suppress(Exception):
            telemetry[TELEMETRY_GPUS] = read_gpus()
    return telemetry


def runner_terms(runner) -> RunnerTerms:
    """How a node runs jobs, as the market takes it (``market.Runner``): the market places a
    bid only where it can run as asked, a gang member only where its peers reach it."""
    network = getattr(runner, "job_network", None)
    return RunnerTerms(
        runner=runner.name,
        default_image=getattr(runner, "default_image", None) or None,
        job_subnet=None if network is None else str(network.subnet),
    )


def send_heartbeat(
    client: httpx.Client,
    node_id: int,
    *,
    telemetry: dict,
    images: NodeImages,
    address: str | None = None,
    runner: RunnerTerms | None = None,
    metrics: AgentMetrics | None = None,
) -> httpx.Response:
    """One heartbeat: ``telemetry``, the node's advertised ``address`` (where a gang's other
    ranks reach its rank 0), how it runs jobs (``runner``, every time) and the node's images
    when they changed; the market's answer (after one more try without what it refused),
    counted in ``metrics`` (no answer: counted, and the ``httpx.HTTPError`` raised)."""
    try:
        response = _send(client, node_id, telemetry, images, address, runner)
    except httpx.HTTPError:
        if metrics is not None:
            metrics.heartbeat(Beat.UNANSWERED)
        raise
    if metrics is not None:
        metrics.heartbeat(Beat.ACCEPTED if response.status_code == 200 else Beat.REFUSED)
    if response.status_code == httpx.codes.UPGRADE_REQUIRED:
        refusal = ErrorResponse.of(response)
        logger.error("heartbeat refused: %s", refusal.detail if refusal else response.text[:300])
    elif response.status_code != 200:
        logger.warning("heartbeat refused: %s %s", response.status_code, response.text[:200])
    return response


def _send(client, node_id, telemetry, images, address, runner) -> httpx.Response:
    """The heartbeat; once more without the fields a market older than this agent refused."""
    listed = images.to_send()
    terms = (runner or RunnerTerms()).model_dump()
    beat = Heartbeat(telemetry=telemetry, images=listed, address=address, **terms)
    path = f"/nodes/{node_id}/heartbeat"
    response = client.post(path, json=beat.body())
    said = set(RunnerTerms.model_fields)
    refused = _refused_fields(response) & ({"telemetry", "images"} | said)
    if "job_subnet" in refused and "job_subnet" not in _refused_fields(response, unknown=True):
        refused.discard("job_subnet")  # (the market knows it and says no: an overlap. Sent
        # without, the node would lose its job network while its containers sit on it)
    if refused:  # (a market older than this agent): sent again without
        without: dict = dict.fromkeys(refused & (said | {"images"}))
        if "telemetry" in refused:
            without["telemetry"] = {k: v for k, v in telemetry.items() if k != TELEMETRY_GPUS}
        beat = beat.model_copy(update=without)
        logger.warning("heartbeat: %s refused (%s); sent without", refused, response.text[:200])
        response = client.post(path, json=beat.body())
    if listed is not None and (response.status_code == 200 or "images" in refused):
        images.accepted(listed)  # (refused: not offered again until it changes)
    return response


def _refused_fields(response: httpx.Response, unknown: bool = False) -> set[str]:
    """The body fields a 422 names (``{"detail": [{"loc": ["body", FIELD, ...]}]}``);
    ``unknown``: only those refused as fields the market does not know (an older one)."""
    refusal = ErrorResponse.of(response) if response.status_code == 422 else None
    if refusal is None or not isinstance(refusal.detail, list):
        return set()
    return {
        str(i.loc[1])
        for i in refusal.detail
        if len(i.loc) > 1 and i.loc[0] == "body" and (not unknown or i.type == "extra_forbidden")
    }
