"""Browser hardening: the headers on every response of the service.

Every response carries a Content-Security-Policy that runs only this host's scripts, styles
and connections, no inline script, no plugin, no framing (``CSP``), and ``HARDENING``'s
headers (no sniffing, no framing, no referrer): the dashboard renders data, never markup, and
an injected string that slipped past it still could not run. The OpenAPI pages (``/docs``,
``/redoc``) load their viewer from a CDN and get a policy of their own (``DOCS_CSP``), which
allows their one inline script by its hash. ``SecurityHeaders`` (pure ASGI, installed by
``install_security_headers``) adds them.
"""

from __future__ import annotations

import base64
import hashlib
import re

_SHARED = (
    "object-src 'none'",
    "base-uri 'none'",
    "frame-ancestors 'none'",
    "form-action 'self'",
)
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        *_SHARED,
    )
)
"""Every response but the OpenAPI pages: this host's scripts, styles and connections only."""

DOCS_CDN = "https://cdn.jsdelivr.net"
DOCS_CSP = "; ".join(
    (
        "default-src 'self'",
        f"script-src 'self' {DOCS_CDN}" + "{hashes}",
        f"style-src 'self' 'unsafe-inline' {DOCS_CDN} https://fonts.googleapis.com",
        "font-src 'self' data: https://fonts.gstatic.com",
        "img-src 'self' data: https://fastapi.tiangolo.com https://cdn.redoc.ly",
        "worker-src 'self' blob:",
        "connect-src 'self'",
        *_SHARED,
    )
)
"""FastAPI's Swagger UI and ReDoc pages: their viewer from the CDN, inline styles, and their
one inline script allowed by its hash (``{hashes}``), never ``'unsafe-inline'`` scripts."""

HARDENING = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
_INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.DOTALL)


def _hardened(headers, csp: str) -> list[tuple[bytes, bytes]]:
    """``headers`` with the hardening headers added where the response does not set them."""
    out = list(headers)
    present = {name.lower() for name, _ in out}
    for name, value in ((b"content-security-policy", csp.encode()), *HARDENING):
        if name not in present:
            out.append((name, value))
    return out


def docs_csp(html: bytes) -> str:
    """The OpenAPI page's policy, allowing exactly the inline scripts of ``html``."""
    hashes = "".join(
        f" 'sha256-{base64.b64encode(hashlib.sha256(script).digest()).decode()}'"
        for script in _INLINE_SCRIPT.findall(html)
    )
    return DOCS_CSP.format(hashes=hashes)


class SecurityHeaders:
    """ASGI middleware: the hardening headers on every HTTP response. Pure ASGI, so a
    streaming response (the dashboard's event stream) passes through unbuffered; only the
    OpenAPI pages (``docs_paths``, a few kB of HTML) are read whole to hash their scripts."""

    def __init__(self, app, docs_paths: frozenset[str]) -> None:
        self.app = app
        self.docs_paths = docs_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in self.docs_paths:
            await self._docs(scope, receive, send)
            return

        async def send_hardened(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": _hardened(message.get("headers", ()), CSP)}
            await send(message)

        await self.app(scope, receive, send_hardened)

    async def _docs(self, scope, receive, send) -> None:
        start, chunks = None, []

        async def send_hashed(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    html = b"".join(chunks)
                    headers = _hardened(start.get("headers", ()), docs_csp(html))
                    await send({**start, "headers": headers})
                    await send({"type": "http.response.body", "body": html})
            else:
                await send(message)

        await self.app(scope, receive, send_hashed)


def install_security_headers(app) -> None:
    """Every response of ``app`` carries the hardening headers (``CSP``, ``HARDENING``).

    Install it after every other middleware: it is then the outermost, and an answer a
    middleware writes itself (the body limit's 413, ``limits.BodyLimit``) carries them too.
    Responses the server itself writes for an unhandled exception (Starlette's
    ``ServerErrorMiddleware``, outside every added middleware) are plain text without them.
    """
    docs = (app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
    app.add_middleware(SecurityHeaders, docs_paths=frozenset(p for p in docs if p))
