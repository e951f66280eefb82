"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright), served
by the real market service on a loopback port over a real SQLite database.

Chromium missing is a failure with the command that installs it, never a skip.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from conftest import start_service, wait_for
from prefect_spotgpu.service import hardening
from prefect_spotgpu.service.models import NodeRow, PriceBar, Tenant

CHROMIUM = os.environ.get("SPOTGPU_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HISTORY_MINUTES = 7 * 24 * 60  # stored bars: a week, one per minute
NONE_SHOWN = "\N{EN DASH}"  # what the page shows for a missing value
GANG_MODEL, GANG_REGION, GANG_NODES = "RTX-4090", "ap-south", 3  # a pool of small nodes
GANG_RESERVE = 0.3
TIMES = "\N{MULTIPLICATION SIGN}"
ALL_GPUS = 4 * 4 + 2 * GANG_NODES
SHOTS = os.environ.get("SPOTGPU_SCREENSHOTS")  # a directory: keep the screenshots there (docs/)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def market(tmp_path_factory):
    """A market with three spot pools (one of three small nodes, for gangs), an on-demand
    pool, telemetry, bids and stored history."""
    home = tmp_path_factory.mktemp("dashboard")
    db_url = f"sqlite:///{home / 'market.db'}"
    service = start_service(db_url, home / "home")
    owner, alice, bob = service.tenant("owner"), service.tenant("alice"), service.tenant("bob")
    agents = []
    for name, model, region, count, reserve, capacity in (
        ("a1", "A100-80G", "eu-west", 4, 0.9, "spot"),
        ("a2", "A100-80G", "eu-west", 4, 0.9, "spot"),
        ("u1", "A100-80G", "us-east", 4, 0.9, "spot"),
        ("od", "A100-80G", "eu-west", 4, 0.9, "on_demand"),
        *((f"g{i}", GANG_MODEL, GANG_REGION, 2, GANG_RESERVE, "spot") for i in range(GANG_NODES)),
    ):
        node, agent = service.node(
            owner, model, region, count, reserve, name=name, capacity=capacity
        )
        agents.append((node, agent))
        gpus = [
            {"index": i, "utilization": 30 + 15 * i, "memory_used_mb": 9000} for i in range(count)
        ]
        beat = agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": {"gpus": gpus}})
        assert beat.status_code == 200, beat.text
    stop = threading.Event()

    def heartbeats():  # live agents: the nodes stay live, their telemetry moves
        beat = 0
        while not stop.wait(2.0):
            beat += 1
            for node, agent in agents:
                gpus = [
                    {
                        "index": i,
                        "utilization": (30 + 15 * i + 7 * beat) % 100,
                        "memory_used_mb": 9000,
                    }
                    for i in range(node["gpu_count"])
                ]
                agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": {"gpus": gpus}})

    bids = {}
    for who, client, price in (("alice", alice, 1.3), ("bob", bob, 1.1)):
        body = {"gpu_model": "A100-80G", "gpu_count": 4, "max_price": price, "region": "eu-west"}
        response = client.post("/bids", json=body)
        assert response.status_code == 201, response.text
        bids[who] = response.json()
    engine = sa.create_engine(db_url)
    now_minute = int(time.time() // 60)
    with engine.begin() as connection:
        connection.execute(
            sa.insert(PriceBar),
            [
                {"gpu_model": "A100-80G", "region": "us-east", "minute": m, **_bar(m)}
                for m in range(now_minute - HISTORY_MINUTES - 5, now_minute - 5)
            ],
        )
    engine.dispose()
    service.owner, service.alice, service.bob, service.bids = owner, alice, bob, bids
    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    yield service
    stop.set()
    beating.join(timeout=10)
    service.stop()


def _bar(minute: int) -> dict:
    """A daily cycle: the reserve (0.90) at night, up to 1.50 in the afternoon (UTC), jittered."""
    hour = (minute / 60) % 24
    day = max(0.0, math.sin(math.pi * (hour - 8) / 12)) if 8 <= hour < 20 else 0.0
    price = round(0.9 + 0.6 * day + 0.03 * math.sin(minute / 7.0) * day, 4)
    return {"open": price, "high": price, "low": price, "close": price}


NETWORK_CHANGED = "net::ERR_NETWORK_CHANGED"
"""What Chromium fails a request with when this host's interfaces change under it: the other
test worker's namespaces, veth pairs and Docker bridges come and go. Not the page's doing (the
dashboard reads again at its next refresh, which the tests wait for); every other console
error and failed request is."""


def console_error(message) -> str | None:
    """A console message the tests count as a problem: an error, unless ``NETWORK_CHANGED``."""
    if message.type != "error" or NETWORK_CHANGED in message.text:
        return None
    return message.text


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y chromium) "
            "or set SPOTGPU_CHROMIUM",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, market):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.problems = []
    page.on(
        "console",
        lambda m: page.problems.append(f"console error: {m.text}") if console_error(m) else None,
    )
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.on(
        "requestfailed",
        lambda r: (
            page.problems.append(f"failed {r.url}")
            if "/api/v1/stream" not in r.url and r.failure != NETWORK_CHANGED
            else None
        ),
    )
    page.on(
        "request",
        lambda r: (
            page.problems.append(f"off-host {r.url}")
            if not r.url.startswith((market.base_url, "data:"))
            else None
        ),
    )
    yield page
    context.close()


