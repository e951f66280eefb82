"""Which agents and workers a market accepts: the version-skew policy, and the one dependency
that applies it to every request (docs/operators/version-skew.md).

Every request of an agent, a worker or the CLI names its prefect-spotgpu version in
``protocol.VERSION_HEADER`` (``api_client`` sends it). The market accepts a client of its own
major version from ``MINOR_VERSIONS_BEHIND`` minor release before its own on (N-1), and any
newer one: the market is upgraded first, and a newer client copes with what the market does not
know (a field it does not know is refused as ``extra_forbidden``, naming it: the agent sends its
heartbeat again without it, the worker sends only the fields a bid sets). An older client is
refused with 426 Upgrade Required, saying which version the market needs and the command that
installs it (a ``messages.VersionRefusal``).

A request without the header:

- on a tenant's or a public route, is accepted: curl, a tenant's own script, a client from
  before the header. The REST API stays what it is for them.
- from a node agent (its token), is an agent from before the header: it is taken as
  ``UNVERSIONED_AGENT``, the last release whose agents did not send one, and judged as that
  (with a warning). A market one minor release on still takes it, so upgrading the market first
  never strands a running fleet: its agents keep their heartbeats, their nodes and their jobs,
  and are upgraded after, one host at a time.

    >>> market = Release.parse("0.3.2")
    >>> judge("0.2.9", market, agent=True).skew, judge("0.4.0", market, agent=False).skew
    (<Skew.OLDER: 'older'>, <Skew.NEWER: 'newer'>)
    >>> verdict = judge("0.1.5", market, agent=False)
    >>> verdict.accepted, str(verdict.oldest)
    (False, '0.2.0')
    >>> judge(None, market, agent=True).skew, judge(None, market, agent=False).skew
    (<Skew.TOO_OLD: 'too old'>, <Skew.UNVERSIONED: 'unversioned'>)

``judge`` decides (pure); ``check_client_version`` (an app-wide dependency after
``roles.authorize``) applies it, and logs a skew once per node or tenant and kind of skew
(``SkewLog``). The heartbeat route records the agent's version in its node's telemetry
(``protocol.TELEMETRY_AGENT_VERSION``).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from prefect_spotgpu.messages import VersionRefusal
from prefect_spotgpu.protocol import VERSION_HEADER
from prefect_spotgpu.service.errors import ServiceError
from prefect_spotgpu.service.roles import Caller, authorize

logger = logging.getLogger("prefect_spotgpu.service")

MINOR_VERSIONS_BEHIND = 1
"""How many minor releases before its own the market still accepts, for agents and workers
alike (N-1): 0.4 accepts 0.3 and 0.4 (and anything newer), refuses 0.2."""

UNVERSIONED_AGENT = "0.1.0"
"""The version an agent that sends none is taken as: the last release whose agents did not."""

UPGRADE_COMMAND = 'pip install --upgrade "prefect-spotgpu=={major}.{minor}.*"'
"""What a refused client runs (the market's own release line)."""

UPGRADE_REQUIRED = 426

_VERSION = re.compile(r"(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?(?:[A-Za-z.+-][A-Za-z0-9.+-]{0,39})?")
"""A release as ``__version__`` spells it: ``MAJOR.MINOR[.PATCH]``, then a pre-release or
local part, if any (``0.2.0rc1``, ``0.2.0.dev3+g1a2b``)."""


@dataclass(frozen=True, order=True, slots=True)
class Release:
    """A release's number, as far as the policy reads it (a pre-release counts as its
    release)."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> Release | None:
        """``text`` as a release; None when it is not one."""
        match = _VERSION.fullmatch(text.strip())
        if match is None:
            return None
        return cls(int(match[1]), int(match[2]), int(match[3] or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


class Skew(StrEnum):
    """How a client's version stands to the market's."""

    SAME = "same"
    """The market's own release line (major and minor)."""
    OLDER = "older"
    """Older, within ``MINOR_VERSIONS_BEHIND``: accepted, logged once."""
    NEWER = "newer"
    """Newer: accepted (what it says that the market does not know is refused, named), logged
    once: the market is meant to be upgraded first."""
    TOO_OLD = "too old"
    """Older than the market accepts: refused, 426."""
    UNVERSIONED = "unversioned"
    """No version on a tenant's or a public route: accepted, as the REST API always was."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """``judge``'s answer: the skew, the client's release (as sent, or as taken) and the
    oldest release the market accepts."""

    skew: Skew
    client: Release | None
    oldest: Release
    unversioned: bool = False  # an agent that sent none, judged as ``UNVERSIONED_AGENT``

    @property
    def accepted(self) -> bool:
        return self.skew is not Skew.TOO_OLD


def oldest_accepted(market: Release) -> Release:
    """The oldest client release ``market`` accepts: its major, ``MINOR_VERSIONS_BEHIND``
    minor releases back."""
    return Release(market.major, max(0, market.minor - MINOR_VERSIONS_BEHIND), 0)


def judge(sent: str | None, market: Release, *, agent: bool) -> Verdict:
    """How a client that sent ``sent`` (None: no header) stands to ``market``; ``agent``: it
    calls with a node's token. A header that is no version is a ``ValueError``."""
    oldest = oldest_accepted(market)
    if sent is None and not agent:
        return Verdict(Skew.UNVERSIONED, None, oldest)
    client = Release.parse(UNVERSIONED_AGENT if sent is None else sent)
    if client is None:
        raise ValueError(f"{VERSION_HEADER} {sent[:50]!r} is not a version (MAJOR.MINOR.PATCH)")
    line = (client.major, client.minor)
    if line < (oldest.major, oldest.minor):
        skew = Skew.TOO_OLD
    elif line == (market.major, market.minor):
        skew = Skew.SAME
    else:
        skew = Skew.OLDER if line < (market.major, market.minor) else Skew.NEWER
    return Verdict(skew, client, oldest, unversioned=sent is None)


def refusal(verdict: Verdict, market: Release, *, agent: bool) -> VersionRefusal:
    """What a refused client is told: the versions, and the command that upgrades it."""
    who = "agent" if agent else "client"
    upgrade = UPGRADE_COMMAND.format(major=market.major, minor=market.minor)
    sent = f"is {verdict.client}"
    if verdict.unversioned:
        sent = "sends no version (an agent from before it was sent)"
    then = (
        "then `systemctl reload spotgpu-agent` (its jobs are handed over, not stopped)"
        if agent
        else "then restart the worker"
    )
    return VersionRefusal(
        detail=f"this market runs prefect-spotgpu {market} and accepts {who}s from "
        f"{verdict.oldest} on; this {who} {sent}. Upgrade it: {upgrade}, {then}",
        market_version=str(market),
        oldest_accepted=str(verdict.oldest),
        client_version=str(verdict.client),
        upgrade=upgrade,
    )


def skew_line(verdict: Verdict, market: Release, who: str) -> str | None:
    """The warning a skew is worth (None: none): ``who`` names the client."""
    if verdict.unversioned:
        return (
            f"{who} sends no version (an agent from before it was sent): taken as "
            f"{UNVERSIONED_AGENT}, accepted while this market ({market}) is within "
            f"{MINOR_VERSIONS_BEHIND} minor release of it; upgrade it"
        )
    if verdict.skew is Skew.OLDER:
        return f"{who} runs {verdict.client}, behind this market's {market}: upgrade it"
    if verdict.skew is Skew.NEWER:
        return (
            f"{who} runs {verdict.client}, newer than this market's {market}: upgrade the "
            "market first (what the market does not know of its requests is refused)"
        )
    return None


# ------------------------------------------------------------------ the dependency


class ClientTooOld(ServiceError):
    """A client older than the market accepts: answered 426 with a ``VersionRefusal``."""

    status_code = UPGRADE_REQUIRED

    def __init__(self, refused: VersionRefusal) -> None:
        super().__init__(str(refused.detail))
        self.refused = refused


def too_old_response(request: Request, exc: ClientTooOld) -> JSONResponse:
    return JSONResponse(exc.refused.model_dump(exclude_none=True), status_code=exc.status_code)


class SkewLog:
    """The skews already logged, by caller and kind of skew: one warning each (thread-safe;
    never by the version sent, which a caller may vary without end)."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, int, Skew, bool]] = set()
        self._lock = threading.Lock()

    def once(self, key: tuple[str, int, Skew, bool], line: str) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        logger.warning("%s", line)


@functools.lru_cache(maxsize=64)
def _release(version: str) -> Release:
    release = Release.parse(version)
    if release is None:
        raise ValueError(f"the market's version {version!r} is not a release")
    return release


def sent_version(request: Request) -> str | None:
    """The version the request's client sent, if any (checked by ``check_client_version``)."""
    return request.headers.get(VERSION_HEADER)


async def check_client_version(
    request: Request, caller: Annotated[Caller, Depends(authorize)]
) -> None:
    """The app-wide dependency: refuse a client older than the market accepts (426; an agent
    leaving still reaches ``WINDING_DOWN``), log a skew once per node or tenant and kind of
    skew. Given ``authorize``'s caller (FastAPI calls it once a request); no I/O, so
    ``async``."""
    sent = sent_version(request)
    market = _release(request.app.state.market_version)
    agent = caller.node_id is not None
    try:
        verdict = judge(sent, market, agent=agent)
    except ValueError as exc:
        raise ServiceError(str(exc)) from None
    if not verdict.accepted and not _winds_down(request):
        raise ClientTooOld(refusal(verdict, market, agent=agent))
    skew = (verdict.skew, verdict.unversioned)
    if agent:
        key, who = ("node", caller.node_id, *skew), f"node {caller.node_id}'s agent"
    elif caller.tenant_id is not None:
        key, who = ("tenant", caller.tenant_id, *skew), f"tenant {caller.tenant_id}'s client"
    else:
        return
    line = skew_line(verdict, market, who)
    if line is not None:
        request.app.state.skew_log.once(key, line)


WINDING_DOWN = frozenset(
    {
        "/api/v1/nodes/{node_id}/leave",
        "/api/v1/nodes/{node_id}/events",
        "/api/v1/allocations/{allocation_id}/report",
    }
)
"""The routes an agent too old for the market (its heartbeat refused: it leaves) still uses, to
leave as if stopped: its node taken back, its jobs' notices (and their epochs) read, their final
saves and ends reported. Refused, the market would learn nothing until the node's heartbeat
timeout (charging the jobs meanwhile) and would not know the final saves (compensating from an
older checkpoint)."""


def _winds_down(request: Request) -> bool:
    route = request.scope.get("route")
    return getattr(route, "path", None) in WINDING_DOWN
