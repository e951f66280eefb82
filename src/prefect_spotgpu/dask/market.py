"""The market as a ``SpotGPUCluster`` sees it: thin HTTP calls, no decisions (``rules``).

One asynchronous client per cluster, used on the cluster's event loop only. Bids are placed
in batches (``POST /bids/batch``, at most ``PLACE_BATCH`` a request: each carries its TLS
certificate in its sealed environment) and cancelled one by one (``POST /bids/{id}/cancel``);
what holds GPUs is read in one request (``GET /allocations?active=true``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from prefect_spotgpu.messages import AllocationResponse, BidResponse, QuoteResponse
from prefect_spotgpu.protocol import ENDING_EVENTS, LIVE_BID_STATUSES, EndReason

PLACE_BATCH = 100
"""The most bids one request places (about 4 KB each with the certificate)."""


class MarketError(RuntimeError):
    """The market refused a request; the message says what it answered."""


def resolve_market(market: Any = None, *, url: str | None = None, api_key: str | None = None):
    """The ``SpotMarket`` block for ``market`` (a block, or the name of a saved one), or one
    made of ``url`` and ``api_key``."""
    from pydantic import SecretStr

    from prefect_spotgpu.blocks import SpotMarket

    if isinstance(market, SpotMarket):
        return market
    if isinstance(market, str):
        return SpotMarket.load(market)
    if market is not None:
        raise TypeError(f"market must be a SpotMarket block or a block's name, not {market!r}")
    if not url or not api_key:
        raise ValueError("give market (a SpotMarket block or its name), or url and api_key")
    return SpotMarket(url=url, api_key=SecretStr(api_key))


def _check(response, what: str):
    if response.status_code >= 400:
        raise MarketError(f"{what}: the market answered {response.status_code} {response.text}")
    return response.json()


class MarketView:
    """The calls a cluster makes (see the module doc)."""

    def __init__(self, market) -> None:
        self.market = market
        self._client = None

    @property
    def client(self):
        if self._client is None:  # made on the loop that uses it
            self._client = self.market.get_async_client(timeout=30.0)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    async def prices(self) -> list[QuoteResponse]:
        quotes = _check(await self.client.get("/prices"), "reading the prices")
        return [QuoteResponse.model_validate(q) for q in quotes]

    async def place(self, bids: list[dict]) -> list[int]:
        """Place ``bids`` (``BidCreate`` bodies), in batches; their ids, in order."""
        ids: list[int] = []
        for first in range(0, len(bids), PLACE_BATCH):
            chunk = bids[first : first + PLACE_BATCH]
            if len(chunk) == 1:
                placed = [_check(await self.client.post("/bids", json=chunk[0]), "placing a bid")]
            else:
                answer = await self.client.post("/bids/batch", json={"bids": chunk})
                placed = _check(answer, f"placing {len(chunk)} bids")["bids"]
            ids.extend(int(b["id"]) for b in placed)
        return ids

    async def cancel(self, bid_id: int) -> None:
        """Cancel a bid; one already over is left as it is."""
        response = await self.client.post(f"/bids/{bid_id}/cancel")
        if response.status_code >= 400 and response.status_code not in (404, 409):
            raise MarketError(f"cancelling bid {bid_id}: {response.status_code} {response.text}")

    async def holding(self) -> dict[int, list[str]]:
        """Each bid with GPUs (running, noticed or reserved) -> its allocations' statuses."""
        found: dict[int, list[str]] = {}
        url = "/allocations?active=true&limit=500"
        while url:
            response = await self.client.get(url)
            for a in _check(response, "reading the allocations"):
                found.setdefault(int(a["bid_id"]), []).append(a["status"])
            url = response.links.get("next", {}).get("url")
        return found

    async def bid(self, bid_id: int) -> BidResponse:
        return BidResponse.model_validate(
            _check(await self.client.get(f"/bids/{bid_id}"), f"reading bid {bid_id}")
        )

    async def is_live(self, bid_id: int) -> bool:
        return (await self.bid(bid_id)).status in LIVE_BID_STATUSES

    async def last_failure(self, bid_id: int) -> str | None:
        """What the node said of the bid's last job that failed (exited non-zero), if its
        last allocation ended so (the market then places the bid again)."""
        page = _check(
            await self.client.get(f"/bids/{bid_id}/events", params={"after": 0, "timeout": 0}),
            f"reading bid {bid_id}'s events",
        )
        for event in reversed(page["events"]):
            if event["kind"] in ENDING_EVENTS:
                payload = event.get("payload") or {}
                if payload.get("reason") == EndReason.JOB_FAILED:
                    return payload.get("detail") or ""
                return None
        return None

    async def image_names(self) -> dict[str, str]:
        """The catalogue: each image's name and reference -> its name."""
        images = _check(await self.client.get("/images"), "reading the image catalogue")
        return {key: i["name"] for i in images for key in (i["name"], i["reference"])}

    async def costs(self, bid_ids: list[int]) -> dict:
        """Spot cost of these bids against the same GPU-hours on demand
        (``fanout.cost_report``), and their preemptions."""
        from prefect_spotgpu.fanout import cost_report

        bids = []
        for bid_id in bid_ids:
            bid = await self.client.get(f"/bids/{bid_id}")
            listed = await self.client.get(f"/bids/{bid_id}/allocations")
            if bid.status_code == 200 and listed.status_code == 200:
                allocations = [AllocationResponse.model_validate(a) for a in listed.json()]
                bids.append((BidResponse.model_validate(bid.json()), allocations))
        return cost_report(bids)
