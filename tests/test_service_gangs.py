"""Gang bids through the real service over HTTP, on real SQLite and real PostgreSQL
(docs/users/gangs.md): a bid on ``node_count`` nodes is that many member rows, placed whole
on distinct nodes, each node's assignment says where the gang meets (rank 0's node's address), a
notice to one member is a notice to all, any member's id cancels the gang, and a restarted service
rebuilds the gang from the database."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from conftest import one_database, start_service
from test_service_api import wait_event

GANG = {"gpu_model": "A100-80G", "gpu_count": 8, "max_price": 1.2, "region": "eu-west"}


def node(service, owner, address=None, region="eu-west", gpus=8, reserve=0.9, **terms):
    """A registered node (with ``address`` and runner ``terms`` when given) and its agent's
    client."""
    body = {
        "name": f"n{uuid.uuid4().hex[:8]}",
        "gpu_model": "A100-80G",
        "region": region,
        "gpu_count": gpus,
        "reserve_price": reserve,
        **terms,
    }
    if address is not None:
        body["address"] = address
    service.grant_provider(owner)
    response = owner.post("/nodes", json=body)
    assert response.status_code == 201, response.text
    created = response.json()
    return created, service.client(created["token"])


def gang_bid(client, node_count=2, **fields):
    response = client.post("/bids", json={**GANG, "node_count": node_count, **fields})
    assert response.status_code == 201, response.text
    return response.json()


def gang_allocations(client, first, statuses=("running",), count=2):
    """The gang's allocations once ``count`` of them have one of ``statuses``."""

    def ready():
        allocs = client.get(f"/bids/{first}/allocations").json()
        return allocs if sum(a["status"] in statuses for a in allocs) == count else None

    return wait_for(ready)


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def assignment(agent, node_id, status):
    """The one assignment of ``status`` the node's agent sees."""
    found = [a for a in agent.get(f"/nodes/{node_id}/allocations").json() if a["status"] == status]
    assert len(found) == 1, found
    return found[0]


def count_rows(db_url, table):
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as connection:
            return connection.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
    finally:
        engine.dispose()


# ---------------------------------------------------------------- placement and assignments


