"""The service as real processes: one tick leader among replicas, and SIGKILL in a burst."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from conftest import ADMIN_KEY, free_port, wait_for
from prefect_spotgpu.api_client import tls

pytestmark = pytest.mark.slow

OVER_COMMITTED = sa.text("""
    SELECT node_id FROM allocations a JOIN nodes n ON n.id = a.node_id
    GROUP BY node_id, n.gpu_count
    HAVING SUM(CASE WHEN status IN ('running', 'noticed') THEN a.gpu_count ELSE 0 END)
           > n.gpu_count
        OR SUM(CASE WHEN status IN ('running', 'reserved') THEN a.gpu_count ELSE 0 END)
           > n.gpu_count
""")


class Server:
    def __init__(self, db_url: str, home: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "SPOTGPU_ADMIN_KEY": ADMIN_KEY,
            "SPOTGPU_HOME": str(home),
            "SPOTGPU_CHARGE_FLUSH_SECONDS": "0.5",
        }
        self.log = open(home / f"server-{self.port}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect_spotgpu.cli",
                "server",
                "start",
                "--db",
                db_url,
                "--port",
                str(self.port),
                "--tick-seconds",
                "0.2",
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(self.url + "/api/v1/health", timeout=2, verify=tls())
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"server did not start: {self.logs()}")
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/api/v1/health", timeout=5, verify=tls()).json()

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + "/api/v1",
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
            verify=tls(),
        )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]


def setup_market(server: Server, nodes: int) -> tuple[str, str]:
    with server.client(ADMIN_KEY) as admin:
        buyer = admin.post("/tenants", json={"name": "buyer", "starting_credit": 1000}).json()
        owner = admin.post("/tenants", json={"name": "owner"}).json()
        admin.put(f"/tenants/{owner['id']}/provider", json={"provider": True}).raise_for_status()
    with server.client(owner["api_key"]) as client:
        for i in range(nodes):
            assert (
                client.post(
                    "/nodes",
                    json={
                        "name": f"n{i}",
                        "gpu_model": "RTX-4090",
                        "region": "eu-west",
                        "gpu_count": 8,
                        "reserve_price": 0.3,
                    },
                ).status_code
                == 201
            )
    return buyer["api_key"], owner["api_key"]


def burst(
    servers: list[Server], key: str, accepted: list[int], stop: threading.Event, seed: int
) -> None:
    rng = random.Random(seed)
    clients = [s.client(key) for s in servers]
    while not stop.is_set():
        client = rng.choice(clients)
        body = {
            "gpu_model": "RTX-4090",
            "region": "eu-west",
            "gpu_count": rng.choice((1, 2, 4, 8)),
            "max_price": round(rng.uniform(0.3, 0.68), 2),
        }
        try:
            response = client.post("/bids", json=body)
        except httpx.HTTPError:
            time.sleep(0.05)  # that replica is gone
            continue
        if response.status_code == 201:
            accepted.append(response.json()["id"])
            if rng.random() < 0.2:  # some churn: cancels and reprices
                bid_id = rng.choice(accepted)
                try:
                    if rng.random() < 0.5:
                        client.post(f"/bids/{bid_id}/cancel")
                    else:
                        client.patch(f"/bids/{bid_id}", json={"max_price": 0.6})
                except httpx.HTTPError:
                    pass
    for c in clients:
        c.close()


def check_ledger(engine) -> None:
    """Money is exact across kills: each tenant's spent is the sum of its allocations'
    charges and its credits the sum of its ledger entries, to the micro."""
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text("""
            SELECT t.id, t.spent_micros, t.credits_micros,
                   (SELECT COALESCE(SUM(charged_micros), 0) FROM allocations
                     WHERE tenant_id = t.id),
                   (SELECT COALESCE(SUM(amount_micros), 0) FROM ledger_entries
                     WHERE tenant_id = t.id)
            FROM tenants t""")
        ).all()
    for tenant_id, spent, credits, charged, entries in rows:
        assert spent == charged, f"tenant {tenant_id}: spent"
        assert credits == entries, f"tenant {tenant_id}: credits"


def ticked(server, ticks: int) -> None:
    """Until ``server``'s tick loop has ticked ``ticks`` more times."""
    done = server.health()["ticks"] + ticks
    wait_for(lambda: server.health()["ticks"] >= done, 60, f"{ticks} ticks", 0.05)


