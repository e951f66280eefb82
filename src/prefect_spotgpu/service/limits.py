"""Request bodies are bounded: one larger than ``MAX_BODY_BYTES`` is refused with a 413 before
the app reads it (by its ``Content-Length``, or, when it streams without one, as soon as what has
arrived passes the limit). A pure ASGI middleware, so streaming responses are untouched; it
reads no body itself and sits just inside the security headers (``hardening``), so its 413
carries them as every other answer does."""

from __future__ import annotations

import json

MAX_BODY_BYTES = 1024 * 1024
"""The largest request body the service reads (a bid with a full job environment is < 100 KB)."""


class BodyLimit:
    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        seen = 0
        refused = False
        started = False

        async def bounded_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # answer now; the app sees the client go away
                    refused = True
                    if not started:
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:
                return  # the 413 is the answer: whatever the app says after it is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, bounded_receive, guarded_send)

    async def _refuse(self, send) -> None:
        body = json.dumps(
            {"detail": f"the request body is larger than {self.max_bytes} bytes"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
