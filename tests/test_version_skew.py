"""Version skew between the market, its agents and its workers (service/versions.py,
docs/operators/version-skew.md): the policy on plain data, then an older agent's and an older
worker's recorded messages sent to the real service (SQLite and PostgreSQL), a client too old
refused naming the upgrade, a newer one's unknown field refused naming it (and the agent's
heartbeat sent again without), and each node's agent version recorded."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid

import httpx
import pytest

import prefect_spotgpu
from conftest import one_database
from conftest import wait_for as wait
from prefect_spotgpu import api_client as client_module
from prefect_spotgpu.agent.heartbeat import NodeImages, send_heartbeat
from prefect_spotgpu.api_client import api_client, async_api_client
from prefect_spotgpu.messages import (
    AllocationResponse,
    BidRequest,
    EventsPage,
    JobSpec,
    NodeResponse,
    VersionRefusal,
)
from prefect_spotgpu.protocol import TELEMETRY_AGENT_VERSION, VERSION_HEADER
from prefect_spotgpu.service.versions import (
    UNVERSIONED_AGENT,
    Release,
    Skew,
    judge,
    oldest_accepted,
)
from prefect_spotgpu.worker.market_api import MarketApi, MarketError, is_transient

# ------------------------------------------------------------------ the policy, on data


@pytest.mark.parametrize(
    ("sent", "market", "agent", "skew"),
    [
        ("0.4.1", "0.4.0", True, Skew.SAME),
        ("0.3.9", "0.4.0", True, Skew.OLDER),  # N-1: accepted
        ("0.3.0rc1", "0.4.0", False, Skew.OLDER),  # a pre-release counts as its release
        ("0.2.7", "0.4.0", True, Skew.TOO_OLD),  # N-2: refused
        ("0.2.7", "0.4.0", False, Skew.TOO_OLD),  # a worker or the CLI alike
        ("0.5.0", "0.4.0", True, Skew.NEWER),  # the market upgraded first: a newer client copes
        ("1.0.0", "0.4.0", False, Skew.NEWER),
        ("0.9.0", "1.0.2", True, Skew.TOO_OLD),  # another major: refused
        ("0.1", "0.1.0", True, Skew.SAME),
        (None, "0.4.0", False, Skew.UNVERSIONED),  # curl, a tenant's script: the REST API
        (None, "0.1.3", True, Skew.SAME),  # an agent from before the header: taken as 0.1.0
        (None, "0.2.0", True, Skew.OLDER),  # ... accepted one minor on
        (None, "0.3.0", True, Skew.TOO_OLD),  # ... and refused two on
    ],
)
def test_the_policy_accepts_n_minus_one_and_anything_newer(sent, market, agent, skew):
    verdict = judge(sent, Release.parse(market), agent=agent)
    assert verdict.skew is skew
    assert verdict.accepted is (skew is not Skew.TOO_OLD)
    assert verdict.unversioned is (sent is None and agent)


@pytest.mark.parametrize("sent", ["", "latest", "1", "v0.2.0", "0.2.0; DROP", "0." + "9" * 7])
def test_a_header_that_is_no_version_is_refused(sent):
    with pytest.raises(ValueError, match="is not a version"):
        judge(sent, Release(0, 4), agent=False)


def test_the_oldest_release_accepted_stays_in_the_markets_major():
    assert [str(oldest_accepted(Release.parse(v))) for v in ("0.4.2", "0.0.9", "2.0.0")] == [
        "0.3.0",
        "0.0.0",
        "2.0.0",
    ]
    assert str(Release.parse(UNVERSIONED_AGENT)) == "0.1.0"


def test_every_client_built_by_api_client_says_its_version():
    """The agent, the worker (the ``SpotMarket`` block's clients), the CLI: one header,
    spelled as the protocol spells it, with this release."""
    assert client_module.VERSION_HEADER == VERSION_HEADER
    with api_client("http://127.0.0.1:1", "sgn_x") as sync:
        assert sync.headers[VERSION_HEADER] == prefect_spotgpu.__version__
    assert async_api_client("http://127.0.0.1:1", None).headers[VERSION_HEADER] == (
        prefect_spotgpu.__version__
    )


def test_every_client_shares_one_tls_context_that_verifies():
    """httpx builds a TLS context for each client (the CA bundle loaded again: about 30 ms of
    CPU); ours share one, built once, and it still checks the market's certificate and name."""
    import ssl

    context = client_module.tls()
    assert context is client_module.tls()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    with api_client("https://127.0.0.1:1", "sgn_x") as sync:
        assert sync._transport._pool._ssl_context is context
    asynchronous = async_api_client("https://127.0.0.1:1", None)
    assert asynchronous._transport._pool._ssl_context is context


# ------------------------------------------- recorded messages of an older agent and worker
#
# As the agent and the worker of commit 23ec70b (2026-12-05) sent them: before nodes said
# their runner terms (runner, default_image, job_subnet), before bids could name
# min_node_count, before any client sent its version (so, as every 0.1.0 client did).

OLD_REGISTRATION = {
    "name": "old-agent",
    "gpu_model": "A100-80G",
    "region": "eu-west",
    "gpu_count": 1,
    "reserve_price": 0.9,
    "capacity": "spot",
    "declared": True,
    "inventory": [
        {
            "index": 0,
            "model": "A100-80G",
            "name": "declared A100-80G",
            "uuid": "declared-0",
            "memory_mb": 81920,
            "driver": None,
            "mig_mode": None,
            "ecc_errors": None,
            "throttle_reasons": [],
        }
    ],
    "address": "127.0.0.1",
}
OLD_FIRST_HEARTBEAT = {
    "telemetry": {"jobs": 0, "declared": True},
    "address": "127.0.0.1",
    "images": [],
}
OLD_HEARTBEAT = {"telemetry": {"jobs": 1, "declared": True}, "address": "127.0.0.1"}


def old_bid(run: str) -> dict:
    """The worker's ``bid_body`` of 23ec70b for one flow run: ``node_count`` always said,
    no ``min_node_count``, labels by Prefect's names."""
    return {
        "gpu_model": "A100-80G",
        "gpu_count": 1,
        "node_count": 1,
        "max_price": 1.5,
        "region": "eu-west",
        "idempotency_key": f"prefect-flow-run-{run}-1",
        "labels": {
            "prefect.flow-run-id": run,
            "prefect.flow-run-name": "tidy-otter",
            "prefect.work-pool": "spot",
        },
        "job": {
            "command": ["python", "-m", "prefect_spotgpu.launch"],
            "env": {"PREFECT_LOGGING_EXTRA_LOGGERS": "prefect_spotgpu"},
            "checkpoint_url": "s3://ckpt/runs",
        },
    }


def old_report(outcome: str, epoch: int, **fields) -> dict:
    """A report of 23ec70b's agent (``reports.py``): a checkpoint and a final save say when
    and at which step, a finished job nothing more."""
    return {"epoch": epoch, "outcome": outcome, **fields}


class OldAgent:
    """An agent as 23ec70b's talked: raw requests, no version header."""

    def __init__(self, service, token: str, node_id: int) -> None:
        self.http = service.client(token)
        self.node_id = node_id
        self.cursor = 0

    def beat(self, body: dict) -> NodeResponse:
        answer = self.http.post(f"/nodes/{self.node_id}/heartbeat", json=body)
        assert answer.status_code == 200, answer.text
        return NodeResponse.model_validate(answer.json())

    def next_event(self, kind: str, timeout: float = 30.0):
        """The node's next event of ``kind`` (long-polled, as the agent's loop does)."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            page = self.http.get(
                f"/nodes/{self.node_id}/events", params={"after": self.cursor, "timeout": 1}
            )
            assert page.status_code == 200, page.text
            events = EventsPage.model_validate(page.json())
            for event in events.events:
                self.cursor = event.id
                if event.kind == kind:
                    return event
            self.cursor = max(self.cursor, events.cursor)
        raise AssertionError(f"no {kind} event for node {self.node_id} in {timeout} s")

    def report(self, allocation_id: int, body: dict) -> AllocationResponse:
        answer = self.http.post(f"/allocations/{allocation_id}/report", json=body)
        assert answer.status_code == 200, answer.text
        return AllocationResponse.model_validate(answer.json())


def test_an_older_agent_and_worker_run_a_bid_through_a_notice_to_its_end(service):
    """The recorded messages, unversioned, on a market of this release: the old agent
    registers and heartbeats (its node live, no runner said), the old worker's bid is placed
    on it and its job handed over, a checkpoint is taken, a reclaim's notice is answered with
    a final save (the run moves, nothing compensated), and on the node again the job
    finishes: the bid ends finished, as before."""
    owner, buyer = service.tenant(), service.tenant(credit=100.0)
    service.grant_provider(owner)
    created = owner.post("/nodes", json=OLD_REGISTRATION)
    assert created.status_code == 201, created.text
    agent = OldAgent(service, created.json()["token"], created.json()["id"])
    node = agent.beat(OLD_FIRST_HEARTBEAT)
    assert (node.state, node.runner) == ("live", None)
    assert TELEMETRY_AGENT_VERSION not in node.telemetry  # it said none
    run = str(uuid.uuid4())
    placed = buyer.post("/bids", json=old_bid(run))
    assert placed.status_code == 201, placed.text
    bid = placed.json()
    assert (bid["node_count"], bid["min_node_count"]) == (1, None)

    allocated = agent.next_event("allocated")
    (assignment,) = agent.http.get(f"/nodes/{agent.node_id}/allocations").json()
    assert assignment["job"]["command"] == ["python", "-m", "prefect_spotgpu.launch"]
    assert assignment["job"]["env"] == {"PREFECT_LOGGING_EXTRA_LOGGERS": "prefect_spotgpu"}
    epoch = allocated.payload.epoch
    agent.beat(OLD_HEARTBEAT)
    saved_at = time.time()
    checkpoint = old_report("checkpoint", epoch, checkpoint_at=saved_at, step=9)
    assert agent.report(allocated.allocation_id, checkpoint).id == allocated.allocation_id
    kept = service.wait_for(  # (the tick leader applies it)
        lambda: buyer.get(f"/allocations/{allocated.allocation_id}").json()["last_checkpoint_at"],
        20,
    )
    assert kept == pytest.approx(saved_at)

    owner.patch(f"/nodes/{agent.node_id}", json={"state": "reclaimed"})
    noticed = agent.next_event("noticed")  # (a new epoch: the agent answers in it)
    assert noticed.allocation_id == allocated.allocation_id
    agent.report(
        noticed.allocation_id,
        old_report("saved", noticed.payload.epoch, checkpoint_at=time.time(), step=12),
    )
    ended = service.wait_for(
        lambda: (
            (a := buyer.get(f"/allocations/{noticed.allocation_id}").json())["end_reason"] and a
        ),
        20,
    )
    assert (ended["status"], ended["end_reason"]) == ("preempted", "final save acknowledged")
    kinds = [e["kind"] for e in buyer.get(f"/bids/{bid['id']}/events").json()["events"]]
    assert kinds[:3] == ["allocated", "noticed", "preempted"]  # what the old worker follows

    owner.patch(f"/nodes/{agent.node_id}", json={"state": "live"})
    again = agent.next_event("allocated")
    assert again.allocation_id != allocated.allocation_id
    agent.report(again.allocation_id, old_report("finished", again.payload.epoch))
    service.wait_for(lambda: buyer.get(f"/bids/{bid['id']}").json()["status"] == "finished", 20)
    entries = buyer.get("/ledger").json()["entries"]
    assert not [e for e in entries if e["kind"] == "compensation"]  # the save was made


# ------------------------------------------------------------- too old, and newer clients


def too_old_market(service, version: str = "0.3.0") -> None:
    """The narrow seam: the running service judges clients as release ``version`` would."""
    service.app.state.market_version = version


def key_of(client: httpx.Client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


def with_version(service, key: str, version: str | None) -> httpx.Client:
    """A client of ``key`` that sends ``version`` (None: no header, as curl)."""
    client = service.client(key)
    if version is not None:
        client.headers[VERSION_HEADER] = version
    return client


def refusal_of(answer: httpx.Response) -> VersionRefusal:
    assert answer.status_code == 426, answer.text
    return VersionRefusal.model_validate(answer.json())


def test_a_client_too_old_is_refused_naming_the_version_and_the_upgrade(service):
    owner, buyer = service.tenant(), service.tenant(credit=50.0)
    node, _ = service.node(owner, gpus=1)
    too_old_market(service, "0.3.0")
    beat = {"telemetry": {"jobs": 0}}
    for sent in ("0.1.0", None):  # an agent from before the header is taken as 0.1.0
        agent = with_version(service, node["token"], sent)
        refused = refusal_of(agent.post(f"/nodes/{node['id']}/heartbeat", json=beat))
        assert (refused.market_version, refused.oldest_accepted) == ("0.3.0", "0.2.0")
        assert refused.client_version == "0.1.0"
        assert refused.upgrade == 'pip install --upgrade "prefect-spotgpu==0.3.*"'
        assert "accepts agents from 0.2.0 on" in refused.detail
        assert "systemctl reload spotgpu-agent" in refused.detail
    said = with_version(service, node["token"], "0.2.4")  # N-1
    assert said.post(f"/nodes/{node['id']}/heartbeat", json=beat).status_code == 200

    body = old_bid(str(uuid.uuid4()))
    worker = with_version(service, key_of(buyer), "0.1.9")
    refused = refusal_of(worker.post("/bids", json=body))
    assert "accepts clients from 0.2.0 on; this client is 0.1.9" in refused.detail
    assert refused.upgrade in refused.detail
    assert buyer.get("/bids").json() == []  # nothing was placed
    plain = buyer.post("/bids", json=body)  # no header: curl, a tenant's own script
    assert plain.status_code == 201, plain.text
    malformed = with_version(service, key_of(buyer), "x.y").get("/bids")
    assert malformed.status_code == 400 and "is not a version" in malformed.text


def test_the_real_worker_and_agent_read_the_refusal(service, tmp_path):
    """What a refused worker and agent say: the worker's ``MarketError`` (not retried) and
    the agent's registration error carry the market's words."""
    from prefect_spotgpu.agent.agent import Agent, AgentError
    from prefect_spotgpu.agent.discovery import parse_declared
    from prefect_spotgpu.agent.runners import ProcessRunner

    owner, buyer = service.tenant(), service.tenant(credit=50.0)
    node, _ = service.node(owner, gpus=1)
    too_old_market(service, "9.9.0")
    key = key_of(buyer)
    request = BidRequest(gpu_model="A100-80G", gpu_count=1, max_price=1.0, job=JobSpec(
        command=["true"]))  # fmt: skip

    async def place():
        async with async_api_client(service.base_url, key) as http:
            await MarketApi(http).place(request)

    with pytest.raises(MarketError, match=re.escape('"prefect-spotgpu==9.9.*"')) as refused:
        asyncio.run(place())
    assert refused.value.status == 426 and not is_transient(refused.value)
    agent = Agent(market=service.base_url, token=node["token"], runner=ProcessRunner(),
                  gpus=parse_declared("A100-80G:1"), declared=True, state_dir=tmp_path / "a",
                  name=node["name"])  # fmt: skip
    with pytest.raises(AgentError, match="refuses this agent's version: this market runs"):
        agent.register()


def test_an_agent_from_before_the_header_is_accepted_one_minor_on_with_one_warning(service, caplog):
    owner = service.tenant()
    node, agent = service.node(owner, gpus=1)
    too_old_market(service, "0.2.0")
    caplog.set_level(logging.WARNING, logger="prefect_spotgpu.service")
    for _ in range(3):
        beat = agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": {"jobs": 0}})
        assert beat.status_code == 200, beat.text
    lines = [r.getMessage() for r in caplog.records if "sends no version" in r.getMessage()]
    assert lines == [
        f"node {node['id']}'s agent sends no version (an agent from before it was sent): "
        "taken as 0.1.0, accepted while this market (0.2.0) is within 1 minor release of it; "
        "upgrade it"
    ]
    said = with_version(service, node["token"], "0.1.4")  # another version: its own warning
    said.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": {"jobs": 0}})
    assert sum("runs 0.1.4, behind" in r.getMessage() for r in caplog.records) == 1


@one_database("the skew log is in memory; the requests read nothing that differs")
def test_a_caller_varying_its_version_gets_one_warning_and_no_more_memory(service, caplog):
    """The skew log keeps what it warned of by caller and kind of skew, never by the version
    sent: a tenant sending endless made-up newer versions costs one line and one entry."""
    buyer = service.tenant()
    caplog.set_level(logging.WARNING, logger="prefect_spotgpu.service")
    for n in range(200):
        answer = with_version(service, key_of(buyer), f"7.{n}.0").get("/bids")
        assert answer.status_code == 200, answer.text
    lines = [r.getMessage() for r in caplog.records if "newer than this market" in r.getMessage()]
    assert len(lines) == 1, lines[:3]
    assert len(service.app.state.skew_log._logged) == 1


def test_the_market_records_each_nodes_agent_version(service):
    """The version the agent's own client sends (``api_client``) is kept in its node's
    telemetry, shown to its owner; a later heartbeat from another release replaces it."""
    owner = service.tenant()
    node, _ = service.node(owner, gpus=1)
    with api_client(service.base_url, node["token"]) as agent:
        answer = send_heartbeat(agent, node["id"], telemetry={"jobs": 0}, images=NodeImages(list))
    assert answer.status_code == 200, answer.text
    seen = owner.get(f"/nodes/{node['id']}").json()["telemetry"]
    assert seen == {"jobs": 0, TELEMETRY_AGENT_VERSION: prefect_spotgpu.__version__}
    newer = with_version(service, node["token"], "0.2.0")
    newer.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": {"jobs": 1}})
    assert owner.get(f"/nodes/{node['id']}").json()["telemetry"][TELEMETRY_AGENT_VERSION] == (
        "0.2.0"
    )


def test_a_newer_clients_unknown_field_is_refused_naming_it_and_what_it_knows_is_taken(service):
    """A client newer than the market is accepted (no 426), but a field the market does not
    know is a 422 ``extra_forbidden`` naming it: the agent's heartbeat drops a GPU reading
    the market cannot take and is sent again; a bid says only the fields it sets."""
    owner, buyer = service.tenant(), service.tenant(credit=50.0)
    node, _ = service.node(owner, gpus=1)
    newer = "0.99.0"
    agent = with_version(service, node["token"], newer)
    reading = {"index": 0, "utilization": 30.0, "fan_speed": 40}  # a newer agent's reading
    beat = {"telemetry": {"jobs": 0, "gpus": [reading]}}
    answer = agent.post(f"/nodes/{node['id']}/heartbeat", json=beat)
    assert answer.status_code == 422, answer.text
    (issue,) = answer.json()["detail"]
    assert (issue["loc"], issue["type"]) == (
        ["body", "telemetry", "gpus", 0, "fan_speed"],
        "extra_forbidden",
    )
    sent = send_heartbeat(agent, node["id"], telemetry=beat["telemetry"], images=NodeImages(list))
    assert sent.status_code == 200, sent.text  # sent again without the GPUs' readings
    stored = owner.get(f"/nodes/{node['id']}").json()["telemetry"]
    assert stored == {"jobs": 0, TELEMETRY_AGENT_VERSION: newer}

    worker = with_version(service, key_of(buyer), newer)
    bid = BidRequest(gpu_model="A100-80G", gpu_count=1, max_price=1.0,
                     job=JobSpec(command=["true"]))  # fmt: skip
    answer = worker.post("/bids", json={**bid.body(), "priority": "high"})
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "priority"]
    assert worker.post("/bids", json=bid.body()).status_code == 201


@one_database("the agent's side; what the market decides runs on both databases above")
def test_a_running_agent_the_market_finds_too_old_leaves_its_jobs_saved_and_stopped(
    service, tmp_path, caplog
):
    """A market upgraded past what its running agents can be (two minors on): such an agent
    cannot serve, so it leaves as if stopped (its jobs get their notice, save and stop)
    rather than run jobs the market will place elsewhere once their node is lost."""
    from prefect_spotgpu.agent.runners import ProcessRunner
    from test_agent import AS_ME, make_agent

    owner, buyer = service.tenant(), service.tenant(credit=50.0)
    node, agent = make_agent(service, owner, tmp_path, runner=ProcessRunner(users=AS_ME))
    caplog.set_level(logging.ERROR, logger="prefect_spotgpu.agent")
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        noticed, trapping = tmp_path / "noticed", tmp_path / "trapping"
        job = f"trap 'touch {noticed}; exit 0' USR1; touch {trapping}; while :; do sleep 0.1; done"
        order = {"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0,
                 "job": {"command": ["sh", "-c", job]}}  # fmt: skip
        placed = buyer.post("/bids", json=order)
        assert placed.status_code == 201, placed.text
        (handle,) = wait(lambda: list(agent.jobs.values()), 20, "the job running")
        wait(trapping.exists, 20, "the job's trap set")  # (a notice before it would kill it)
        too_old_market(service, "0.3.0")  # (this agent is 0.1.0)
        running.join(timeout=30)
        assert not running.is_alive(), "the agent did not leave"
    finally:
        agent.shutdown()
        agent.shutdown()  # (twice: its jobs are killed now, if it still ran)
        running.join(timeout=10)
    assert noticed.exists() and agent.runner.poll(handle) == 0  # noticed, it ended itself
    assert agent.jobs == {}
    assert any("too old for the market" in r.getMessage() for r in caplog.records)
    # and the market knows it at once (its leave and reports are not refused for the version):
    # the node taken back, the job's end reported, nothing billed past it
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == "reclaimed"
    allocations = f"/bids/{placed.json()['id']}/allocations"
    ended = wait(lambda: [a for a in buyer.get(allocations).json() if a["ended_at"]], 10, "the end")
    assert ended[0]["status"] == "finished", ended  # (it exited 0 at its notice, no save)
