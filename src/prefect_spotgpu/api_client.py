"""The one way to talk to a market's ``/api/v1``: an httpx client with its bearer credential.

A tenant API key (the worker, the CLI, the ``SpotMarket`` block), a node token (the agent)
or the admin key: every caller builds its client here, so the base path, the headers and the
timeout are written once. Every request says the client's version (``VERSION_HEADER``): the
market refuses a client older than it accepts, naming the upgrade
(docs/operators/version-skew.md). Light on purpose (httpx and the package's version only):
the CLI and the agent start fast.

    >>> with api_client("http://127.0.0.1:4300/", "sgk_x") as client:
    ...     str(client.base_url), client.headers["Authorization"]
    ('http://127.0.0.1:4300/api/v1/', 'Bearer sgk_x')
    >>> api_client("http://127.0.0.1:4300", None).headers[VERSION_HEADER] == __version__
    True
"""

from __future__ import annotations

import functools
import ssl

import httpx

from prefect_spotgpu import __version__

API_PATH = "/api/v1"
DEFAULT_TIMEOUT = 30.0
VERSION_HEADER = "X-Spotgpu-Version"
"""``protocol.VERSION_HEADER``, spelled here: this module imports nothing else of ours (the
protocol's imports would slow every start; a test holds the two equal)."""


def api_client(url: str, credential: str | None, timeout: float = DEFAULT_TIMEOUT) -> httpx.Client:
    """A client of the market at ``url``, sending ``credential`` as its bearer (None: none)."""
    return httpx.Client(
        base_url=api_base(url), timeout=timeout, headers=_headers(credential), verify=tls()
    )


def async_api_client(
    url: str, credential: str | None, timeout: float = DEFAULT_TIMEOUT
) -> httpx.AsyncClient:
    """``api_client``, for asyncio callers (the worker)."""
    return httpx.AsyncClient(
        base_url=api_base(url), timeout=timeout, headers=_headers(credential), verify=tls()
    )


@functools.cache
def tls() -> ssl.SSLContext:
    """The TLS settings of every client this process makes: httpx's default (certifi's CAs, or
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` as the environment has them when it is first asked),
    built once. httpx builds a new context for each client it makes, loading the CA bundle
    again: about 30 ms of CPU, more than a request to the market costs (the worker opens a
    client for each run it follows). A context is safe to share between clients and threads."""
    return httpx.create_ssl_context()


def api_base(url: str) -> str:
    return url.rstrip("/") + API_PATH


def _headers(credential: str | None) -> dict[str, str]:
    headers = {VERSION_HEADER: __version__}
    if credential:
        headers["Authorization"] = f"Bearer {credential}"
    return headers
