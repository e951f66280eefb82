"""Helpers that several test modules share (plain functions, not fixtures)."""

from __future__ import annotations

import contextlib
import shlex
import subprocess

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


ALLOCATION_DEFAULTS = {
    "bid_id": 1,
    "node_id": 1,
    "gpu_count": 1,
    "status": "running",
    "epoch": 1,
    "kind": "spot",
    "started_at": 0.0,
    "charged_until": 0.0,
    "price": 1.0,
    "deadline": None,
    "notice_reason": None,
    "charged_amount": 0.0,
    "charged_micros": 0,
    "charged_seconds": 0.0,
    "last_checkpoint_at": None,
    "final_save": None,
    "ended_at": None,
    "end_reason": None,
}


def allocation(allocation_id: int = 1, **fields):
    """An allocation as the worker reads it (``messages.AllocationResponse``), running, with
    the fields a test does not name filled in."""
    from prefect_spotgpu.messages import AllocationResponse

    return AllocationResponse.model_validate({**ALLOCATION_DEFAULTS, "id": allocation_id, **fields})


def assignment(allocation_id: int, **fields):
    """An allocation as a node's agent reads it (``messages.Assignment``), running, with the
    fields a test does not name filled in."""
    from prefect_spotgpu.messages import Assignment

    defaults = {
        **ALLOCATION_DEFAULTS,
        "id": allocation_id,
        "tenant_id": 1,
        "checkpoint_key": f"bid-{fields.get('bid_id', 1)}",
    }
    return Assignment.model_validate({**defaults, **fields})


BID_DEFAULTS = {
    "id": 7,
    "tenant_id": 1,
    "idempotency_key": None,
    "gpu_model": "A100-80G",
    "region": "any",
    "gpu_count": 1,
    "max_price": 1.5,
    "status": "open",
    "hold_reason": None,
    "window_start": None,
    "window_end": None,
    "deadline": None,
    "labels": None,
    "created_at": "2026-12-01T00:00:00Z",
}
"""A bid's required fields (those with a default, such as ``capacity`` and ``node_count``,
are left to the model: a test of an older market's reply leaves them out)."""


def bid(**fields):
    """A bid as the worker reads it (``messages.BidResponse``): bid 7, open, for one A100-80G
    in any region at most 1.50 per GPU-hour, with the fields a test names."""
    from prefect_spotgpu.messages import BidResponse

    return BidResponse.model_validate({**BID_DEFAULTS, **fields})


QUOTE_DEFAULTS = {
    "gpu_model": "A100-80G",
    "capacity": "spot",
    "clearing_price": None,
    "reserve_price": 0.9,
    "on_demand_price": 2.1,
    "gpus_total": 4,
    "gpus_free": 0,
    "gpus_running": 0,
    "waiting_bids": 0,
}


def quote(region: str, **fields):
    """One pool's quote as the worker reads it (``messages.QuoteResponse``): spot A100-80G in
    ``region``, reserve 0.90, no clearing price, none of its 4 GPUs free, unless a test says."""
    from prefect_spotgpu.messages import QuoteResponse

    return QuoteResponse.model_validate({**QUOTE_DEFAULTS, "region": region, **fields})


def image(name: str, reference: str, **fields):
    """One entry of the market's image catalogue as the worker reads it
    (``messages.ImageResponse``), with the fields a test does not name filled in."""
    from prefect_spotgpu.messages import ImageResponse

    defaults = {
        "framework": "PyTorch 2.5.1",
        "cuda_version": "12.4",
        "description": "",
        "updated_at": "2026-12-01T00:00:00Z",
    }
    return ImageResponse.model_validate(
        {**defaults, "name": name, "reference": reference, **fields}
    )


_event_ids = iter(range(1, 10**9))


def bid_event(kind: str, alloc: int, bid: int = 7, node: int = 1, **payload):
    """One event of a bid as the worker reads it (``messages.EventResponse``); ``payload``: the
    keys the service would write (``messages.EventPayload``'s fields, or any other)."""
    from datetime import UTC, datetime

    from prefect_spotgpu.messages import EventPayload, EventResponse

    return EventResponse(
        id=next(_event_ids),
        kind=kind,
        bid_id=bid,
        node_id=node,
        allocation_id=alloc,
        payload=EventPayload.model_validate(payload),
        created_at=datetime(2026, 12, 1, tzinfo=UTC),
    )


def nodes_back_to_live(stack, timeout: float = 60) -> None:
    """Put a ``LocalStack``'s reclaimed nodes back to live and wait until all are (what an
    end-to-end module does after each test)."""
    from conftest import wait_for

    owner = stack.market(stack.owner_key)
    for node_id in stack.nodes:
        if owner.get(f"/nodes/{node_id}").json()["state"] == "reclaimed":
            owner.patch(f"/nodes/{node_id}", json={"state": "live"})
    wait_for(lambda: all(n["state"] == "live" for n in owner.get("/nodes").json()), timeout, "live")


def stop_agent(proc, timeout: float = 15) -> None:
    """Stop an agent process as its operator would (SIGTERM; SIGKILL after ``timeout``) and
    close its log file."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.logfile.close()


@contextlib.contextmanager
def namespace_elsewhere(name: str, here: str, there: str):
    """A machine elsewhere, for the container tests: a network namespace ``name`` behind a
    veth pair, this host's end at ``here``, its own at ``there`` (both /24), its default route
    through this host. Removed afterwards (and first, if a killed run left it)."""

    def sh(command: str, check: bool = True) -> None:
        subprocess.run(shlex.split(command), capture_output=True, text=True, check=check)

    sh(f"ip netns del {name}", check=False)
    sh(f"ip link del {name}0", check=False)
    sh(f"ip netns add {name}")
    try:
        sh(f"ip link add {name}0 type veth peer name {name}1")
        sh(f"ip link set {name}1 netns {name}")
        sh(f"ip addr add {here}/24 dev {name}0")
        sh(f"ip link set {name}0 up")
        for step in (f"ip addr add {there}/24 dev {name}1", f"ip link set {name}1 up",
                     "ip link set lo up", f"ip route add default via {here}"):  # fmt: skip
            sh(f"ip netns exec {name} {step}")
        yield there
    finally:
        sh(f"ip netns del {name}", check=False)
        sh(f"ip link del {name}0", check=False)


@contextlib.contextmanager
def prefect_client(api_url: str):
    """A synchronous client of the Prefect server at ``api_url`` (a stack's own)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings(updates={PREFECT_API_URL: api_url}),
        get_client(sync_client=True) as client,
    ):
        yield client


def market_ticked(stack, ticks: int = 10) -> None:
    """Until a stack's market has ticked ``ticks`` more times (its charges flushed, what it
    would place placed): a test asserting that nothing happens waits for this, not seconds."""
    from prefect_spotgpu.cli.stack import wait_for

    done = stack.market().get("/health").json()["ticks"] + ticks
    wait_for(lambda: stack.market().get("/health").json()["ticks"] >= done, 60, "ticks", 0.05)


@contextlib.contextmanager
def slow_link(port: int, delay: float):
    """A loopback port that forwards to ``port`` after ``delay`` seconds per connection: a
    far or busy server (a first request, or an events socket's first message, arrives late)."""
    import socket
    import threading
    import time

    def pump(source, sink) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def forward(client) -> None:
        time.sleep(delay)
        with client, socket.create_connection(("127.0.0.1", port)) as server:
            back = threading.Thread(target=pump, args=(server, client), daemon=True)
            back.start()
            pump(client, server)
            back.join()

    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        with contextlib.suppress(OSError):  # (closed: the link is gone)
            while True:
                threading.Thread(target=forward, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
