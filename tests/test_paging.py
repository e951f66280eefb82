"""Lists come newest first, a page at a time, with the next page's URL in the Link header
(``/bids``, ``/allocations``, ``/ledger``), on real SQLite and PostgreSQL; the CLI follows it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import one_database
from prefect_spotgpu.cli.market_cmds import PAGE_SIZE


def post_bid(client, **fields) -> dict:
    body = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 0.2, "region": "eu-west"}
    response = client.post("/bids", json={**body, **fields})
    assert response.status_code == 201, response.text
    return response.json()


def follow(client, path: str, params: dict) -> list[list[dict]]:
    """Every page of a list, by its Link headers, as a client would."""
    pages, response = [], client.get(path, params=params)
    while True:
        assert response.status_code == 200, response.text
        pages.append(response.json())
        following = response.links.get("next", {}).get("url")
        if following is None:
            return pages
        response = client.get(following)


def test_bids_come_newest_first_and_every_bid_once_across_pages(service):
    alice, bob = service.tenant(), service.tenant()
    mine = []
    for i in range(7):
        mine.append(post_bid(alice, labels={"n": str(i)})["id"])
        post_bid(bob)  # interleaved: another tenant's ids between alice's
    alice.post(f"/bids/{mine[2]}/cancel")
    pages = follow(alice, "/bids", {"limit": 3})
    assert [len(p) for p in pages] == [3, 3, 1]
    seen = [b["id"] for page in pages for b in page]
    assert seen == sorted(mine, reverse=True)  # newest first, each once, only hers
    open_pages = follow(alice, "/bids", {"limit": 2, "status": "open"})
    assert [b["id"] for p in open_pages for b in p] == [i for i in reversed(mine) if i != mine[2]]
    # the filter travels with the cursor
    response = alice.get("/bids", params={"limit": 2, "status": "open"})
    assert "status=open" in response.links["next"]["url"]
    # a page that is not full is the last: no Link
    assert "link" not in alice.get("/bids", params={"limit": 100}).headers
    assert alice.get("/bids", params={"before": 0}).json() == []
    assert alice.get("/bids", params={"before": mine[1]}).json()[0]["id"] == mine[0]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"before": -1}, "before"),
        ({"before": "x"}, "before"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"before": 2**63}, "before"),
    ],
)
@one_database("validation and headers are decided before any query")
def test_bad_cursors_are_422_naming_the_parameter(service, params, field):
    alice = service.tenant()
    for path in ("/bids", "/allocations", "/ledger"):
        response = alice.get(path, params=params)
        assert response.status_code == 422, (path, response.text)
        assert field in response.text


def test_allocations_and_the_ledger_page_newest_first(service):
    alice, owner = service.tenant(), service.tenant()
    service.node(owner, reserve=0.1, gpus=8)
    bids = [post_bid(alice)["id"] for _ in range(5)]
    service.wait_for(lambda: len(alice.get("/allocations").json()) == 5)
    for i in range(6):
        response = service.admin.post(
            f"/tenants/{alice.tenant_id}/credits", json={"amount": 0.5, "reason": f"top-up {i}"}
        )
        assert response.status_code == 201, response.text
    allocs = [a for p in follow(alice, "/allocations", {"limit": 2}) for a in p]
    assert [a["id"] for a in allocs] == sorted((a["id"] for a in allocs), reverse=True)
    assert sorted(a["bid_id"] for a in allocs) == bids and len(allocs) == 5
    active = [a for p in follow(alice, "/allocations", {"limit": 2, "active": True}) for a in p]
    assert len(active) == 5

    first = alice.get("/ledger", params={"limit": 2})
    body = first.json()
    assert [e["reason"] for e in body["entries"]] == ["top-up 5", "top-up 4"]
    assert len(body["charges"]) == 2 and body["charges"][0]["allocation_id"] == allocs[0]["id"]
    assert body["next"] == {
        "before": body["entries"][-1]["id"],
        "charges_before": body["charges"][-1]["allocation_id"],
    }
    pages = follow(alice, "/ledger", {"limit": 2})
    entries = [e for p in pages for e in p["entries"]]
    charges = [c for p in pages for c in p["charges"]]
    assert [e["kind"] for e in entries] == ["credit"] * 6 + ["starting_credit"]
    assert [c["allocation_id"] for c in charges] == [a["id"] for a in allocs]
    assert pages[-1]["next"] == {"before": None, "charges_before": None}
    # one list may end before the other: it is asked again with cursor 0 and stays empty
    assert pages[-1]["entries"] and not pages[-1]["charges"]


@one_database("the CLI's rendering of the API's replies")
def test_the_cli_shows_the_newest_bids_across_pages(service):
    alice = service.tenant()
    ids = [post_bid(alice)["id"] for _ in range(PAGE_SIZE + 5)]
    key = alice.headers["Authorization"].removeprefix("Bearer ")
    env = {**os.environ, "SPOTGPU_API_KEY": key, "SPOTGPU_MARKET_URL": service.base_url}
    env["COLUMNS"] = "200"
    shown = subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", "bids", "--limit", str(PAGE_SIZE + 3)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    rows = [line.split()[1] for line in shown.stdout.splitlines() if line.startswith("│")]
    # the newest PAGE_SIZE + 3 (two pages), oldest of them first
    assert rows == [str(i) for i in ids[-(PAGE_SIZE + 3) :]]
