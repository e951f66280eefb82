"""The market's trust model, tried as the attacks it stops: a second tenant, a hostile
provider, a job that dies on purpose. Real service, real SQLite and PostgreSQL, over HTTP."""

from __future__ import annotations

import logging
import time

import pytest
import sqlalchemy as sa

from conftest import ADMIN_KEY, one_database, start_service
from test_service_api import bid, wait_event

COMPENSATION_ONLY = (
    "what is compensated is the ledger's pure rules and one write; the money's locking and "
    "columns run on both databases in test_money and test_credit"
)

SECRET = "AKIA-very-secret-0123456789"


def job(**env) -> dict:
    return {"command": ["python", "-m", "prefect.engine"], "env": env}


def ledger_compensation(client) -> list[dict]:
    return [e for e in client.get("/ledger").json()["entries"] if e["kind"] == "compensation"]


def node_jobs(node_client, node_id) -> dict[int, dict | None]:
    response = node_client.get(f"/nodes/{node_id}/allocations")
    assert response.status_code == 200, response.text
    return {a["bid_id"]: a["job"] for a in response.json()}


# ---------------------------------------------------------------- roles: supply is vetted


@one_database("a role, read with the caller's key before any write")
def test_only_a_provider_the_operator_granted_registers_nodes(service):
    mallory = service.tenant()
    body = {"name": "n", "gpu_model": "A100-80G", "region": "eu-west", "gpu_count": 8}
    refused = mallory.post("/nodes", json={**body, "reserve_price": 0.01})
    assert refused.status_code == 403 and "provider" in refused.json()["detail"]
    assert mallory.get("/nodes").json() == []
    # no tenant grants itself the role
    assert (
        mallory.put(f"/tenants/{mallory.tenant_id}/provider", json={"provider": True}).status_code
        == 403
    )
    service.grant_provider(mallory)
    assert mallory.get("/me").json()["provider"] is True
    node = mallory.post("/nodes", json={**body, "reserve_price": 0.9})
    assert node.status_code == 201
    # the operator takes it back: no more nodes, and its live node drains
    admin = service.admin
    assert (
        admin.put(f"/tenants/{mallory.tenant_id}/provider", json={"provider": False}).status_code
        == 200
    )
    assert (
        mallory.post("/nodes", json={**body, "name": "m", "reserve_price": 0.9}).status_code == 403
    )
    assert admin.get(f"/nodes/{node.json()['id']}").json()["state"] == "draining"


# ---------------------------------------------------------------- sealed secrets