def shot(page, tmp_path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(SHOTS) / name)


def until(page, expression: str, timeout: float = 30.0) -> None:
    """Wait until ``expression`` is truthy in the page. Not ``page.wait_for_function``: that
    evaluates its string with ``eval``, which the page's Content-Security-Policy refuses;
    ``page.evaluate`` goes through the DevTools protocol, outside the page's policy."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"never true: {expression}"
        time.sleep(0.1)


def sign_in(page, client) -> None:
    page.fill("#key", client.headers["Authorization"].removeprefix("Bearer "))
    page.click("#signin-button")
    page.wait_for_selector("#tenant-card:not([hidden])")


def test_the_page_loads_live_with_no_console_errors(page, market, tmp_path):
    page.goto(market.base_url + "/")
    page.wait_for_selector("#live.on")
    page.wait_for_selector("#pools tbody tr.pool >> nth=2")
    rows = page.locator("#pools tbody tr.pool").all_inner_texts()
    assert any("us-east" in r and "spot" in r for r in rows), rows
    assert any("on-demand" in r and "2.10" in r for r in rows), rows
    page.wait_for_selector("#nodes .node >> nth=3")
    assert page.locator("#nodes .gpu .fill").count() == ALL_GPUS  # each one's utilisation
    page.wait_for_selector("#depth .depth-row")
    book = market.client().get("/market/depth/A100-80G/eu-west").json()["levels"]
    shown = page.locator("#depth .depth-row").all_inner_texts()
    assert [r.split()[0] for r in shown] == [f"{lv['price']:.2f}" for lv in book]
    assert {1.3, 1.1} <= {lv["price"] for lv in book}
    page.click("#pools tbody tr.pool:has-text('us-east')")
    until(page, "document.querySelector('#price-line')?.dataset.points > 1000")
    seen = page.evaluate("Number(document.querySelector('#live').dataset.refreshes || 0)")
    until(page, f"Number(document.querySelector('#live').dataset.refreshes) >= {seen + 3}")
    shot(page, tmp_path, "dashboard.png")
    assert page.problems == []


def test_the_chart_draws_the_stored_history_with_the_cheap_window_and_forecast(page, market):
    page.goto(market.base_url + "/dashboard")
    page.wait_for_selector("#pools tbody tr.pool")
    page.click("#pools tbody tr.pool:has-text('us-east')")
    until(page, "document.querySelector('#price-line')?.dataset.points > 1000")
    stored = market.client().get("/prices/A100-80G/us-east/history", params={"hours": 24}).json()
    assert len(stored) >= 24 * 60 - 10  # ours, and the live market's minutes since
    drawn = int(page.get_attribute("#price-line", "data-points"))
    assert drawn in (len(stored), len(stored) + 1), (drawn, len(stored))
    assert page.locator("#chart polygon.forecast-band").count() == 1
    # the chart covers 30 h: some of it is always in the cheap window (every night)
    assert page.locator("#chart rect.night").count() >= 1
    page.click(".tab[data-range='168']")
    hours = {
        b["minute"][:13]
        for b in market.client()
        .get("/prices/A100-80G/us-east/history", params={"hours": 168})
        .json()
    }
    until(  # hourly closes over 7 days
        page, f"Math.abs(document.querySelector('#price-line')?.dataset.points - {len(hours)}) <= 1"
    )
    assert page.problems == []


def test_a_bid_created_through_the_api_appears_without_reload(page, market):
    page.goto(market.base_url + "/dashboard")
    sign_in(page, market.alice)
    page.wait_for_selector(f"tr[data-bid='{market.bids['alice']['id']}']")
    new = market.alice.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 2, "max_price": 0.95}
    ).json()
    row = page.wait_for_selector(f"tr[data-bid='{new['id']}']", timeout=10_000)
    assert "open" in row.inner_text() and "0.95" in row.inner_text()
    assert "alice" in page.inner_text("#who")
    assert page.problems == []


def test_the_images_section_lists_the_catalogue_and_a_new_image(page, market):
    page.goto(market.base_url + "/dashboard")
    page.wait_for_selector("#images tbody tr.image")
    catalogue = market.client().get("/images").json()
    assert len(catalogue) >= 6  # the seeded catalogue
    rows = page.locator("#images tbody tr.image")
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.image)") == [
        i["name"] for i in catalogue
    ]
    for row, image in enumerate(catalogue):
        cells = rows.nth(row).locator("td").all_inner_texts()
        cuda = image["cuda_version"] or NONE_SHOWN
        runs = "flows" if image["runs_flows"] else "a command"  # the seeded bases: a command
        assert cells == [
            image["name"], runs, image["framework"], cuda, image["reference"],
            image["description"],
        ]  # fmt: skip
    assert page.locator("#images-empty").is_hidden()
    added = market.admin.post(
        "/images",
        json={"name": "lab-jax", "reference": "ghcr.io/lab/jax:0.4.35", "framework": "JAX 0.4.35",
              "cuda_version": "12.6", "description": "The lab's JAX image."},
    )  # fmt: skip
    assert added.status_code == 201, added.text
    row = page.wait_for_selector("#images tr[data-image='lab-jax']", timeout=30_000)
    assert "JAX 0.4.35" in row.inner_text() and "ghcr.io/lab/jax:0.4.35" in row.inner_text()
    assert page.problems == []


def test_a_tenant_sees_only_its_own_bids_and_allocations(page, market, tmp_path):
    page.goto(market.base_url + "/dashboard")
    sign_in(page, market.bob)
    page.wait_for_selector(f"tr[data-bid='{market.bids['bob']['id']}']")
    wait_for(lambda: page.locator("#allocations tbody tr").count() >= 0, 5)
    shown = set(page.locator("#bids tr.bid").evaluate_all("rows => rows.map(r => r.dataset.bid)"))
    mine = {str(b["id"]) for b in market.bob.get("/bids").json()}
    assert shown == mine and str(market.bids["alice"]["id"]) not in shown
    bob_allocations = {str(a["id"]) for a in market.bob.get("/allocations").json()}
    listed = page.locator("#allocations [data-allocation]").evaluate_all(
        "rows => rows.map(r => r.dataset.allocation)"
    )
    assert set(listed) == bob_allocations
    shot(page, tmp_path, "dashboard-tenant.png")
    page.click("#signout")
    assert page.locator("#tenant-card").is_hidden()
    assert page.problems == []


def test_a_long_list_shows_its_newest_page_and_the_rest_on_show_older(page, market):
    carol = market.tenant("carol")
    body = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 0.2, "region": "eu-west"}
    ids = [carol.post("/bids", json=body).json()["id"] for _ in range(103)]
    page.goto(market.base_url + "/dashboard")
    sign_in(page, carol)
    page.wait_for_selector(f"tr[data-bid='{ids[-1]}']")
    listed = page.locator("#bids tr.bid").evaluate_all("rows => rows.map(r => r.dataset.bid)")
    assert listed == [str(i) for i in reversed(ids[3:])]  # the newest page, newest first
    assert page.locator("#bids-older").is_visible()
    page.click("#bids-older")
    page.wait_for_selector(f"tr[data-bid='{ids[0]}']")
    listed = page.locator("#bids tr.bid").evaluate_all("rows => rows.map(r => r.dataset.bid)")
    assert listed == [str(i) for i in reversed(ids)]
    until(page, "document.querySelector('#bids-older').hidden")
    assert page.locator("#allocations-older").is_hidden()
    assert page.problems == []


def _bid_entries(page) -> list[str]:
    return page.locator("#bids tr.bid").evaluate_all("rows => rows.map(r => r.dataset.bid)")


def _members(page, gang: int) -> list[dict]:
    """The members shown beneath a gang's bid: bid id, rank and text, in the page's order."""
    return page.locator(f"#bids tr.members[data-members-of='{gang}'] li.member").evaluate_all(
        "items => items.map(li => ({id: li.dataset.member, rank: li.dataset.rank,"
        " text: li.innerText, status: li.querySelector('.status').innerText}))"
    )


def test_a_gang_shows_as_one_bid_with_its_members_and_only_to_its_tenant(page, market):
    gina = market.tenant("gina")
    body = {"gpu_model": GANG_MODEL, "region": GANG_REGION, "gpu_count": 2, "max_price": 0.5,
            "node_count": GANG_NODES, "labels": {"job": "pretrain"}}  # fmt: skip
    created = gina.post("/bids", json=body)
    assert created.status_code == 201, created.text
    gang = created.json()
    gang_id, members = gang["id"], gang["members"]
    assert gang["gang_id"] == gang_id == members[0] and len(members) == GANG_NODES
    wait_for(lambda: len(gina.get(f"/bids/{gang_id}/allocations").json()) == GANG_NODES, 10)
    placed = {a["rank"]: a for a in gina.get(f"/bids/{gang_id}/allocations").json()}
    assert sorted(placed) == list(range(GANG_NODES))
    assert len({a["node_id"] for a in placed.values()}) == GANG_NODES  # a node each
    page.goto(market.base_url + "/dashboard")
    sign_in(page, gina)
    entry = page.wait_for_selector(f"tr.bid.gang[data-bid='{gang_id}']")
    assert _bid_entries(page) == [str(gang_id)]  # one entry, no row per member
    text = entry.inner_text()
    assert "gang of 3" in text and "job=pretrain" in text
    assert f"3 {TIMES} 2 {TIMES} {GANG_MODEL}" in text  # node_count x gpu_count
    until(page, "document.querySelectorAll('#bids li.member [data-allocation]').length === 3")
    shown = _members(page, gang_id)
    assert [(m["id"], m["rank"]) for m in shown] == [
        (str(b), str(rank)) for rank, b in enumerate(members)
    ]
    for rank, member in enumerate(shown):
        alloc = placed[rank]
        assert member["status"] == gina.get(f"/bids/{members[rank]}").json()["status"]
        assert f"rank {rank}" in member["text"] and f"bid {members[rank]}" in member["text"]
        assert f"node {alloc['node_id']} · allocation {alloc['id']} running" in member["text"]
    # the allocations: one entry for the gang, every member's allocation beneath it
    folded = page.locator(f"#allocations tr.gang[data-gang='{gang_id}']")
    assert folded.count() == 1 and "gang of 3" in folded.inner_text()
    assert page.locator("#allocations tbody tr[data-allocation]").count() == 0
    beneath = page.locator(f"#allocations tr[data-members-of='{gang_id}'] li").evaluate_all(
        "items => items.map(li => [li.dataset.allocation, li.dataset.rank])"
    )
    assert sorted(beneath) == sorted([str(a["id"]), str(r)] for r, a in placed.items())
    # another tenant sees none of it
    page.click("#signout")
    sign_in(page, market.bob)
    page.wait_for_selector(f"tr[data-bid='{market.bids['bob']['id']}']")
    assert set(_bid_entries(page)) == {str(b["id"]) for b in market.bob.get("/bids").json()}
    tenant = page.locator("#tenant-card")
    assert tenant.locator("tr.members, li.member, [data-gang]").count() == 0
    ids = {str(i) for i in members} | {str(a["id"]) for a in placed.values()}
    found = tenant.locator("[data-bid], [data-allocation], [data-member]").evaluate_all(
        "els => els.map(e => e.dataset.bid || e.dataset.allocation || e.dataset.member)"
    )
    assert ids.isdisjoint(found) and "gang of" not in tenant.inner_text()
    assert page.problems == []


def test_a_gang_cut_by_the_page_end_shows_once_and_whole(page, market):
    hana = market.tenant("hana")
    waits = {"gpu_model": GANG_MODEL, "region": GANG_REGION, "gpu_count": 1,
             "max_price": GANG_RESERVE - 0.1, "node_count": GANG_NODES}  # fmt: skip
    gang = hana.post("/bids", json=waits).json()
    single = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 0.2, "region": "eu-west"}
    ids = [hana.post("/bids", json=single).json()["id"] for _ in range(100 - GANG_NODES + 1)]
    # the newest page of 100 bids: these, and ranks 2 and 1 of the gang; rank 0 is older
    newest = hana.get("/bids", params={"limit": 100}).json()
    assert [b["id"] for b in newest[-2:]] == gang["members"][:0:-1]
    page.goto(market.base_url + "/dashboard")
    sign_in(page, hana)
    page.wait_for_selector(f"tr.bid.gang[data-bid='{gang['id']}']")
    assert _bid_entries(page) == [str(i) for i in reversed(ids)] + [str(gang["id"])]
    shown = _members(page, gang["id"])
    assert [(m["id"], m["rank"], m["status"]) for m in shown] == [
        (str(b), str(rank), "open") for rank, b in enumerate(gang["members"])
    ]
    assert all("no allocation" in m["text"] for m in shown)
    until(page, "document.querySelector('#bids-older').hidden")  # nothing older: all read
    assert page.problems == []


def test_the_page_fits_a_phone(browser, market, tmp_path):
    context = browser.new_context(
        viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True
    )
    page = context.new_page()
    page.goto(market.base_url + "/dashboard")
    page.wait_for_selector("#live.on")
    page.click("#pools tbody tr.pool:has-text('us-east')")
    until(page, "document.querySelector('#price-line')?.dataset.points > 1000")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page is {width} px wide on a 390 px screen"
    shot(page, tmp_path, "dashboard-phone.png")
    context.close()


def test_the_stream_sends_every_pools_quote_and_the_views_are_anonymous(market):
    import json

    import httpx

    response = httpx.get(market.base_url + "/api/v1/stream", params={"once": True}, timeout=10)
    assert response.headers["content-type"].startswith("text/event-stream")
    event, data = response.text.strip().split("\n", 1)
    assert event == "event: market"
    body = json.loads(data.removeprefix("data: "))
    prices = market.client().get("/prices").json()
    pools = {(p["gpu_model"], p["region"], p["capacity"]): p for p in body["pools"]}
    for q in prices:
        streamed = pools[(q["gpu_model"], q["region"], q["capacity"])]
        assert streamed["on_demand_price"] == q["on_demand_price"]
        assert streamed["gpus_total"] == q["gpus_total"]
    nodes = market.client().get("/market/nodes").json()
    assert len(nodes) == 4 + GANG_NODES
    private = ("owner_id", "name", "address", "inventory", "telemetry")  # the owner's to see
    assert not any(key in n for n in nodes for key in private)
    wait_for(  # the same GPUs in use, seen per node and per pool
        lambda: (
            sum(n["gpus_busy"] for n in market.client().get("/market/nodes").json())
            == sum(q["gpus_running"] for q in market.client().get("/prices").json())
        ),
        10,
    )
    bad = market.client().get("/market/depth/B200/eu-west")
    assert bad.status_code == 422 and "gpu_model" in bad.text


def test_a_new_bid_wakes_the_stream_within_a_tick(market):
    """A waiting bid makes no event, but it changes its pool's quote: the leader's next tick
    counts that (``market_version``), and the stream speaks at once instead of waiting for
    its 2 s heartbeat. Unknown page files are 404s."""
    notifier = market.app.state.notifier
    before = notifier.market_version
    response = market.bob.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 4, "max_price": 0.5}
    )
    assert response.status_code == 201, response.text
    wait_for(lambda: notifier.market_version > before, 5, "the quote's change")
    import httpx

    assert httpx.get(market.base_url + "/dashboard/nothere.js").status_code == 404


# ---------------------------------------------------------------- hostile data

HOSTILE = (
    '<img src=x onerror="window.__pwned=1">',
    '"><script>window.__pwned=1</script>',
    "javascript:window.__pwned=1",
    "</td></tr><svg onload=window.__pwned=1></svg>",
)
HOSTILE_DESCRIPTION = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A market where every free-text field a tenant, a provider or the operator controls
    holds markup, and a node's stored telemetry predates the schema (written to the database
    directly). Fields restricted by a pattern (tenant and node names, regions, models, GPU
    names) refuse markup with a 422 that names them."""
    home = tmp_path_factory.mktemp("hostile")
    db_url = f"sqlite:///{home / 'market.db'}"
    service = start_service(db_url, home / "home")
    admin = service.admin
    for text in HOSTILE:
        refused = admin.post("/tenants", json={"name": text})
        assert refused.status_code == 422 and "name" in refused.text, refused.text
    image = {"name": "evil-desc", "reference": "ghcr.io/lab/job:1", "framework": "F"}
    for field, text in (
        ("name", HOSTILE[0]),
        ("reference", HOSTILE[1]),
        ("cuda_version", HOSTILE[2]),
        ("description", "one\nline<script>"),
    ):
        refused = admin.post("/images", json={**image, field: text})
        assert refused.status_code == 422 and field in refused.text, refused.text
    image.update(framework=HOSTILE[3], description=HOSTILE_DESCRIPTION)
    added = admin.post("/images", json=image)  # the operator is trusted; shown as text anyway
    assert added.status_code == 201, added.text
    owner, mallory = service.tenant("owner"), service.tenant("mallory")
    service.grant_provider(owner)
    body = {"gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 4, "reserve_price": 0.9}
    for field, text in (("name", HOSTILE[0]), ("region", HOSTILE[1]), ("gpu_model", HOSTILE[2])):
        refused = owner.post("/nodes", json={"name": "n", **body, field: text})
        assert refused.status_code == 422 and field in refused.text, refused.text
    inventory = [  # the strings the inventory schema does allow: no markup, but a scheme
        {"index": i, "model": "A100-80G", "name": "javascript:void(0)",
         "uuid": "javascript:alert(1)", "memory_mb": 81920, "driver": "(1)+/-"}
        for i in range(4)
    ]  # fmt: skip
    nodes = []
    for name in ("rack-1", "rack-2"):
        node, agent = service.node(owner, gpus=4, name=name)
        beat = agent.post(
            f"/nodes/{node['id']}/heartbeat",
            json={"telemetry": {"jobs": 0, "gpus": [{"index": 0, "utilization": 20}]}},
        )
        assert beat.status_code == 200, beat.text
        nodes.append(node)
    listed = owner.post("/nodes", json={"name": "rack-3", **body, "inventory": inventory})
    assert listed.status_code == 201, listed.text
    engine = sa.create_engine(db_url)
    legacy = {
        "gpus": [
            {"index": 0, "utilization": '100%"><img src=x onerror="window.__pwned=1">'},
            {"index": 1, "utilization": "50%;background:url(javascript:1)"},
            {"index": 2, "utilization": 1e9, "memory_used_mb": HOSTILE[1]},
            {"index": 3, "utilization": 55, "power_w": 300},
        ]
    }
    with engine.begin() as connection:
        connection.execute(
            sa.update(NodeRow).where(NodeRow.id == nodes[1]["id"]).values(telemetry=legacy)
        )
        # and names from before their patterns: markup where the API now refuses it
        connection.execute(
            sa.update(NodeRow)
            .where(NodeRow.id == nodes[0]["id"])
            .values(name=HOSTILE[0], region=HOSTILE[1])
        )
        connection.execute(
            sa.update(Tenant).where(Tenant.id == mallory.tenant_id).values(name=HOSTILE[3])
        )
    engine.dispose()
    credit = admin.post(
        f"/tenants/{mallory.tenant_id}/credits", json={"amount": 5, "reason": HOSTILE[3]}
    )
    assert credit.status_code == 201, credit.text
    bids = []
    refused = mallory.post(  # label keys are plain names (a pattern); values are any text
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0,
                       "labels": {HOSTILE[0]: "x"}},
    )  # fmt: skip
    assert refused.status_code == 422, refused.text
    for i, text in enumerate(HOSTILE):
        labels = {f"k{i}": text, "team": HOSTILE[i - 1]}
        bid = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 0.5 + i / 10,
               "idempotency_key": text, "labels": labels}  # fmt: skip
        response = mallory.post("/bids", json=bid)
        assert response.status_code == 201, response.text
        bids.append(response.json())
    gang = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 0.55, "node_count": 2,
            "idempotency_key": f"gang {HOSTILE[0]}",
            "labels": {"gang": HOSTILE[1], "team": HOSTILE[3]}}  # fmt: skip
    response = mallory.post("/bids", json=gang)
    assert response.status_code == 201, response.text
    bids.append(response.json())  # rank 0's bid: the gang's entry
    service.gang = response.json()
    service.mallory, service.hostile_bids, service.legacy_node = mallory, bids, nodes[1]
    service.named_node = nodes[0]
    yield service
    service.stop()


