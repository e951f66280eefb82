"""An agent started before its market (or across a market restart) waits for it: one line a
try naming the URL, no traceback, and it registers once the market answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from conftest import one_database, start_service, wait_for
from prefect_spotgpu.cli.stack import free_port


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_an_agent_waits_for_a_market_that_is_down_and_registers_when_it_is_up(db_url, tmp_path):
    port = free_port()
    market = f"http://127.0.0.1:{port}"
    service = start_service(db_url, tmp_path / "home", port=port)
    owner = service.tenant()
    service.grant_provider(owner)
    owner_key_file = tmp_path / "owner.key"
    owner_key_file.write_text(owner.headers["Authorization"].removeprefix("Bearer "))
    service.stop()  # the market goes down (a restart, an upgrade)
    service = None
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        agent = subprocess.Popen(
            [
                *(sys.executable, "-m", "prefect_spotgpu.cli", "agent", "start"),
                *("--market", market, "--gpus", "A100-80G:1", "--name", "early"),
                *("--region", "eu-west", "--reserve-price", "0.5"),
                *("--state-dir", str(tmp_path / "state"), "--job-user", str(os.getuid())),
                *("--token-file", str(owner_key_file)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "unreachable" in log.read_text() or agent.poll() is not None, 30)
        wait_for(lambda: log.read_text().count("unreachable") >= 2 or agent.poll() is not None, 30)
        text = log.read_text()  # (a few tries)
        assert agent.poll() is None, text
        tries = [line for line in text.splitlines() if "unreachable" in line]
        assert len(tries) >= 2 and all(market in line for line in tries), text
        assert "Traceback" not in text and "httpx" not in text
        service = start_service(db_url, tmp_path / "home", port=port)  # back up
        owner = service.client(owner_key_file.read_text())
        nodes = wait_for(lambda: owner.get("/nodes").json(), 60, "the node registered")
        assert nodes[0]["name"] == "early"
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)
        if service is not None:
            service.stop()