def test_a_jobs_secrets_are_sealed_and_go_only_to_the_node_running_it(service, caplog):
    caplog.set_level(logging.DEBUG)
    alice, provider = service.tenant(), service.tenant()
    b = bid(alice, gpu_count=8, max_price=1.0, job=job(AWS_SECRET_ACCESS_KEY=SECRET, X="1"))
    # the tenant sees the names, never the values, in every read
    assert b["job"]["env_names"] == ["AWS_SECRET_ACCESS_KEY", "X"] and "env" not in b["job"]
    for body in (alice.get(f"/bids/{b['id']}").text, alice.get("/bids").text):
        assert SECRET not in body
    # at rest: not in any column of the database
    engine = sa.create_engine(service.app.state.engine.url)
    with engine.connect() as connection:
        row = connection.execute(
            sa.text("SELECT job, job_env_sealed FROM bids WHERE id = :id"), {"id": b["id"]}
        ).one()
    engine.dispose()
    assert SECRET not in str(row.job) and SECRET not in row.job_env_sealed
    # a provider's node with no allocation of the bid sees nothing of it
    idle, idle_agent = service.node(provider, name="idle", region="us-east", gpus=8)
    running, agent = service.node(provider, name="running", gpus=8)
    alloc = wait_event(alice, f"/bids/{b['id']}/events", "allocated")
    assert alloc["node_id"] == running["id"]
    assert node_jobs(idle_agent, idle["id"]) == {}
    assert idle_agent.get(f"/nodes/{running['id']}/allocations").status_code == 403
    # the node running it gets the job with its environment, while it runs it
    assert node_jobs(agent, running["id"])[b["id"]]["env"]["AWS_SECRET_ACCESS_KEY"] == SECRET
    agent.post(
        f"/allocations/{alloc['allocation_id']}/report", json={"epoch": 1, "outcome": "finished"}
    )
    service.wait_for(lambda: b["id"] not in node_jobs(agent, running["id"]))
    assert all(SECRET not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_reserved_allocation_gets_its_job_only_as_a_warm_migration_target(db_url, tmp_path, warm):
    """With ``warm_replacement`` the migration target's node gets the job at the notice (to
    start it warm); without, only once it runs. No other node ever sees it."""
    service = start_service(db_url, tmp_path / "home", warm_replacement=warm)
    try:
        alice, provider = service.tenant(), service.tenant()
        first, agent1 = service.node(provider, name="first", gpus=8)
        b = bid(alice, gpu_count=8, max_price=1.0, job=job(TOKEN=SECRET))
        alloc = wait_event(alice, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
        second, agent2 = service.node(provider, name="second", gpus=8)
        third, agent3 = service.node(provider, name="third", gpus=8, reserve=5.0)
        provider.patch(f"/nodes/{first['id']}", json={"state": "reclaimed"})
        reserved = wait_event(alice, f"/bids/{b['id']}/events", "reserved")
        assert reserved["node_id"] == second["id"]
        early = node_jobs(agent2, second["id"])[b["id"]]
        assert (early["env"] == {"TOKEN": SECRET}) if warm else early is None
        assert node_jobs(agent3, third["id"]) == {}
        target = f"/allocations/{reserved['allocation_id']}"
        service.flushed()  # ticks and a charge flush (0.5 s) go by while it warms up
        assert alice.get(target).json()["charged_micros"] == 0  # never billed while reserved
        notice = wait_event(agent1, f"/nodes/{first['id']}/events", "noticed")
        agent1.post(
            f"/allocations/{alloc}/report",
            json={
                "epoch": notice["payload"]["epoch"],
                "outcome": "saved",
                "checkpoint_at": time.time(),
            },
        )
        service.wait_for(lambda: b["id"] not in node_jobs(agent1, first["id"]))
        service.wait_for(lambda: node_jobs(agent2, second["id"]).get(b["id"]))
        assert node_jobs(agent2, second["id"])[b["id"]]["env"] == {"TOKEN": SECRET}
        promoted = alice.get(target).json()
        assert promoted["status"] == "running"  # billed from its promotion on
        service.wait_for(lambda: alice.get(target).json()["charged_micros"] > 0)
        old = alice.get(f"/allocations/{alloc}").json()
        assert promoted["started_at"] >= old["charged_until"] - 0.5  # no second billed twice
    finally:
        service.stop()


def test_sealing_uses_the_configured_key_and_seals_old_plaintext_at_start(db_url, tmp_path):
    from prefect_spotgpu.service.sealing import new_key

    key = new_key()
    svc = start_service(db_url, tmp_path / "home", secret_key=key)
    try:
        alice = svc.tenant()
        b = bid(alice, job=job(A=SECRET))
        url = svc.app.state.engine.url
    finally:
        svc.stop()
    assert not (tmp_path / "home" / "secret_key").exists()  # the configured key, no file
    engine = sa.create_engine(url)
    with engine.begin() as connection:  # a bid written in the clear before sealing existed
        connection.execute(
            sa.text("UPDATE bids SET job = :job, job_env_sealed = NULL WHERE id = :id").bindparams(
                sa.bindparam("job", type_=sa.JSON)
            ),
            {"job": job(A=SECRET), "id": b["id"]},
        )
    svc = start_service(db_url, tmp_path / "home", secret_key=key)
    try:
        with engine.connect() as connection:
            row = connection.execute(sa.text("SELECT job, job_env_sealed FROM bids")).one()
        assert SECRET not in str(row.job) and row.job_env_sealed
        assert svc.app.state.sealer.open(row.job_env_sealed) == {"A": SECRET}
    finally:
        svc.stop()
        engine.dispose()


@one_database("a file's mode, written at the start")
def test_the_generated_key_file_is_private(service, tmp_path):
    key_file = tmp_path / "home" / "secret_key"
    assert key_file.exists() and key_file.stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- reports from nodes


def test_a_nodes_word_on_a_failed_job_reaches_its_tenant_as_one_line_of_plain_text(service):
    """A hostile provider may say anything of a job it fails: only one bounded line of text,
    no terminal escapes or other control characters, reaches the tenant (its flow-run log)."""
    tenant, provider = service.tenant(), service.tenant()
    _, agent = service.node(provider, gpus=8)
    b = bid(tenant, gpu_count=8, max_price=1.0)
    alloc = wait_event(tenant, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    for hostile in (
        "\x1b]52;c;cm0gLXJmIH4=\x07 copy this",
        "line\nforged line",
        "\x9b31m",
        "x" * 301,
    ):
        refused = agent.post(
            f"/allocations/{alloc}/report",
            json={"epoch": 1, "outcome": "failed", "detail": hostile},
        )
        assert refused.status_code == 422 and "detail" in refused.text, refused.text
    assert tenant.get(f"/allocations/{alloc}").json()["status"] == "running"  # nothing written
    said = "the job could not start: image 'x/y:1' is not on this node and could not be pulled"
    ok = agent.post(
        f"/allocations/{alloc}/report", json={"epoch": 1, "outcome": "failed", "detail": said}
    )
    assert ok.status_code == 200, ok.text
    ended = wait_event(tenant, f"/bids/{b['id']}/events", "preempted")
    assert ended["payload"]["reason"] == "job failed on the node"
    assert ended["payload"]["detail"] == said


def test_a_node_cannot_end_or_bill_another_nodes_job_and_every_report_is_audited(service):
    victim, provider, rival = service.tenant(), service.tenant(), service.tenant()
    node, agent = service.node(provider, gpus=8)
    _, fake = service.node(rival, name="fake", region="us-east", gpus=8)
    b = bid(victim, gpu_count=8, max_price=1.0)
    alloc = wait_event(victim, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    forged = fake.post(f"/allocations/{alloc}/report", json={"epoch": 1, "outcome": "finished"})
    assert forged.status_code == 404
    stale = agent.post(f"/allocations/{alloc}/report", json={"epoch": 7, "outcome": "finished"})
    assert stale.status_code == 409
    service.ticked()
    assert victim.get(f"/bids/{b['id']}").json()["status"] == "open"
    assert victim.get(f"/allocations/{alloc}").json()["status"] == "running"
    ok = agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": 1, "outcome": "checkpoint", "checkpoint_at": time.time(), "step": 3},
    )
    assert ok.status_code == 200
    engine = sa.create_engine(service.app.state.engine.url)
    with engine.connect() as connection:
        audit = connection.execute(
            sa.text(
                "SELECT node_id, epoch, outcome, status_code, step, created_at FROM node_reports "
                "WHERE allocation_id = :a ORDER BY id"
            ),
            {"a": alloc},
        ).all()
    engine.dispose()
    assert [(r.outcome, r.status_code, r.epoch) for r in audit] == [
        ("finished", 404, 1),
        ("finished", 409, 7),
        ("checkpoint", 200, 1),
    ]
    assert audit[0].node_id != node["id"] and audit[2].node_id == node["id"]
    assert audit[2].step == 3 and all(r.created_at is not None for r in audit)


# ---------------------------------------------------------------- honest money


def _running(service, tenant, provider, **bid_fields):
    node, agent = service.node(provider, gpus=8, reserve=0.9)
    b = bid(tenant, gpu_count=8, max_price=1.0, **bid_fields)
    alloc = wait_event(tenant, f"/bids/{b['id']}/events", "allocated")["allocation_id"]
    return node, agent, b, alloc


def paid(service, client, alloc, seconds: float) -> float:
    """Until the allocation has been billed for ``seconds`` (its charges flushed): its
    billed seconds then."""
    return service.wait_for(
        lambda: (
            (s := client.get(f"/allocations/{alloc}").json()["charged_seconds"]) >= seconds and s
        )
    )


def _notice(service, owner, agent, node) -> int:
    owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
    return wait_event(agent, f"/nodes/{node['id']}/events", "noticed")["payload"]["epoch"]


@one_database(COMPENSATION_ONLY)
def test_a_job_that_dies_on_its_notice_is_not_compensated_and_stops_paying_at_once(service):
    alice, provider = service.tenant(), service.tenant()
    node, agent, _, alloc = _running(service, alice, provider)
    paid(service, alice, alloc, 1.0)
    epoch = _notice(service, provider, agent, node)
    died = agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch, "outcome": "save_failed", "cause": "job"},
    )
    assert died.status_code == 200
    ended = service.wait_for(
        lambda: (a := alice.get(f"/allocations/{alloc}").json())["status"] == "preempted" and a
    )
    assert ended["end_reason"] == "final save failed (job)"
    assert ended["ended_at"] < ended["deadline"] - 250  # at once, not at the deadline
    service.flushed()
    assert alice.get(f"/allocations/{alloc}").json()["charged_amount"] == ended["charged_amount"]
    assert ledger_compensation(alice) == []


@one_database(COMPENSATION_ONLY)
def test_a_job_that_ignores_its_notice_is_not_compensated(db_url, tmp_path):
    """A job still running, unsaved, at its deadline is its own loss, reported so by the agent
    (``cause: deadline``) or not reported at all: the market ends it at the deadline, no credit."""
    svc = start_service(db_url, tmp_path / "home", notice_seconds=2)
    try:
        alice, provider = svc.tenant(), svc.tenant()
        node, agent, first, alloc = _running(svc, alice, provider)
        epoch = _notice(svc, provider, agent, node)
        late = agent.post(
            f"/allocations/{alloc}/report",
            json={"epoch": epoch, "outcome": "save_failed", "cause": "deadline"},
        )
        assert late.status_code == 200
        svc.wait_for(lambda: alice_status(alice, alloc) == "preempted")
        alice.post(f"/bids/{first['id']}/cancel")
        # the agent never reports: the deadline ends it
        provider.patch(f"/nodes/{node['id']}", json={"state": "live"})
        carol = svc.tenant()
        silent = wait_event(
            carol,
            f"/bids/{bid(carol, gpu_count=8, max_price=1.0)['id']}/events",
            "allocated",
        )["allocation_id"]
        _notice(svc, provider, agent, node)
        ended = svc.wait_for(
            lambda: (
                (a := carol.get(f"/allocations/{silent}").json())["status"] == "preempted" and a
            ),
            timeout=15,
        )
        assert ended["ended_at"] >= ended["deadline"] - 0.5
        svc.flushed()
        assert ledger_compensation(alice) == [] and ledger_compensation(carol) == []
    finally:
        svc.stop()


def test_no_compensation_for_a_bid_on_ones_own_node(service):
    """The 10 -> 61.73 attack: a provider bids on its own node, raises its price and the
    reserve, reclaims, and says the storage failed. Nothing is credited."""
    mallory = service.tenant()
    node, agent, b, alloc = _running(service, mallory, mallory)
    mallory.patch(f"/bids/{b['id']}", json={"max_price": 900.0})
    mallory.patch(f"/nodes/{node['id']}", json={"reserve_price": 800.0})
    paid(service, mallory, alloc, 1.0)
    epoch = _notice(service, mallory, agent, node)
    agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch, "outcome": "save_failed", "cause": "storage"},
    )
    service.wait_for(lambda: alice_status(mallory, alloc) == "preempted")
    service.flushed()
    assert ledger_compensation(mallory) == []