def test_hostile_strings_render_as_text_and_nothing_runs(browser, hostile, tmp_path):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text) if console_error(m) else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    response = page.goto(hostile.base_url + "/dashboard")
    assert response.headers["content-security-policy"] == hardening.CSP
    page.wait_for_selector("#live.on")
    page.wait_for_selector("#pools tbody tr.pool")
    page.wait_for_selector("#nodes .node >> nth=2")
    sign_in(page, hostile.mallory)
    for bid in hostile.hostile_bids:
        page.wait_for_selector(f"tr[data-bid='{bid['id']}']")
    until(page, "document.querySelectorAll('#ledger li').length >= 1")
    evil = page.wait_for_selector("#images tr[data-image='evil-desc']")
    seen = page.evaluate("Number(document.querySelector('#live').dataset.refreshes || 0)")
    until(page, f"Number(document.querySelector('#live').dataset.refreshes) >= {seen + 3}")
    assert page.evaluate("typeof window.__pwned") == "undefined"
    # the markup stayed text: no element came from it, and no link either
    made = ("img", "script", "iframe", "object", "embed", "a", "svg:not(#chart)", "[onerror]")
    assert page.locator(", ".join(f"main {tag}" for tag in made)).count() == 0
    for bid in hostile.hostile_bids:
        row = page.locator(f"tr[data-bid='{bid['id']}']")
        assert row.locator(".key").inner_text() == bid["idempotency_key"]
        chips = row.locator(".chip").all_inner_texts()
        assert sorted(chips) == sorted(f"{k}={v}" for k, v in bid["labels"].items())
    gang = hostile.gang
    members = page.locator(f"tr[data-members-of='{gang['id']}'] li.member")
    assert members.evaluate_all("items => items.map(li => li.dataset.member)") == [
        str(i) for i in gang["members"]
    ]
    assert page.locator("tr.bid").count() == len(hostile.hostile_bids)  # the gang's is one
    cells = [cell.inner_text() for cell in evil.query_selector_all("td")]
    assert cells == [
        "evil-desc",
        "a command",
        HOSTILE[3],
        NONE_SHOWN,
        "ghcr.io/lab/job:1",
        HOSTILE_DESCRIPTION,
    ]  # (an image added without --runs-flows: command-only)
    assert evil.eval_on_selector("td.wrap", "td => td.childElementCount") == 0
    assert HOSTILE[3] in page.inner_text("#ledger")
    assert page.inner_text("#who") == f"Signed in as {HOSTILE[3]}"
    named = page.locator(f"#nodes .node[data-node='{hostile.named_node['id']}']").inner_text()
    assert HOSTILE[1] in named and HOSTILE[0] not in named, named  # (names are not public)
    assert page.locator("#nodes .gpu").count() == 12
    # the legacy node: only its one valid reading is drawn, its height set through the CSSOM
    legacy = page.locator(f"#nodes .node[data-node='{hostile.legacy_node['id']}']")
    assert legacy.locator(".fill").count() == 1
    assert legacy.locator(".gpu >> nth=3").locator(".fill").evaluate("e => e.style.height") == (
        "55%"
    )
    shot(page, tmp_path, "dashboard-hostile.png")
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert problems == []
    context.close()


