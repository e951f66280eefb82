"""Helpers that several test modules share (plain functions, not fixtures)."""

from __future__ import annotations

import httpx


def post_streamed_oversized(service, headers) -> httpx.Response:
    """A 2.5 MB bid body streamed without a Content-Length: refused as soon as what arrived
    passes the limit."""

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    return httpx.post(
        service.base_url + "/api/v1/bids",
        content=chunks(),
        headers={**headers, "content-type": "application/json"},
        timeout=30,
    )