def alice_status(client, alloc) -> str:
    return client.get(f"/allocations/{alloc}").json()["status"]


@one_database(COMPENSATION_ONLY)
def test_compensation_is_what_was_paid_since_the_last_durable_checkpoint(service):
    alice, provider = service.tenant(), service.tenant()
    node, agent, _, alloc = _running(service, alice, provider)
    paid(service, alice, alloc, 1.5)
    agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": 1, "outcome": "checkpoint", "checkpoint_at": time.time(), "step": 10},
    )
    at_checkpoint = paid(service, alice, alloc, 0)
    paid(service, alice, alloc, at_checkpoint + 1.0)
    epoch = _notice(service, provider, agent, node)
    agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch, "outcome": "save_failed", "cause": "storage"},
    )
    entry = service.wait_for(lambda: ledger_compensation(alice))[0]
    ended = alice.get(f"/allocations/{alloc}").json()
    assert ended["last_checkpoint_at"] is not None
    # about 1 s of 8 GPUs at 0.9 since the checkpoint, out of about 2.5 s paid
    assert 0 < entry["amount"] < ended["charged_amount"] * 0.8
    assert entry["amount"] < 0.9 * 8 * 3.0 / 3600
    # once only: a repeated report changes nothing
    again = agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": epoch, "outcome": "save_failed", "cause": "storage"},
    )
    assert again.status_code == 409
    assert len(ledger_compensation(alice)) == 1