def test_every_response_carries_the_hardening_headers(market):
    import httpx

    expected = {
        "content-security-policy": hardening.CSP,
        "x-content-type-options": "nosniff",
        "x-frame-options": "DENY",
        "referrer-policy": "no-referrer",
    }
    assert "'unsafe-inline'" not in hardening.CSP and "script-src 'self';" in hardening.CSP
    with httpx.Client(base_url=market.base_url, timeout=10) as client:
        for path, status in (
            ("/dashboard", 200),
            ("/dashboard/app.js", 200),
            ("/dashboard/nothere.js", 404),
            ("/api/v1/market/nodes", 200),
            ("/api/v1/market/depth/B200/eu-west", 422),
            ("/api/v1/me", 401),
            ("/api/v1/stream?once=true", 200),
            ("/metrics", 200),
            ("/openapi.json", 200),
        ):
            response = client.get(path)
            assert response.status_code == status, (path, response.text[:200])
            assert {k: response.headers.get(k) for k in expected} == expected, path
        redirect = client.get("/")
        assert redirect.status_code in (302, 307) and redirect.headers["x-frame-options"] == "DENY"
        with client.stream("GET", "/api/v1/stream") as live:  # still streamed, event by event
            assert live.headers["content-security-policy"] == hardening.CSP
            lines = live.iter_lines()
            assert next(lines) == "event: market"


