"""A report the market did not get is sent again: a job that finishes while the market is
down is reported once it is back, and the allocation ends within seconds of its return."""

from __future__ import annotations

import time

import pytest

from conftest import wait_for as wait
from test_agent import a_market, job_bid, read_log, start_agent
from test_service_processes import Server


@pytest.mark.slow
def test_a_report_lost_in_a_market_outage_is_delivered_when_it_returns(tmp_path):
    db = f"sqlite:///{tmp_path / 'm.db'}"
    server, admin, owner_key, buyer_key = a_market(tmp_path)
    buyer = server.client(buyer_key)
    agent = start_agent(server, owner_key, "a", tmp_path)
    try:
        wait(lambda: admin.get("/nodes").json(), 30, "the agent registered")
        job_log = tmp_path / "job.jsonl"
        bid = job_bid(buyer, 60, job_log, tmp_path / "ckpt")
        wait(lambda: [e for e in read_log(job_log) if "start" in e], 30, "the job started")
        server.kill()  # the market goes down while the job runs
        wait(lambda: [e for e in read_log(job_log) if "done" in e], 30, "the job finished")
        agent_log = tmp_path / "agent-a.log"
        wait(lambda: agent_log.read_text().count("not delivered") >= 3, 30,
             "the agent's report failing, and tried again")  # fmt: skip
        server.stop()
        back = time.monotonic()
        server = Server(db, tmp_path, port=server.port)
        buyer = server.client(buyer.headers["Authorization"].removeprefix("Bearer "))
        (alloc,) = wait(
            lambda: [
                a
                for a in buyer.get(f"/bids/{bid['id']}/allocations").json()
                if a["status"] == "finished"
            ],
            30,
            "the allocation finished",
        )
        assert time.monotonic() - back < 15
        assert alloc["end_reason"] == "job finished"
        assert "not delivered" in (tmp_path / "agent-a.log").read_text()
    finally:
        agent.terminate()
        agent.wait(timeout=15)
        agent.logfile.close()
        server.stop()