@one_database(COMPENSATION_ONLY)
def test_a_lost_node_compensates_what_was_paid_never_more(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home", heartbeat_timeout_seconds=1.5)
    try:
        alice, provider = svc.tenant(), svc.tenant()
        _, _, b, alloc = _running(svc, alice, provider)
        preempted = wait_event(alice, f"/bids/{b['id']}/events", "preempted", timeout=15)
        assert preempted["payload"]["reason"] == "node lost"
        entry = svc.wait_for(lambda: ledger_compensation(alice))[0]
        paid = alice.get(f"/allocations/{alloc}").json()["charged_amount"]
        assert 0 < entry["amount"] <= paid + 1e-12
        alice.post(f"/bids/{b['id']}/cancel")  # or it would take the next node
        # its own node lost: nothing
        mallory = svc.tenant()
        _, _, own_bid, _ = _running(svc, mallory, mallory)
        wait_event(mallory, f"/bids/{own_bid['id']}/events", "preempted", timeout=15)
        svc.flushed()
        assert ledger_compensation(mallory) == []
    finally:
        svc.stop()


def test_a_failed_save_frees_the_gpus_for_the_next_bid(service):
    alice, bob, provider = service.tenant(), service.tenant(), service.tenant()
    node, agent, _, alloc = _running(service, alice, provider)
    provider.patch(f"/nodes/{node['id']}", json={"state": "draining"})
    waiting = bid(bob, gpu_count=8, max_price=1.5)  # first in line once the GPUs are free
    epoch = _notice(service, provider, agent, node)
    agent.post(f"/allocations/{alloc}/report", json={"epoch": epoch, "outcome": "save_failed"})
    provider.patch(f"/nodes/{node['id']}", json={"state": "live"})
    placed = wait_event(bob, f"/bids/{waiting['id']}/events", "allocated", timeout=10)
    assert placed["node_id"] == node["id"]


# ---------------------------------------------------------------- keys


@one_database("a key lookup per request; the writes are one row each")
def test_keys_rotate_and_revoke_at_once(service):
    alice, provider = service.tenant(), service.tenant()
    rotated = alice.post("/me/key")
    assert rotated.status_code == 201
    assert alice.get("/me").status_code == 401  # the old key, at once
    alice.headers["Authorization"] = f"Bearer {rotated.json()['api_key']}"
    assert alice.get("/me").status_code == 200
    admin = service.client(ADMIN_KEY)
    assert admin.post(f"/tenants/{alice.tenant_id}/keys/revoke").json() == {"revoked": 1}
    assert alice.get("/me").status_code == 401
    issued = admin.post(f"/tenants/{alice.tenant_id}/keys").json()["api_key"]
    assert service.client(issued).get("/me").status_code == 200
    # node tokens: the owner rotates, the operator revokes
    node, agent = service.node(provider, gpus=1)
    fresh = provider.post(f"/nodes/{node['id']}/token")
    assert fresh.status_code == 201
    assert agent.get("/nodes/me").status_code == 401
    agent = service.client(fresh.json()["token"])
    assert agent.get("/nodes/me").status_code == 200
    assert admin.post(f"/nodes/{node['id']}/token/revoke").status_code == 200
    assert agent.get("/nodes/me").status_code == 401
    # no one rotates another's node token
    assert service.client(issued).post(f"/nodes/{node['id']}/token").status_code == 403


@one_database(COMPENSATION_ONLY)
def test_a_storage_failure_under_a_notice_the_tenant_caused_is_not_compensated(service):
    """A second, higher bid of one's own outbids the first; its job then claims the storage
    failed. The tenant caused that notice: nothing is credited."""
    alice, provider = service.tenant(credit=100), service.tenant()
    node, agent, _, alloc = _running(service, alice, provider)
    paid(service, alice, alloc, 1.0)
    bid(alice, gpu_count=8, max_price=2.0)  # outbids its own first bid
    notice = wait_event(agent, f"/nodes/{node['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "outbid"
    agent.post(
        f"/allocations/{alloc}/report",
        json={"epoch": notice["payload"]["epoch"], "outcome": "save_failed", "cause": "storage"},
    )
    service.wait_for(lambda: alice_status(alice, alloc) == "preempted")
    service.flushed()
    assert ledger_compensation(alice) == []
    # and a save_failed on an allocation that has no notice changes nothing
    running = service.wait_for(
        lambda: [a for a in alice.get("/allocations", params={"active": True}).json()]
    )[0]
    refused = agent.post(
        f"/allocations/{running['id']}/report",
        json={"epoch": running["epoch"], "outcome": "save_failed", "cause": "storage"},
    )
    assert refused.status_code == 200  # recorded, but the market ignores it
    service.ticked()
    ignored = alice.get(f"/allocations/{running['id']}").json()
    assert ignored["status"] == "running" and ignored["final_save"] is None
    assert ledger_compensation(alice) == []


def test_a_revoked_providers_nodes_never_come_back(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "home", heartbeat_timeout_seconds=1.0)
    try:
        provider = svc.tenant()
        node, agent = svc.node(provider, gpus=1)
        svc.wait_for(lambda: svc.admin.get(f"/nodes/{node['id']}").json()["state"] == "lost")
        assert (
            svc.admin.put(
                f"/tenants/{provider.tenant_id}/provider", json={"provider": False}
            ).status_code
            == 200
        )
        # its agent comes back with its still-valid token: the node drains, takes no work
        assert agent.post(f"/nodes/{node['id']}/heartbeat", json={}).json()["state"] == "draining"
        refused = provider.patch(f"/nodes/{node['id']}", json={"state": "live"})
        assert refused.status_code == 403
        assert (
            provider.patch(f"/nodes/{node['id']}", json={"reserve_price": 0.5}).status_code == 403
        )
        # it may still take its node out, and kill its agent's token
        assert (
            provider.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"}).status_code == 200
        )
        assert provider.post(f"/nodes/{node['id']}/token/revoke").status_code == 200
        assert agent.get("/nodes/me").status_code == 401
        assert provider.post(f"/nodes/{node['id']}/token").status_code == 403  # no new one
    finally:
        svc.stop()


def test_a_replica_with_another_secret_key_refuses_to_start(db_url, tmp_path):
    svc = start_service(db_url, tmp_path / "a")
    try:
        bid(svc.tenant(), job=job(A=SECRET))
    finally:
        svc.stop()
    try:
        start_service(db_url, tmp_path / "b")  # a home of its own: a key of its own
    except RuntimeError as exc:
        assert "SPOTGPU_SECRET_KEY" in str(exc)
    else:
        raise AssertionError("a replica with another key started")


def test_only_a_one_node_bids_migration_target_is_given_its_job_early():
    """A takeover sits on GPUs a noticed job still holds, and a gang's replacement waits for its
    gang: neither gets the job before it runs; nor anything when the operator turns it off; nor
    the target of an outbid, which any tenant can cause (tests/test_free_preemption.py)."""
    from types import SimpleNamespace as Row

    from prefect_spotgpu.service.routes.agents import _warms_up

    on, off = Row(warm_replacement=True), Row(warm_replacement=False)
    one, gang = Row(node_count=1), Row(node_count=2)

    def reserved(kind: str) -> Row:
        return Row(status="reserved", kind=kind)

    for moved_by in ("reclaimed", "below_reserve"):  # the job's node's owner, or its own bid
        assert _warms_up(reserved("migration"), one, on, moved_by)
    assert not _warms_up(reserved("migration"), one, on, "outbid")
    assert not _warms_up(reserved("migration"), one, on, None)  # its old allocation ended
    assert not _warms_up(reserved("migration"), one, off, "reclaimed")
    assert not _warms_up(reserved("migration"), gang, on, "reclaimed")
    assert not _warms_up(reserved("takeover"), one, on, "reclaimed")
    assert not _warms_up(reserved("new"), one, on, "reclaimed")
    assert not _warms_up(Row(status="preempted", kind="migration"), one, on, "reclaimed")
