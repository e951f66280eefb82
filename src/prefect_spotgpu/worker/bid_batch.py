"""Bids of many flow runs, placed together: one ``POST /bids/batch`` for the bids a worker
process places within a few milliseconds of each other (a fan-out's children, a pool worker
taking a queue of runs), instead of one request each.

Every run still gets its own answer. A batch is all or nothing on the market
(``service/bulk_bids.py``), so one run's bad bid must not sink the others: when the market
refuses an item (the answer's ``item``, or pydantic's ``loc`` of ``bids``), that run gets the
refusal and the rest are sent again; any other refusal of the whole batch (a balance that covers
some of the bids but not all) sends each bid alone, so each run gets its own answer. Bids carry
their runs' idempotency keys, so a batch sent again never places a bid twice.

A worker owns its batchers (``BidBatchers``): one per market connection (URL and key), each on
a thread of its own, since the runs it follows may do so from different event loops (a fan-out's
children from threads of their own); the worker closes them when it stops, ending their threads.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

import httpx

from prefect_spotgpu.api_client import tls
from prefect_spotgpu.messages import BidBatchResponse, BidResponse, ErrorResponse
from prefect_spotgpu.protocol import MAX_BIDS_PER_BATCH

WINDOW_SECONDS = 0.02
"""How long the first bid of a batch waits for others to join it."""


class BidBatchers:
    """A worker's batchers, one per market connection; ``close`` ends them all."""

    def __init__(self) -> None:
        self.batchers: dict[tuple[str, str], BidBatcher] = {}
        self._lock = threading.Lock()

    def for_client(self, http: httpx.AsyncClient) -> BidBatcher:
        """The batcher for the market and tenant of ``http``."""
        key = (str(http.base_url), http.headers.get("Authorization", ""))
        with self._lock:
            if key not in self.batchers:
                self.batchers[key] = BidBatcher(key[0], key[1], timeout=http.timeout)
            return self.batchers[key]

    def close(self) -> None:
        with self._lock:
            batchers, self.batchers = list(self.batchers.values()), {}
        for batcher in batchers:
            batcher.close()


class BidBatcher:
    def __init__(self, base_url: str, authorization: str, timeout=30.0) -> None:
        self.base_url, self.authorization, self.timeout = base_url, authorization, timeout
        self.pending: queue.Queue[tuple[dict, Future] | None] = queue.Queue()
        self.requests = 0  # batch requests sent (for tests and benchmarks)
        self.thread = threading.Thread(target=self._run, name="spot-gpu bids", daemon=True)
        self.thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then end the thread."""
        self.pending.put(None)
        self.thread.join(timeout)

    async def place(self, body: dict) -> httpx.Response:
        """Place ``body`` in the next batch; the market's answer for it alone, as a response
        of ``POST /bids`` would be (201/200 with the bid, or the refusal)."""
        future: Future = Future()
        self.pending.put((body, future))
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        headers = {"Authorization": self.authorization} if self.authorization else {}
        client = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=self.timeout, verify=tls()
        )
        with client as http:
            closed = False
            while not closed:
                first = self.pending.get()
                if first is None:
                    return
                items, deadline = [first], WINDOW_SECONDS
                try:
                    while len(items) < MAX_BIDS_PER_BATCH:
                        item = self.pending.get(timeout=deadline)
                        if item is None:  # closed: send what came before
                            closed = True
                            break
                        items.append(item)
                        deadline = 0.002  # keep gathering while bids keep coming
                except queue.Empty:
                    pass
                try:
                    self._send(http, items)
                except Exception as exc:  # no answer at all: each run retries its own
                    for _, future in items:
                        if not future.done():
                            future.set_exception(exc)

    def _send(self, http: httpx.Client, items: list[tuple[dict, Future]]) -> None:
        while items:
            if len(items) == 1:
                body, future = items[0]
                future.set_result(http.post("/bids", json=body))
                return
            self.requests += 1
            response = http.post("/bids/batch", json={"bids": [body for body, _ in items]})
            if response.status_code in (200, 201):
                placed = BidBatchResponse.model_validate(response.json())
                for (_, future), bid, created in zip(
                    items, placed.bids, placed.created, strict=True
                ):
                    future.set_result(_single(response, bid, 201 if created else 200))
                return
            index = _refused_index(response)
            if index is None or response.status_code >= 500:
                for body, future in items:  # each alone: each run gets its own answer
                    future.set_result(http.post("/bids", json=body))
                return
            items[index][1].set_result(_without_index(response, index))
            items = items[:index] + items[index + 1 :]


def _refused_index(response: httpx.Response) -> int | None:
    refusal = ErrorResponse.of(response)
    if refusal is None:
        return None
    if refusal.item is not None:  # the service's refusal names its item
        return refusal.item
    if isinstance(refusal.detail, list) and refusal.detail:  # pydantic's: by its place
        loc = refusal.detail[0].loc
        if len(loc) >= 3 and loc[:2] == ["body", "bids"] and isinstance(loc[2], int):
            return loc[2]
    return None


def _single(batch: httpx.Response, bid: BidResponse, status: int) -> httpx.Response:
    """One bid of a batch's answer as the answer of ``POST /bids`` for it alone."""
    return httpx.Response(status, json=bid.model_dump(mode="json"), request=batch.request)


def _without_index(response: httpx.Response, index: int) -> httpx.Response:
    """The refusal of item ``index`` as a refusal of that bid alone (its field and message
    without the ``bids[i]`` prefix)."""
    refusal = ErrorResponse.of(response) or ErrorResponse()
    prefix = f"bids[{index}]"
    if refusal.field is not None:
        refusal.field = refusal.field.removeprefix(prefix).lstrip(".") or None
    if isinstance(refusal.detail, str):
        refusal.detail = refusal.detail.removeprefix(f"{prefix}: ")
    elif isinstance(refusal.detail, list):
        for issue in refusal.detail:
            loc = issue.loc
            if loc[:3] == ["body", "bids", index]:  # pydantic's own
                issue.loc = ["body", *loc[3:]]
            elif len(loc) == 2 and isinstance(loc[1], str) and loc[1].startswith(prefix):
                issue.loc = ["body", loc[1].removeprefix(prefix).lstrip(".")]  # the service's
            issue.msg = issue.msg.removeprefix(f"{prefix}: ")
    body = refusal.model_dump(mode="json", exclude_none=True)
    return httpx.Response(response.status_code, json=body, request=response.request)