def test_the_api_docs_get_their_own_policy_and_still_start(browser, market):
    """``/docs`` and ``/redoc`` load their viewer from a CDN (stubbed here: the tests have no
    network) and run one inline bootstrap, allowed by its hash; nothing else inline runs."""
    import httpx

    docs = httpx.get(market.base_url + "/docs", timeout=10)
    csp = docs.headers["content-security-policy"]
    assert "'sha256-" in csp and "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
    assert docs.headers["x-frame-options"] == "DENY"
    context = browser.new_context()
    page = context.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text) if console_error(m) else None)
    stubs = {
        "swagger-ui-bundle.js": "window.SwaggerUIBundle = (c) => { window.__docs = c.url; };"
        "SwaggerUIBundle.presets = {apis: {}}; SwaggerUIBundle.SwaggerUIStandalonePreset = {};",
        "redoc.standalone.js": "window.__redoc = document.querySelector('redoc')"
        ".getAttribute('spec-url');",
    }

    def cdn(route):
        name = route.request.url.rsplit("/", 1)[-1].split("?")[0]
        kind = "javascript" if name.endswith(".js") else "css"
        route.fulfill(status=200, content_type=f"text/{kind}", body=stubs.get(name, ""))

    page.route("https://cdn.jsdelivr.net/**", cdn)
    page.route("https://fonts.googleapis.com/**", cdn)
    page.route("https://fastapi.tiangolo.com/**", lambda r: r.fulfill(status=204))
    page.goto(market.base_url + "/docs")
    until(page, "window.__docs === '/openapi.json'", timeout=10)
    page.goto(market.base_url + "/redoc")
    until(page, "window.__redoc === '/openapi.json'", timeout=10)
    assert problems == []
    context.close()


SMOKE_ARGUMENTS = ("--databases", "sqlite", "--seconds", "6", "--block", "3", "--calibrate", "1")
"""The reads benchmark as a smoke check: one database, two blocks of 3 s per arm (1.5 s of each
measured) and 1 s calibration trials."""


def test_the_reads_benchmark_reports_the_tick_with_and_without_readers():
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        # one database: the benchmark's code is the same for both, and each costs ~25 s of CI
        [sys.executable, str(root / "benchmarks" / "reads.py"), "--quick", *SMOKE_ARGUMENTS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    figures = report["sqlite"]
    assert figures["idle"]["ticks"] > 0 and figures["readers"]["ticks"] > 0
    assert figures["readers"]["reads"]["errors"] == 0
    assert figures["readers"]["reads"]["achieved_reads_per_second"] > 10
    check = figures["service_metric_check"]
    assert abs(check["ticks_probed"] - check["ticks_in_histogram"]) <= 1
