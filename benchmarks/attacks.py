"""The hostile tenants' attacks, replayed against the real service on SQLite and PostgreSQL side by
side: how each now fails, in status codes, balances and seconds.

- ``overspend``: a tenant with 0.01 credit posts 40 bids of 8 GPUs at 1000 per GPU-hour in
  parallel, on nodes whose reserve is 999 (before: all accepted, balance -44 to -68); then a
  tenant whose credit covers two such bids does the same (two run, are noticed when only their
  notice is left; the lowest balance seen);
- ``silent_reclaimed_node``: a node is reclaimed with a job on it and its agent stops
  heartbeating (before: the job was billed to its 300 s deadline, nothing compensated);
- ``loose_numbers``: ``true`` and ``"1"`` as ``max_price`` and ``gpu_count``; a 2 MB body's
  headers (before: accepted; a 413 without CSP or nosniff);
- ``open_bids``: bids past the operator's cap (before: 10^4 accepted).

The fairness floods (long-polls, streams, estimates) are ``benchmarks/fairness.py``'s.

    python benchmarks/attacks.py

Prints one JSON object. Needs PostgreSQL at SPOTGPU_TEST_POSTGRES_URL (default: local ``test``).
Every request goes to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import fresh_postgres_schema, start_service  # noqa: E402

POSTGRES = os.environ.get(
    "SPOTGPU_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
NOTICE = 2.0  # a short notice, so a tenant's life out of credit takes seconds


def bid(client, gpus=8, price=1000.0, **more):
    body = {"gpu_model": "A100-80G", "region": "eu-west", "gpu_count": gpus, "max_price": price}
    return client.post("/bids", json={**body, **more})


def key_of(client) -> str:
    return client.headers["Authorization"].split()[1]


def parallel(svc, key: str, n: int, **fields) -> list:
    clients = [svc.client(key) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda c: bid(c, **fields), clients))


def codes(responses) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in responses:
        out[str(r.status_code)] = out.get(str(r.status_code), 0) + 1
    return out


def overspend(svc) -> dict:
    owner = svc.tenant()
    for _ in range(5):
        svc.node(owner, gpus=8, reserve=999)
    poor = svc.tenant(credit=0.01)
    refused = parallel(svc, key_of(poor), 40)
    time.sleep(1.0)
    two = svc.tenant(credit=15.0)  # one such bid reserves 6.67 (3 s of 8 x 1000/h)
    answers = parallel(svc, key_of(two), 40)
    lowest, started = two.get("/me").json()["balance"], time.monotonic()
    while time.monotonic() - started < 10:
        lowest = min(lowest, two.get("/me").json()["balance"])
        time.sleep(0.1)
    bids = two.get("/bids").json()
    return {
        "credit_0.01": {
            "codes": codes(refused),
            "balance_after": poor.get("/me").json()["balance"],
            "detail": refused[0].json()["detail"],
        },
        "credit_for_two": {
            "codes": codes(answers),
            "lowest_balance_seen": lowest,
            "one_ticks_charges": round(2 * 8 * 1000 * 0.1 / 3600, 6),
            "bids": sorted({b["status"]: b.get("hold_reason") or "" for b in bids}.items()),
            "notices": sorted(
                {
                    e["payload"].get("reason")
                    for e in two.get("/events", params={"timeout": 0}).json()["events"]
                    if e["kind"] == "noticed"
                }
            ),
        },
    }


def silent_reclaimed_node(svc) -> dict:
    owner, buyer = svc.tenant(), svc.tenant()
    node, agent = svc.node(owner, gpus=8, reserve=0.9)
    alive = threading.Event()
    alive.set()

    def heartbeats():
        while alive.is_set():
            agent.post(f"/nodes/{node['id']}/heartbeat", json={})
            time.sleep(0.3)

    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    b = bid(buyer, price=1.2).json()
    svc.wait_for(lambda: buyer.get(f"/bids/{b['id']}/allocations").json(), 10)
    (alloc,) = buyer.get(f"/bids/{b['id']}/allocations").json()
    svc.wait_for(lambda: buyer.get(f"/allocations/{alloc['id']}").json()["status"] == "running")
    owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
    svc.wait_for(lambda: buyer.get(f"/allocations/{alloc['id']}").json()["status"] == "noticed")
    alive.clear()
    beating.join()
    silent = time.time()
    ended = svc.wait_for(
        lambda: (
            (a := buyer.get(f"/allocations/{alloc['id']}").json())["status"] == "preempted" and a
        ),
        30,
    )
    comp = [e for e in buyer.get("/ledger").json()["entries"] if e["kind"] == "compensation"]
    (charge,) = [
        c for c in buyer.get("/ledger").json()["charges"] if c["allocation_id"] == alloc["id"]
    ]
    agent.post(f"/nodes/{node['id']}/heartbeat", json={})
    back = svc.wait_for(
        lambda: (n := owner.get(f"/nodes/{node['id']}").json())["state"] != "lost" and n, 10
    )
    return {
        "heartbeat_timeout_s": 1.5,
        "notice_deadline_s": 300,
        "ended_after_silence_s": round(ended["ended_at"] - silent, 2),
        "end_reason": ended["end_reason"],
        "charged": charge["charged_amount"],
        "compensated": comp[0]["amount"] if comp else 0,
        "state_when_the_agent_returns": back["state"],
    }


def loose_numbers(svc) -> dict:
    alice = svc.tenant()
    out = {}
    for field, value in (
        ("max_price", True),
        ("max_price", "1"),
        ("gpu_count", True),
        ("gpu_count", "2"),
    ):
        r = bid(alice, gpus=1, price=1.0, **{field: value})
        out[f"{field}={json.dumps(value)}"] = [r.status_code, r.json()["detail"][0]["loc"][-1]]
    big = alice.post("/bids", content=b"{" + b" " * (2 * 1024 * 1024) + b"}")
    out["2MB body"] = [
        big.status_code,
        "content-security-policy" in big.headers,
        big.headers.get("x-content-type-options"),
    ]
    return out


def open_bids(svc) -> dict:
    mallory = svc.tenant(credit=1000)
    answers = [bid(mallory, gpus=1, price=1.0) for _ in range(110)]
    return {"cap": 100, "codes": codes(answers), "detail": answers[-1].json()["detail"]}


def run(kind: str) -> dict:
    """Each attack on a market of its own, of this kind of database."""
    home = Path(tempfile.mkdtemp())
    attacks = (
        ("overspend", overspend, {"heartbeat_timeout_seconds": 3600}),  # declared nodes
        ("silent_reclaimed_node", silent_reclaimed_node, {"heartbeat_timeout_seconds": 1.5}),
        ("loose_numbers", loose_numbers, {}),
        ("open_bids", open_bids, {"max_open_bids_per_tenant": 100}),
    )
    out = {}
    for name, attack, overrides in attacks:
        if kind == "sqlite":
            url, drop = f"sqlite:///{home / (name + '.db')}", (lambda: None)
        else:
            url, drop = fresh_postgres_schema(POSTGRES)
        svc = start_service(url, home / name, notice_seconds=NOTICE, **overrides)
        try:
            out[name] = attack(svc)
        finally:
            svc.stop()
            drop()
    return out


def main() -> None:
    started = time.monotonic()
    result = {kind: run(kind) for kind in ("sqlite", "postgresql")}
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
