"""The worker's calls to the market: one class per tenant connection, the market's refusals as
``MarketError`` (one place for its error messages), and the rule for what is retried.

``MarketApi`` wraps the tenant's authenticated client (``SpotMarket.get_async_client``). Its
calls are not retried themselves: the attempt wraps each step in :func:`retry`, which retries
a *transient* failure (no answer at all, or a 5xx, 408 or 429, from the market or Prefect)
with backoff and raises any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import httpx

from prefect_spotgpu.messages import (
    AllocationResponse,
    BidRequest,
    BidResponse,
    EventsPage,
    ImageResponse,
    QuoteResponse,
    WebhookConfigResponse,
)
from prefect_spotgpu.protocol import LIVE_BID_STATUSES, MarketTerms
from prefect_spotgpu.worker.bid_batch import BidBatchers
from prefect_spotgpu.worker.report import quote_summary

T = TypeVar("T")

RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0
POLL_SECONDS = 2.0
"""Long-poll window on the bid's events; the flow run's state is checked between windows."""


class MarketError(RuntimeError):
    """The market refused a request; the message carries its reason, ``status`` the HTTP code."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def is_transient(exc: Exception) -> bool:
    """A failure worth retrying: no answer at all, or a 5xx, 408 or 429 from the market or
    Prefect (``MarketError`` or ``httpx.HTTPStatusError``)."""
    if isinstance(exc, MarketError):
        status = exc.status
    elif isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    else:
        return isinstance(exc, httpx.HTTPError)  # connection refused, timeout, ...
    return status >= 500 or status in (408, 429)


async def retry(doing: str, call: Callable[[], Awaitable[T]], warn: Callable[[str], None]) -> T:
    """``await call()``, retried with backoff (1 s doubling to 30 s) while the failure is
    transient (``is_transient``); ``warn`` gets one line per retry. Others are raised."""
    delay = RETRY_FIRST_SECONDS
    while True:
        try:
            return await call()
        except (httpx.HTTPError, MarketError) as exc:
            if not is_transient(exc):
                raise
            warn(f"Could not {doing} ({exc}); retrying in {delay:.0f} s")
            await anyio.sleep(delay)
            delay = min(RETRY_MAX_SECONDS, delay * 2)


def checked(response: httpx.Response, doing: str) -> Any:
    """The response's JSON, or ``MarketError`` with the market's reason."""
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise MarketError(
            f"the market refused to {doing} (HTTP {response.status_code}): {detail}",
            response.status_code,
        )
    return response.json()


class MarketApi:
    """A tenant's view of the market: its bids, their events and allocations, the quotes."""

    def __init__(self, http: httpx.AsyncClient, batchers: BidBatchers | None = None) -> None:
        self.http = http
        self.batchers = batchers  # its worker's (None: each bid placed alone)
        self._terms: MarketTerms | None = None

    async def terms(self) -> MarketTerms:
        """The market's terms (``GET /market``, read once); an older market without the
        route: the defaults, which are its settings' defaults."""
        if self._terms is None:
            response = await self.http.get("/market")
            self._terms = (
                MarketTerms()
                if response.status_code == 404
                else MarketTerms.read(checked(response, "read the market's terms"))
            )
        return self._terms

    async def bid(self, bid_id: int | str) -> BidResponse:
        return BidResponse.model_validate(
            checked(await self.http.get(f"/bids/{bid_id}"), "read the bid")
        )

    async def bid_or_none(self, bid_id: int | str) -> BidResponse | None:
        """The bid, or None when the market does not know it (404)."""
        try:
            return await self.bid(bid_id)
        except MarketError as exc:
            if exc.status != 404:
                raise
            return None

    async def events(self, bid_id: int, after: int, timeout: float = 0) -> EventsPage:
        """The bid's events after ``after``, waiting up to ``timeout`` s for one (long poll)."""
        page = checked(
            await self.http.get(
                f"/bids/{bid_id}/events",
                params={"after": after, "timeout": timeout},
                timeout=timeout + 30,
            ),
            "follow the bid" if timeout else "read the bid's events",
        )
        return EventsPage.model_validate(page)

    async def allocations(self, bid_id: int) -> list[AllocationResponse]:
        listed = checked(
            await self.http.get(f"/bids/{bid_id}/allocations"), "list the bid's allocations"
        )
        return [AllocationResponse.model_validate(a) for a in listed]

    async def images(self) -> list[ImageResponse]:
        """The market's image catalogue (``GET /images``)."""
        listed = checked(await self.http.get("/images"), "read the image catalogue")
        return [ImageResponse.model_validate(i) for i in listed]

    async def place(self, bid: BidRequest) -> BidResponse:
        """Place a bid: in one ``/bids/batch`` with the worker's other new bids
        (``bid_batch``), answered for this bid alone."""
        if self.batchers is None:
            answer = await self.http.post("/bids", json=bid.body())
        else:
            answer = await self.batchers.for_client(self.http).place(bid.body())
        placed = checked(answer, "place the bid")
        return BidResponse.model_validate(placed)

    async def reprice(
        self, bid_id: int, price: float, doing: str = "reprice the bid"
    ) -> BidResponse:
        response = await self.http.patch(f"/bids/{bid_id}", json={"max_price": price})
        return BidResponse.model_validate(checked(response, doing))

    async def cancel(self, bid_id: int) -> None:
        """Cancel the bid; one already over (409) is fine."""
        response = await self.http.post(f"/bids/{bid_id}/cancel")
        if response.status_code not in (200, 409):
            checked(response, "cancel the bid")

    async def cancel_known(self, bid_id: int | str) -> bool:
        """Cancel the bid; False when the market does not know it (404)."""
        response = await self.http.post(f"/bids/{bid_id}/cancel")
        if response.status_code == 404:
            return False
        checked(response, "cancel the bid")
        return True

    async def set_webhook(self, url: str) -> None:
        current = await self.http.get("/webhook")
        if (
            current.status_code == 200
            and WebhookConfigResponse.model_validate(current.json()).url == url
        ):
            return
        checked(await self.http.put("/webhook", json={"url": url}), "set the notice webhook")

    async def quotes(self) -> list[QuoteResponse] | None:
        """Every pool's quote (``GET /prices``); None when the market does not answer them
        (the policy then assumes spot open, as before it had quotes)."""
        try:
            response = await self.http.get("/prices")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return [QuoteResponse.model_validate(q) for q in response.json()]

    async def quote(self, bid: BidResponse) -> tuple[str, bool]:
        """What the market offers this bid now (``report.quote_summary``), from ``/prices``."""
        response = await self.http.get("/prices")
        if response.status_code != 200:
            return "no quote", False
        return quote_summary(bid, [QuoteResponse.model_validate(q) for q in response.json()])

    async def live_bids(self) -> list[BidResponse]:
        """Every open or held bid of the tenant (every page, newest first, by the Link header)."""
        bids: list[BidResponse] = []
        for status in LIVE_BID_STATUSES:
            response = await self.http.get("/bids", params={"status": status, "limit": 1000})
            while True:
                bids += [BidResponse.model_validate(b) for b in checked(response, "list bids")]
                if "next" not in response.links:
                    break
                response = await self.http.get(response.links["next"]["url"])
        return bids