def test_two_replicas_on_postgresql_one_leader_no_gpu_held_twice(postgres_url, tmp_path):
    from conftest import fresh_postgres_schema

    url, drop = fresh_postgres_schema(postgres_url)
    engine = sa.create_engine(url)
    servers = [Server(url, tmp_path), Server(url, tmp_path)]
    try:
        wait_for(lambda: any(s.health()["leader"] for s in servers), 30, "a leader")
        leaders = [s for s in servers if s.health()["leader"]]
        assert len(leaders) == 1, [s.health() for s in servers]
        key, _ = setup_market(servers[0], nodes=6)
        accepted: list[int] = []
        stop = threading.Event()
        violations: list = []

        def watch():
            while not stop.is_set():
                with engine.connect() as connection:
                    violations.extend(connection.execute(OVER_COMMITTED).all())
                time.sleep(0.05)

        threads = [
            threading.Thread(target=burst, args=(servers, key, accepted, stop, i)) for i in range(4)
        ] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        wait_for(lambda: len(accepted) > 100, 60, "a hundred bids accepted under load", 0.05)
        leader = next(s for s in servers if s.health()["leader"])
        follower = next(s for s in servers if s is not leader)
        leader.kill()  # the leader dies mid-load: the other replica takes over
        deadline = time.monotonic() + 15
        while not follower.health()["leader"]:
            assert time.monotonic() < deadline, "no takeover"
            time.sleep(0.1)
        ticked(follower, 20)  # the new leader ticks on under the load
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert violations == []
        assert len(accepted) > 100
        with engine.connect() as connection:
            stored = {r[0] for r in connection.execute(sa.text("SELECT id FROM bids"))}
            epochs = connection.execute(sa.text("SELECT epoch FROM tick_leader")).scalar()
            allocations = connection.execute(sa.text("SELECT COUNT(*) FROM allocations")).scalar()
        assert set(accepted) <= stored
        assert epochs >= 2 and allocations > 0
        ticked(follower, 10)  # (its charges flushed)
        check_ledger(engine)
    finally:
        for s in servers:
            s.stop()
        engine.dispose()
        drop()


def test_sigkill_during_a_bid_burst_loses_nothing(db_url, tmp_path):
    server = Server(db_url, tmp_path)
    engine = sa.create_engine(db_url)
    try:
        key, _ = setup_market(server, nodes=4)
        accepted: list[int] = []
        stop = threading.Event()
        threads = [
            threading.Thread(target=burst, args=([server], key, accepted, stop, i))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: len(accepted) > 50, 60, "fifty bids accepted under load", 0.05)
        server.kill()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert len(accepted) > 50
        server.log.close()
        server = Server(db_url, tmp_path)  # restart on the same database
        with server.client(key) as client:
            stored, response = set(), client.get("/bids", params={"limit": 1000})
            while True:  # every page, newest first, by the Link headers
                stored |= {b["id"] for b in response.json()}
                if "next" not in response.links:
                    break
                response = client.get(response.links["next"]["url"])
        assert set(accepted) <= stored, f"lost {sorted(set(accepted) - stored)[:10]}"
        ticked(server, 10)  # the restarted leader ticks on
        with engine.connect() as connection:
            assert connection.execute(OVER_COMMITTED).all() == []
        check_ledger(engine)
    finally:
        server.stop()
        engine.dispose()


def test_admin_cli_against_a_running_server(tmp_path):
    server = Server(f"sqlite:///{tmp_path / 'm.db'}", tmp_path)
    env = {
        **os.environ,
        "SPOTGPU_ADMIN_KEY": ADMIN_KEY,
        "SPOTGPU_HOME": str(tmp_path),
        "SPOTGPU_MARKET_URL": server.url,
        "COLUMNS": "200",
    }

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "prefect_spotgpu.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        out = cli("admin", "create-tenant", "alice", "--credit", "5")
        assert out.returncode == 0, out.stderr
        assert "tenant alice (id 1), balance 5.00" in out.stdout
        key = out.stdout.split("API key: ")[1].split()[0]
        with server.client(key) as client:
            assert client.get("/me").json()["name"] == "alice"
        again = cli("admin", "create-tenant", "alice")
        assert again.returncode == 1 and "409" in again.stdout and "taken" in again.stdout
        listing = cli("admin", "tenants")
        assert listing.returncode == 0 and "alice" in listing.stdout
        nowhere = cli("admin", "create-tenant", "bob", "--market", "http://127.0.0.1:9")
        assert nowhere.returncode == 1 and "cannot reach the market" in nowhere.stdout
        bad = cli("server", "start", "--db", "mysql://nope")
        assert bad.returncode == 2 and "db_url" in bad.stdout
    finally:
        server.stop()
