"""What the routes share: their path and query parameters, the paging links, and the clock.

Lists are paged newest first by id: a page of ``limit`` rows ends at a cursor, the next page
asks for the rows ``before`` it, and the response's ``Link: <url>; rel="next"`` header (RFC
8288) says so, while any list goes on.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import Path, Query, Request, Response

from prefect_spotgpu.service.clock import request_clock

API = "/api/v1"

Id = Annotated[int, Path(ge=1, le=2**62, description="Numeric id.")]
Cursor = Annotated[int, Query(ge=0, le=2**62, description="Events after this id.")]
Wait = Annotated[float, Query(ge=0, le=60, description="Seconds to wait for an event.")]
Before = Annotated[
    int | None,
    Query(
        ge=0,
        le=2**62,
        description="Only rows older than this id: the cursor in the previous page's "
        '`Link: <...>; rel="next"` header (0: none). Without it, the newest rows.',
    ),
]
PageSize = Annotated[int, Query(ge=1, le=1000, description="Rows in one page.")]
ModelPath = Annotated[str, Path(max_length=100, description="GPU model, e.g. A100-80G.")]
RegionPath = Annotated[str, Path(max_length=63, description="Region, or any.")]


def now() -> datetime:
    """The time of the request being served, on its service's clock (``service/clock.py``)."""
    return datetime.fromtimestamp(request_clock.get().time(), UTC)


def next_cursor(rows: list, limit: int) -> int | None:
    """Where the page after ``rows`` (newest first) starts; None when this one is the last."""
    return rows[-1].id if len(rows) == limit else None


def link_next(request: Request, response: Response, **cursors: int | None) -> None:
    """Point to the next page (RFC 8288 ``Link: <url>; rel="next"``) while any list goes on;
    a list that has ended is asked again with cursor 0 (nothing older)."""
    if any(c is not None for c in cursors.values()):
        url = request.url.include_query_params(**{k: c or 0 for k, c in cursors.items()})
        response.headers["Link"] = f'<{url}>; rel="next"'