def test_a_gang_runs_on_distinct_nodes_and_each_node_knows_where_it_meets(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    addresses = {}
    agents = {}
    for address in ("10.0.0.7", "10.0.0.8"):
        created, agent = node(service, owner, address=address)
        assert created["address"] == address
        addresses[created["id"]], agents[created["id"]] = address, agent
    b = gang_bid(alice)
    second = b["members"][1]
    assert (b["node_count"], b["gang_id"], b["members"]) == (2, b["id"], [b["id"], second])
    assert second > b["id"]
    seen = alice.get(f"/bids/{second}").json()  # any member's id reads the gang
    assert (seen["id"], seen["gang_id"], seen["members"]) == (second, b["id"], b["members"])
    allocs = gang_allocations(alice, b["id"])
    assert sorted((a["rank"], a["bid_id"]) for a in allocs) == [(0, b["id"]), (1, second)]
    assert len({a["node_id"] for a in allocs}) == 2  # distinct nodes
    assert all(a["gpu_count"] == 8 for a in allocs)
    # the bid's events are every member's
    allocated = wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    later = wait_event(alice, f"/bids/{b['id']}/events", "allocated", after=allocated["id"])
    assert {allocated["bid_id"], later["bid_id"]} == {b["id"], second}
    master = next(a["node_id"] for a in allocs if a["rank"] == 0)
    for a in allocs:
        seen = assignment(agents[a["node_id"]], a["node_id"], "running")
        assert seen["rank"] == a["rank"]
        assert seen["gang"] == {
            "rank": a["rank"],
            "world_size": 2,
            "master_addr": addresses[master],  # as rank 0's node registered it
            "master_port": 20000 + b["id"] % 12000,
            "gpus_per_node": 8,
            "lead_allocation": next(x["id"] for x in allocs if x["rank"] == 0),
        }
    # rank 0's node advertises a new address with its heartbeat: every member sees it
    beat = agents[master].post(f"/nodes/{master}/heartbeat", json={"address": "gpu-a.lan"})
    assert beat.status_code == 200 and beat.json()["address"] == "gpu-a.lan"
    for a in allocs:
        seen = assignment(agents[a["node_id"]], a["node_id"], "running")
        assert seen["gang"]["master_addr"] == "gpu-a.lan"
    mine = {a["id"]: a["rank"] for a in alice.get("/allocations").json()}
    assert mine == {a["id"]: a["rank"] for a in allocs}
    one = alice.get(f"/allocations/{allocs[0]['id']}").json()
    assert one["rank"] == allocs[0]["rank"]


def test_a_one_node_bid_has_no_gang(service):
    alice, owner = service.tenant(), service.tenant()
    created, agent = node(service, owner)  # no address
    response = alice.post("/bids", json={**GANG, "region": "any"})
    assert response.status_code == 201, response.text
    b = response.json()
    assert (b["node_count"], b["gang_id"], b["members"]) == (1, None, [])
    allocs = gang_allocations(alice, b["id"], count=1)
    assert allocs[0]["rank"] is None
    seen = assignment(agent, created["id"], "running")
    assert seen["gang"] is None and seen["rank"] is None


def test_an_unset_address_makes_the_master_loopback(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    agents = {n["id"]: agent for n, agent in (node(service, owner) for _ in range(2))}
    b = gang_bid(alice, region="any")
    for a in gang_allocations(alice, b["id"]):
        seen = assignment(agents[a["node_id"]], a["node_id"], "running")
        assert seen["gang"]["master_addr"] == "127.0.0.1"


# ---------------------------------------------------------------- notice, cancel, finish


@pytest.mark.parametrize("rank", [0, 1])
def test_a_reclaimed_member_notices_the_gang_and_a_replacement_is_reserved(service, rank):
    alice, owner = service.tenant(credit=100), service.tenant()
    agents, addresses = {}, {}
    for i in range(3):
        created, agent = node(service, owner, address=f"10.0.1.{i + 1}")
        agents[created["id"]], addresses[created["id"]] = agent, created["address"]
    b = gang_bid(alice)
    allocs = gang_allocations(alice, b["id"])
    where = {a["rank"]: a["node_id"] for a in allocs}
    (spare,) = set(agents) - set(where.values())
    answer = owner.patch(f"/nodes/{where[rank]}", json={"state": "reclaimed"})
    assert answer.status_code == 200
    after = gang_allocations(alice, b["id"], statuses=("noticed",))
    noticed = [a for a in after if a["status"] == "noticed"]
    assert {a["id"] for a in noticed} == {a["id"] for a in allocs}  # both, not just one
    assert len({a["deadline"] for a in noticed}) == 1  # one deadline
    assert {a["notice_reason"] for a in noticed} == {"reclaimed"}
    reserved = gang_allocations(alice, b["id"], statuses=("reserved",))
    reserved = {a["rank"]: a["node_id"] for a in reserved if a["status"] == "reserved"}
    other = 1 - rank
    assert reserved == {rank: spare, other: where[other]}  # a replacement; the other stays
    # a noticed member still meets rank 0 where it runs; a reservation where it resumes
    survivor = where[other]
    running_master = assignment(agents[survivor], survivor, "noticed")["gang"]["master_addr"]
    resumed_master = assignment(agents[survivor], survivor, "reserved")["gang"]["master_addr"]
    assert running_master == addresses[where[0]]
    assert resumed_master == addresses[reserved[0]]
    assert assignment(agents[spare], spare, "reserved")["gang"]["rank"] == rank


def test_cancelling_through_the_second_member_cancels_the_gang(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    for _ in range(2):
        node(service, owner)
    b = gang_bid(alice)
    allocs = gang_allocations(alice, b["id"])
    response = alice.post(f"/bids/{b['members'][1]}/cancel")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    for member in b["members"]:
        assert alice.get(f"/bids/{member}").json()["status"] == "cancelled"
    ended = gang_allocations(alice, b["id"], statuses=("finished",))
    assert {a["id"] for a in ended} == {a["id"] for a in allocs}
    assert {a["end_reason"] for a in ended} == {"bid cancelled"}


def test_repricing_through_any_member_reprices_every_member(service):
    alice = service.tenant(credit=100)
    owner = service.tenant()
    for _ in range(2):
        node(service, owner)
    b = gang_bid(alice, max_price=0.5)  # under the reserve: it waits
    response = alice.patch(f"/bids/{b['members'][1]}", json={"max_price": 1.5})
    assert response.status_code == 200, response.text
    for member in b["members"]:
        assert alice.get(f"/bids/{member}").json()["max_price"] == 1.5
    allocs = gang_allocations(alice, b["id"])  # now above the reserve: placed whole
    assert {a["price"] for a in allocs} == {0.9}


def test_a_reprice_committed_between_the_reads_of_a_gangs_first_tick_still_places_it(
    service, db_url, monkeypatch
):
    """The tick reads a new gang's members one by one. On PostgreSQL (read committed) a
    reprice can commit between the reads: rank 0 is read at the old price, rank 1 at the new.
    The gang must still be placed whole at the new price, not hold rank 1 for a differing term.
    (SQLite's tick holds the write lock, so there the reprice waits for the tick: no race.)"""
    from prefect_spotgpu.service import market_rows

    alice, owner = service.tenant(credit=100), service.tenant()
    for _ in range(2):
        node(service, owner)
    repriced = threading.Event()
    read = market_rows.market_bid

    def reprice(bid_id):
        response = alice.patch(f"/bids/{bid_id}", json={"max_price": 1.5})
        assert response.status_code == 200, response.text
        repriced.set()

    def market_bid(row):  # the seam: the moment between reading rank 0 and rank 1
        bid = read(row)
        if row.gang_id == row.id and not repriced.is_set():
            threading.Thread(target=reprice, args=(row.id,), daemon=True).start()
            if db_url.startswith("postgresql"):
                assert repriced.wait(10), "the reprice did not commit beside the tick"
        return bid

    monkeypatch.setattr(market_rows, "market_bid", market_bid)
    b = gang_bid(alice, max_price=0.5)
    allocs = gang_allocations(alice, b["id"])
    assert repriced.is_set()
    assert {a["price"] for a in allocs} == {0.9}
    for member in b["members"]:
        seen = alice.get(f"/bids/{member}").json()
        assert (seen["status"], seen["max_price"]) == ("open", 1.5), seen


def test_a_finished_member_finishes_every_member(service):
    alice, owner = service.tenant(credit=100), service.tenant()
    agents = {}
    for _ in range(2):
        created, agent = node(service, owner)
        agents[created["id"]] = agent
    b = gang_bid(alice)
    allocs = gang_allocations(alice, b["id"])
    rank1 = next(a for a in allocs if a["rank"] == 1)
    report = {"epoch": rank1["epoch"], "outcome": "finished"}
    answer = agents[rank1["node_id"]].post(f"/allocations/{rank1['id']}/report", json=report)
    assert answer.status_code == 200, answer.text
    gang_allocations(alice, b["id"], statuses=("finished",))
    wait_for(
        lambda: all(alice.get(f"/bids/{m}").json()["status"] == "finished" for m in b["members"])
    )


# ---------------------------------------------------------------- a restart keeps the gang


def test_a_restarted_service_rebuilds_its_gangs(db_url, tmp_path):
    from sqlalchemy.orm import Session

    from conftest import ADMIN_KEY
    from prefect_spotgpu.service.db import make_engine
    from prefect_spotgpu.service.market_rows import load_market
    from prefect_spotgpu.service.settings import ServiceSettings

    svc = start_service(db_url, tmp_path / "home")
    try:
        alice, owner = svc.tenant(credit=1000), svc.tenant()
        agents = {}
        for _ in range(4):
            created, agent = node(svc, owner)
            agents[created["id"]] = agent
        running = gang_bid(alice)
        before = gang_allocations(alice, running["id"])
        waiting = gang_bid(alice, max_price=0.5)  # under the reserve: it waits
        svc.ticked()
        assert alice.get(f"/bids/{waiting['id']}/allocations").json() == []
        api_key = alice.headers["Authorization"].removeprefix("Bearer ")
        owner_key = owner.headers["Authorization"].removeprefix("Bearer ")
        tokens = {n: a.headers["Authorization"].removeprefix("Bearer ") for n, a in agents.items()}
    finally:
        svc.stop()
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            market = load_market(
                session=session, settings=ServiceSettings(db_url=db_url, admin_key=ADMIN_KEY)
            )
        state = market.snapshot()
    finally:
        engine.dispose()
    gangs = {b.id: (b.node_count, b.gang_id) for b in state.bids}
    for gang in (running, waiting):
        for member in gang["members"]:
            assert gangs[member] == (2, gang["id"])
    assert len(market.tick(time.time()).placements) == 0  # nothing new: still running whole
    svc = start_service(db_url, tmp_path / "home")
    try:
        alice, owner = svc.client(api_key), svc.client(owner_key)
        agents = {n: svc.client(t) for n, t in tokens.items()}
        for n, agent in agents.items():
            assert agent.post(f"/nodes/{n}/heartbeat", json={}).status_code == 200
        svc.ticked()  # ticks of the new leader
        after = alice.get(f"/bids/{running['id']}/allocations").json()
        assert [(a["id"], a["status"], a["rank"]) for a in after] == [
            (a["id"], "running", a["rank"]) for a in before
        ]
        # the rebuilt market knows the waiting gang whole: repriced, it is placed whole
        assert alice.patch(f"/bids/{waiting['id']}", json={"max_price": 1.5}).status_code == 200
        placed = gang_allocations(alice, waiting["id"])
        assert {a["node_id"] for a in placed}.isdisjoint({a["node_id"] for a in before})
        # ... and the running one: a notice to one member is a notice to both
        rank0 = next(a for a in before if a["rank"] == 0)
        owner.patch(f"/nodes/{rank0['node_id']}", json={"state": "reclaimed"})
        noticed = gang_allocations(alice, running["id"], statuses=("noticed",))
        assert len({a["deadline"] for a in noticed if a["status"] == "noticed"}) == 1
    finally:
        svc.stop()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "body",
    [
        {"node_count": 0},
        {"node_count": 65},
        {"node_count": True},
        {"node_count": "2"},
        {"node_count": 2.0},
        {"node_count": 3},  # more than the region's two nodes
        {"node_count": 2, "gpu_count": 16},  # no node has 16 GPUs
        {"node_count": 2, "region": "us-east"},  # one node there
        {"node_count": 3, "region": "any"},  # two in the region with the most
        {"node_count": 2, "capacity": "on_demand", "max_price": None},  # no on-demand nodes
    ],
)
@one_database("a 422 from validation or from counting the registered nodes, before any write")
def test_bad_node_counts_get_422_naming_node_count_and_write_nothing(service, db_url, body):
    alice, owner = service.tenant(), service.tenant()
    for region in ("eu-west", "eu-west", "us-east"):
        node(service, owner, region=region)
    rows = count_rows(db_url, "bids")
    response = alice.post("/bids", json={**GANG, **body})
    assert response.status_code == 422, response.text
    fields = [err["loc"][-1] for err in response.json()["detail"]]
    assert "node_count" in fields, response.text
    assert count_rows(db_url, "bids") == rows
    assert alice.get("/bids").json() == []


def test_lost_nodes_do_not_count_for_a_gang(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home", heartbeat_timeout_seconds=1.0)
    try:
        alice, owner = svc.tenant(), svc.tenant()
        nodes = [node(svc, owner) for _ in range(2)]
        for created, _ in nodes:
            wait_for(lambda n=created: svc.admin.get(f"/nodes/{n['id']}").json()["state"] == "lost")
        (first, first_agent), (second, second_agent) = nodes
        assert first_agent.post(f"/nodes/{first['id']}/heartbeat", json={}).status_code == 200
        refused = alice.post("/bids", json={**GANG, "node_count": 2})
        assert refused.status_code == 422 and refused.json()["field"] == "node_count"
        assert "the 1 registered" in refused.json()["detail"][0]["msg"]
        assert second_agent.post(f"/nodes/{second['id']}/heartbeat", json={}).status_code == 200
        assert alice.post("/bids", json={**GANG, "node_count": 2}).status_code == 201
    finally:
        svc.stop()


def test_a_gang_fits_the_region_with_the_most_nodes_and_its_retry_returns_it(service, db_url):
    alice, owner = service.tenant(), service.tenant()
    for region in ("eu-west", "us-east", "us-east"):
        node(service, owner, region=region)
    b = gang_bid(alice, region="any", idempotency_key="gang-1")
    assert count_rows(db_url, "bids") == 2
    again = alice.post(
        "/bids", json={**GANG, "region": "any", "node_count": 2, "idempotency_key": "gang-1"}
    )
    assert again.status_code == 200 and again.json()["id"] == b["id"]
    assert again.json()["members"] == b["members"]
    assert count_rows(db_url, "bids") == 2
    other = alice.post(
        "/bids", json={**GANG, "region": "any", "node_count": 1, "idempotency_key": "gang-1"}
    )
    assert other.status_code == 409 and "node_count" in other.json()["detail"]
    placed = gang_allocations(alice, b["id"])
    regions = {n["id"]: n["region"] for n in owner.get("/nodes").json()}
    assert {regions[a["node_id"]] for a in placed} == {"us-east"}


@pytest.mark.parametrize(
    "address",
    [
        *("10.0.0.7\n", "10.0.0.7/24", "", "a" * 254, "host name"),
        # a hostile provider aiming other providers' ranks at what is not a node:
        *("169.254.169.254", "fe80::1", "0.0.0.0", "::", "224.0.0.1", "255.255.255.255"),
    ],
)
@one_database("validation and headers are decided before any query")
def test_bad_addresses_get_422_naming_address_and_write_nothing(service, db_url, address):
    owner = service.tenant()
    service.grant_provider(owner)
    nodes = count_rows(db_url, "nodes")
    body = {
        "name": "n1",
        "gpu_model": "A100-80G",
        "region": "eu-west",
        "gpu_count": 8,
        "reserve_price": 0.9,
        "address": address,
    }
    response = owner.post("/nodes", json=body)
    assert response.status_code == 422, response.text
    assert "address" in [err["loc"][-1] for err in response.json()["detail"]]
    assert count_rows(db_url, "nodes") == nodes
    created, agent = node(service, owner, address="10.0.0.7")
    beat = agent.post(f"/nodes/{created['id']}/heartbeat", json={"address": address})
    assert beat.status_code == 422, beat.text
    assert "address" in [err["loc"][-1] for err in beat.json()["detail"]]
    assert service.admin.get(f"/nodes/{created['id']}").json()["address"] == "10.0.0.7"


# ---------------------------------------------------------------- a gang that may go on smaller


@pytest.mark.parametrize(
    "body",
    [
        {"node_count": 2, "min_node_count": 3},  # more than the gang
        {"node_count": 2, "min_node_count": 0},
        {"node_count": 2, "min_node_count": "1"},
        {"node_count": 2, "min_node_count": 1.0},
        {"node_count": 2, "min_node_count": True},
        {"node_count": 4, "min_node_count": 3},  # more than the region's two nodes
    ],
)
@one_database("a 422 from validation or from counting the registered nodes, before any write")
def test_bad_min_node_counts_get_422_naming_it_and_write_nothing(service, db_url, body):
    alice, owner = service.tenant(), service.tenant()
    for _ in range(2):
        node(service, owner)
    rows = count_rows(db_url, "bids")
    response = alice.post("/bids", json={**GANG, **body})
    assert response.status_code == 422, response.text
    fields = [err["loc"][-1] for err in response.json()["detail"]]
    assert "min_node_count" in fields, response.text
    assert count_rows(db_url, "bids") == rows


def test_a_gang_that_may_shrink_goes_on_with_its_survivor_as_a_world_of_one(service):
    """Two nodes, a gang of 2 that may go on with 1: rank 0's node is taken back and no
    replacement is free. The survivor's GPUs are reserved for rank 0 (a gang gone smaller
    holds its first ranks); once both members stop, it runs there with WORLD_SIZE 1 and meets
    itself. More nodes later: its next notice grows it back to 2."""
    alice, owner = service.tenant(credit=100), service.tenant()
    agents, addresses = {}, {}
    for i in range(2):
        created, agent = node(service, owner, address=f"10.0.2.{i + 1}")
        agents[created["id"]], addresses[created["id"]] = agent, created["address"]
    b = gang_bid(alice, min_node_count=1)
    assert (b["node_count"], b["min_node_count"]) == (2, 1)
    member = alice.get(f"/bids/{b['members'][1]}").json()
    assert member["min_node_count"] == 1  # every member's row holds it
    allocs = gang_allocations(alice, b["id"])
    where = {a["rank"]: a["node_id"] for a in allocs}
    assert assignment(agents[where[1]], where[1], "running")["gang"]["world_size"] == 2
    assert owner.patch(f"/nodes/{where[0]}", json={"state": "reclaimed"}).status_code == 200
    noticed = gang_allocations(alice, b["id"], statuses=("noticed",))
    noticed = [a for a in noticed if a["status"] == "noticed"]
    reserved = gang_allocations(alice, b["id"], statuses=("reserved",), count=1)
    reserved = [a for a in reserved if a["status"] == "reserved"]
    assert [(a["rank"], a["node_id"]) for a in reserved] == [(0, where[1])]
    place = assignment(agents[where[1]], where[1], "reserved")["gang"]
    assert (place["rank"], place["world_size"]) == (0, 1)
    assert place["master_addr"] == addresses[where[1]]
    assert assignment(agents[where[1]], where[1], "noticed")["gang"]["world_size"] == 2
    for a in noticed:  # each member acks its final save
        answer = agents[a["node_id"]].post(
            f"/allocations/{a['id']}/report",
            json={"epoch": a["epoch"], "outcome": "saved", "checkpoint_at": time.time()},
        )
        assert answer.status_code == 200, answer.text
    running = gang_allocations(alice, b["id"], count=1)
    (now,) = [a for a in running if a["status"] == "running"]
    assert (now["rank"], now["node_id"]) == (0, where[1])
    place = assignment(agents[where[1]], where[1], "running")["gang"]
    assert (place["rank"], place["world_size"], place["lead_allocation"]) == (0, 1, now["id"])


def test_a_gang_in_containers_is_held_where_no_docker_node_has_a_job_network(service):
    """A gang's containers reach each other across hosts only on job networks: a gang bid with
    an image, whose pool's Docker nodes have none, is held at once, its reason naming the
    option, not left to hang."""
    alice, owner = service.tenant(credit=100), service.tenant()
    for _ in range(2):
        node(service, owner, runner="docker")
    b = gang_bid(alice, job={"command": ["true"], "image": "pytorch"})

    def held():
        seen = alice.get(f"/bids/{b['id']}").json()
        return seen if seen["status"] == "held" else None

    seen = wait_for(held)
    assert "--job-subnet" in seen["hold_reason"] and "gang" in seen["hold_reason"]
    assert alice.get(f"/bids/{b['id']}/allocations").json() == []


def test_a_gang_in_containers_meets_at_its_members_job_addresses(service):
    """On Docker nodes with job networks, each allocation gets the lowest free address of its
    node's subnet; a member's place names rank 0's as ``master_addr`` and its peers'."""
    alice, owner = service.tenant(credit=100), service.tenant()
    subnets = ["10.88.1.0/24", "10.88.2.0/24"]
    made = [
        node(service, owner, address=f"192.168.0.{i + 1}", runner="docker", job_subnet=net)
        for i, net in enumerate(subnets)
    ]
    assert [n["job_subnet"] for n, _ in made] == subnets
    agents = {n["id"]: agent for n, agent in made}
    job = {"command": ["true"], "image": "pytorch"}
    b = gang_bid(alice, gpu_count=4, job=job)
    single = alice.post("/bids", json={**GANG, "gpu_count": 4, "job": job})
    assert single.status_code == 201, single.text
    members = gang_allocations(alice, b["id"])
    (lone,) = wait_for(lambda: alice.get(f"/bids/{single.json()['id']}/allocations").json())

    def seen(allocation: dict) -> dict:
        node_id = allocation["node_id"]
        (found,) = [x for x in agents[node_id].get(f"/nodes/{node_id}/allocations").json()
                    if x["id"] == allocation["id"]]  # fmt: skip
        return found

    places = {a["rank"]: seen(a) for a in members}
    addresses = [places[r]["job_address"] for r in (0, 1)]
    for rank, a in enumerate(sorted(members, key=lambda a: a["rank"])):  # its node's subnet
        net = subnets[[n["id"] for n, _ in made].index(a["node_id"])]
        assert addresses[rank].rsplit(".", 1)[0] == net.rsplit(".", 1)[0]
        assert addresses[rank].endswith(".2")  # the lowest after the bridge's .1
    (shared,) = [a for a in members if a["node_id"] == lone["node_id"]]
    assert seen(lone)["job_address"] == places[shared["rank"]]["job_address"][:-1] + "3"
    for rank in (0, 1):
        gang = places[rank]["gang"]
        assert gang["master_addr"] == addresses[0]  # rank 0's job, not its node
        assert gang["peers"] == addresses


def test_a_gang_across_a_process_node_and_a_job_network_admits_the_process_nodes_address(
    service,
):
    """A gang without an image may run on a process node and on a Docker node with a default
    image and a job network: the container's peers then name the process node's address (its
    rank connects from there), so its firewall admits it."""
    alice, owner = service.tenant(credit=100), service.tenant()
    proc, proc_agent = node(service, owner, address="192.168.0.9", runner="process")
    terms = {"runner": "docker", "default_image": "pytorch/pytorch:2", "job_subnet": "10.88.3.0/24"}
    dock, dock_agent = node(service, owner, address="192.168.0.10", **terms)
    b = gang_bid(alice, job={"command": ["true"]})
    members = {a["node_id"]: a for a in gang_allocations(alice, b["id"])}

    def seen(made, agent) -> dict:
        listed = agent.get(f"/nodes/{made['id']}/allocations").json()
        return next(x for x in listed if x["id"] == members[made["id"]]["id"])

    container, process = seen(dock, dock_agent), seen(proc, proc_agent)
    assert container["job_address"] == "10.88.3.2" and process["job_address"] is None
    ranks = {container["gang"]["rank"]: "10.88.3.2", process["gang"]["rank"]: "192.168.0.9"}
    assert container["gang"]["peers"] == [ranks[0], ranks[1]]
    assert container["gang"]["master_addr"] == ranks[0] == process["gang"]["master_addr"]


@pytest.mark.parametrize(
    ("terms", "said"),
    [
        ({"runner": "docker", "job_subnet": "8.8.8.0/24"}, "not a private range"),
        ({"runner": "docker", "job_subnet": "10.1.2.3/24"}, "host bits set (10.1.2.0/24?)"),
        ({"runner": "docker", "job_subnet": "10.0.0.0/12"}, "a /16 to a /24"),
        ({"runner": "docker", "job_subnet": "10.1.2.0/25"}, "a /16 to a /24"),
        ({"runner": "docker", "job_subnet": "fd00::/64"}, "job_subnet"),
        ({"runner": "process", "job_subnet": "10.1.2.0/24"}, "job_subnet needs runner 'docker'"),
        ({"job_subnet": "10.1.2.0/24"}, "job_subnet needs runner 'docker'"),
    ],
)
@one_database("a 422 decided before any query")
def test_a_job_subnet_that_cannot_be_one_is_refused_naming_it(service, terms, said):
    owner = service.tenant()
    service.grant_provider(owner)
    body = {"name": "n", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 8,
            "reserve_price": 0.9, **terms}  # fmt: skip
    answer = owner.post("/nodes", json=body)
    assert answer.status_code == 422, answer.text
    assert said in answer.text and "job_subnet" in answer.text


def test_a_provider_cannot_claim_another_nodes_job_network(service):
    """Two nodes with overlapping subnets would give two jobs one address (and a hostile
    provider the addresses another node's gang peers accept): refused at registration and in
    a heartbeat, naming the field; nothing is written."""
    honest, hostile = service.tenant(), service.tenant()
    node(service, honest, runner="docker", job_subnet="10.88.0.0/24")
    service.grant_provider(hostile)
    body = {"name": "x", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 8,
            "reserve_price": 0.9, "runner": "docker"}  # fmt: skip
    for subnet in ("10.88.0.0/24", "10.88.0.0/16"):
        answer = hostile.post("/nodes", json={**body, "job_subnet": subnet})
        assert answer.status_code == 422 and "another node's job network" in answer.text
    assert hostile.get("/nodes").json() == []
    created, agent = node(service, hostile, runner="docker", job_subnet="10.89.0.0/24")
    beat = agent.post(f"/nodes/{created['id']}/heartbeat",
                      json={"runner": "docker", "job_subnet": "10.88.0.0/20"})  # fmt: skip
    assert beat.status_code == 422 and "job_subnet" in beat.text, beat.text
    assert hostile.get(f"/nodes/{created['id']}").json()["job_subnet"] == "10.89.0.0/24"


def test_an_agent_whose_new_subnet_overlaps_keeps_saying_it_and_its_node_keeps_its_network(
    service,
):
    """The agent drops a field from its heartbeat only when the market does not know it (an
    older market). A subnet refused as another node's is sent again as it is: sent without,
    the node would lose its job network while its containers sit on it."""
    import httpx

    from prefect_spotgpu.agent.heartbeat import NodeImages, send_heartbeat
    from prefect_spotgpu.messages import RunnerTerms

    owner = service.tenant()
    node(service, owner, runner="docker", job_subnet="10.88.0.0/24")
    created, agent = node(service, owner, runner="docker", job_subnet="10.89.0.0/24")
    moved = RunnerTerms(runner="docker", job_subnet="10.88.0.0/24")  # restarted with another's
    answer = send_heartbeat(
        agent, created["id"], telemetry={}, images=NodeImages(list), runner=moved
    )
    assert answer.status_code == 422 and "another node's job network" in answer.text
    assert owner.get(f"/nodes/{created['id']}").json()["job_subnet"] == "10.89.0.0/24"

    sent = []

    def older_market(request: httpx.Request) -> httpx.Response:  # it forbids the field
        body = json.loads(request.content)
        sent.append(body)
        if "job_subnet" in body:
            issue = {"loc": ["body", "job_subnet"], "msg": "Extra inputs are not permitted",
                     "type": "extra_forbidden"}  # fmt: skip
            return httpx.Response(422, json={"detail": [issue]})
        return httpx.Response(200, json={})

    older = httpx.Client(transport=httpx.MockTransport(older_market), base_url="http://m")
    assert send_heartbeat(older, 1, telemetry={}, images=NodeImages(list), runner=moved).is_success
    assert ["job_subnet" in body for body in sent] == [True, False]
