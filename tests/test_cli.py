"""The console script and the Prefect collection entry point, run as a user would."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import one_database
from prefect_spotgpu.cli.stack import free_port

ROOT = Path(__file__).resolve().parent.parent


def spotgpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_simulate_clears_rounds_and_prints_every_pool():
    out = spotgpu("simulate", "--rounds", "4")
    assert out.returncode == 0, out.stderr
    for pool in ("RTX-4090 eu-west", "RTX-4090 us-east", "A100-80G eu-west", "H100-80G us-east"):
        assert pool in out.stdout
    assert "round 4" in out.stdout and "owner reclaims node 1" in out.stdout
    assert "reclaimed, save by +300 s" in out.stdout
    assert "simulation complete" in out.stdout


def test_simulate_rejects_bad_options_with_a_clear_message():
    out = spotgpu("simulate", "--rounds", "0")
    assert out.returncode != 0
    assert "--rounds" in out.stderr


def test_models_lists_the_catalog():
    out = spotgpu("models")
    assert out.returncode == 0
    assert "A100-80G" in out.stdout and "2.10" in out.stdout and "H200" in out.stdout


def test_console_script_and_prefect_collection_are_registered():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("spotgpu") == "prefect_spotgpu.cli.app:app"
    collections = {
        e.name: e.value for e in importlib.metadata.entry_points(group="prefect.collections")
    }
    assert collections.get("prefect_spotgpu") == "prefect_spotgpu.worker"


@pytest.mark.slow
def test_clearing_benchmark_runs_and_reports_one_json_object():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "clearing.py"),
            "--sizes",
            "20000,100000",
            "--steady-ticks",
            "2",
            "--welfare-instances",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(out.stdout)
    big = report["results"][-1]
    assert big["bids"] == 100000 and big["gpus_placed_cold"] == big["gpus"]
    # gross regressions only (targets are 1 s and 0.1 s at ten times this size)
    assert big["cold_seconds_per_tick"] < 2.0
    assert big["steady_seconds_per_tick"] < 0.5
    assert report["welfare_vs_optimum"]["best-fit"]["mean"] > 0.9
    # bids that name images, half the nodes holding one: as fast, and as full (a fresh pool
    # this large is packed in bulk, images aside: test_market_images.py has the preference)
    assert big["images_gpus_placed_cold"] == big["gpus"]
    assert big["images_cold_seconds_per_tick"] < 2.0
    assert big["images_steady_seconds_per_tick"] < 0.5


# ---------------------------------------------------------------- prices, bids and nodes views


def spotgpu_at(
    service, *args: str, key: str | None = None, columns: str = "200"
) -> subprocess.CompletedProcess:
    """``spotgpu`` against the test's market, on a terminal wide enough for whole rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    env.update(COLUMNS=columns, SPOTGPU_MARKET_URL=service.base_url)
    if key is not None:
        env["SPOTGPU_API_KEY"] = key
    return spotgpu(*args, env=env)


def key_of(client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


def row(out: str, *cells: str) -> str:
    """The one table line holding every cell."""
    lines = [line for line in out.splitlines() if all(c in line for c in cells)]
    assert len(lines) == 1, (cells, out)
    return lines[0]


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8], "▁▂▃▄▅▆▇█"),
        ([8, 1], "█▁"),
        ([0.9, 0.9, 0.9], "▄▄▄"),
        ([1.5], "▄"),
        ([], ""),
        ([None, None], "  "),
        ([0, None, 7, float("nan"), 5], "▁ █ ▆"),
    ],
)
def test_sparkline_scales_between_the_series_min_and_max(values, line):
    from prefect_spotgpu.cli.views import sparkline

    assert sparkline(values) == line


def test_views_docstring_examples_and_hourly_slots():
    import doctest

    from prefect_spotgpu.cli import views

    assert doctest.testmod(views).failed == 0
    now = 1_800_000_000.0  # 2027-01-15 08:00 UTC
    bars = [
        {"hour": "2027-01-15T08:00:00Z", "close": 1.1},
        {"hour": "2027-01-15T06:00:00+00:00", "close": 0.9},
        {"hour": "2027-01-14T07:00:00", "close": 2.0},  # 25 hours ago: out of the window
    ]
    assert views.hourly_closes(bars, now=now, hours=4) == [None, 0.9, None, 1.1]
    assert views.hourly_closes(bars, now=now)[-1] == 1.1
    assert views.hourly_closes([], now=now, hours=3) == [None, None, None]
    assert views.squeeze(list(range(24)), 12) == list(range(1, 24, 2))  # an 80-column terminal
    assert views.squeeze([None, 1.0], 24) == [None, 1.0]
    assert [views.age(s) for s in (0, 59, 61, 7200, 200_000)] == ["0s", "59s", "1m", "2h", "2d"]


def test_a_reply_that_does_not_parse_ends_the_command_naming_the_field(capsys):
    """The CLI reads the market's replies as the shared vocabulary's models: an unexpected
    body is one red line naming the field (never a KeyError traceback), and markup in it is
    printed as text."""
    import typer

    from prefect_spotgpu.cli.common import parsed
    from prefect_spotgpu.messages import NodeResponse, NodeToken

    assert parsed(NodeToken, {"token": "t", "new": 1}, "POST /nodes/1/token").token == "t"
    with pytest.raises(typer.Exit) as ended:
        parsed(list[NodeResponse], [{"id": "[bold]x"}], "GET /nodes")
    assert ended.value.exit_code == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "the market's reply to GET /nodes does not parse: 0.id: Input should be a valid" in out
    with pytest.raises(typer.Exit):
        parsed(NodeToken, {}, "POST /nodes/[red]1/token")
    assert "POST /nodes/[red]1/token does not parse: token: Field required" in " ".join(
        capsys.readouterr().out.split()
    )


def test_telemetry_cells_show_what_the_agent_reported_and_dashes_otherwise():
    from prefect_spotgpu.cli.views import telemetry_cells

    gpus = [
        {"index": 0, "utilization": 80, "memory_used_mb": 2048, "temperature": 71},
        {"index": 1, "utilization": 40, "memory_used_mb": 1024, "power_w": None},
    ]
    assert telemetry_cells({"jobs": 1, "gpus": gpus}) == ("60%", "71°C", "3.0 GB")
    nvml = [{"index": 0, "utilization": None, "memory_used_mb": None, "power_w": 90.0}]
    assert telemetry_cells({"jobs": 0, "gpus": nvml}) == ("-", "-", "-")
    assert telemetry_cells({"jobs": 0, "declared": True}) == ("-", "-", "-")
    assert telemetry_cells(None) == ("-", "-", "-")


@one_database("the CLI's rendering of the API's replies")
def test_prices_shows_a_sparkline_for_spot_pools_and_fixed_for_on_demand(service):
    alice, owner = service.tenant(), service.tenant()
    service.node(owner, reserve=0.9)
    service.node(owner, gpu_model="H100-80G", region="us-east", capacity="on_demand")
    alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 2, "max_price": 1.5})
    service.wait_for(
        lambda: service.client().get("/prices/A100-80G/eu-west/hourly").status_code == 200
    )
    out = spotgpu_at(service, "prices")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "last 24 h" in out.stdout
    assert row(out.stdout, "A100-80G eu-west", "0.90").rstrip().split("│")[4].strip() == "▄"
    assert "fixed" in row(out.stdout, "H100-80G us-east (on-demand)")
    forecast = spotgpu_at(service, "prices", "--forecast", "--hours", "6")
    assert forecast.returncode == 0, forecast.stdout + forecast.stderr
    assert "fixed price" in row(forecast.stdout, "H100-80G us-east (on-demand)")
    assert "▄" in row(forecast.stdout, "A100-80G eu-west")


@one_database("the CLI's rendering of the API's replies")
def test_bids_lists_allocations_costs_and_the_balance(service):
    alice, owner = service.tenant(), service.tenant()
    node, _ = service.node(owner, reserve=0.9)
    running = alice.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 4, "max_price": 1.2, "region": "eu-west"},
    ).json()
    waiting = alice.post(
        "/bids", json={"gpu_model": "H100-80G", "gpu_count": 2, "max_price": 3.0}
    ).json()
    cancelled = alice.post(
        "/bids", json={"gpu_model": "RTX-4090", "gpu_count": 1, "max_price": 0.5}
    ).json()
    assert alice.post(f"/bids/{cancelled['id']}/cancel").status_code == 200
    service.wait_for(
        lambda: [
            a
            for a in alice.get(f"/bids/{running['id']}/allocations").json()
            if a["charged_amount"] > 0
        ],
        timeout=15,
    )
    out = spotgpu_at(service, "bids", key=key_of(alice))
    assert out.returncode == 0, out.stdout + out.stderr
    line = row(out.stdout, "A100-80G x4")
    cells = [c.strip() for c in line.split("│")[1:-1]]
    assert cells[:6] == [str(running["id"]), "A100-80G x4", "eu-west", "spot", "1.20", "open"]
    assert cells[7] == f"node {node['id']} running" and cells[8] == "0.90"
    assert float(cells[9]) > 0
    assert row(out.stdout, "H100-80G x2").split("│")[8].strip() == "-"
    assert "cancelled" in row(out.stdout, "RTX-4090 x1")
    balance = alice.get("/me").json()["balance"]
    shown = float(out.stdout.split("balance ")[1].split()[0])
    assert shown == pytest.approx(balance, abs=0.01)

    only = spotgpu_at(service, "bids", "--status", "cancelled", key=key_of(alice))
    assert only.returncode == 0, only.stdout + only.stderr
    assert "RTX-4090 x1" in only.stdout and "A100-80G x4" not in only.stdout
    latest = spotgpu_at(service, "bids", "--limit", "1", key=key_of(alice))
    assert "RTX-4090 x1" in latest.stdout and "H100-80G x2" not in latest.stdout
    assert str(waiting["id"]) not in [c.strip() for c in latest.stdout.split("│")]


@one_database("the CLI's rendering of the API's replies")
def test_nodes_shows_state_gpus_in_use_telemetry_and_heartbeat(service):
    owner, alice = service.tenant(), service.tenant()
    node, agent = service.node(owner, reserve=0.9, name="rack-7")
    other, _ = service.node(owner, gpu_model="H100-80G", region="us-east", gpus=2, reserve=2.5)
    telemetry = {
        "jobs": 1,
        "gpus": [
            {"index": i, "utilization": u, "memory_used_mb": 4096, "temperature_c": 40 + u // 2}
            for i, u in enumerate([90, 70, 0, 0, 0, 0, 0, 0])
        ],
    }
    response = agent.post(f"/nodes/{node['id']}/heartbeat", json={"telemetry": telemetry})
    assert response.status_code == 200, response.text
    alice.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 3, "max_price": 1.2})
    service.wait_for(
        lambda: [q for q in service.client().get("/prices").json() if q["gpus_running"] == 3]
    )
    out = spotgpu_at(service, "nodes", key=key_of(owner))
    assert out.returncode == 0, out.stdout + out.stderr
    cells = [c.strip() for c in row(out.stdout, "rack-7").split("│")[1:-1]]
    assert cells[:8] == [str(node["id"]), "rack-7", "A100-80G", "eu-west", "spot", "live",
                         "3/8", "1"]  # fmt: skip
    assert cells[8:12] == ["20%", "85°C", "32.0 GB", "0.90"]
    assert cells[12].endswith("s ago")
    assert row(out.stdout, other["name"]).split("│")[7].strip() == "0/2"
    assert spotgpu_at(service, "nodes", key=key_of(alice)).stdout.count("A100-80G") == 0
    everyone = spotgpu_at(service, "nodes", key="sgadm_test-admin-key-0123456789")
    assert node["name"] in everyone.stdout and other["name"] in everyone.stdout


@one_database("the CLI's rendering of the API's replies")
def test_a_bad_key_is_the_services_401_and_a_dead_market_one_line(service):
    for command in ("bids", "nodes"):
        out = spotgpu_at(service, command, key="sgk_not-a-key")
        assert out.returncode == 1
        assert out.stdout.strip() == "error 401: unknown or revoked API key or token"
    dead = f"http://127.0.0.1:{free_port()}"
    for command in ("bids", "nodes", "prices"):
        out = spotgpu_at(service, command, "--market", dead, key="sgk_x")
        assert out.returncode == 1
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"cannot reach the market at {dead}: ")
        assert "Traceback" not in out.stderr


def test_server_start_names_a_missing_postgresql_database_and_how_to_create_it(tmp_path):
    """One line, not a 490-line traceback; and postgresql:// means psycopg."""
    env = {**os.environ, "SPOTGPU_HOME": str(tmp_path)}
    missing = "postgresql://postgres@127.0.0.1:5432/spotgpu_no_such_db"
    started = subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", "server", "start", "--db", missing],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    out = started.stdout + started.stderr
    assert started.returncode == 1, out
    assert 'no database "spotgpu_no_such_db"' in out and "createdb -h 127.0.0.1" in out, out
    assert "Traceback" not in out and "psycopg2" not in out
    assert len(out.strip().splitlines()) <= 4, out


def test_a_plain_postgresql_url_uses_psycopg():
    from prefect_spotgpu.service.settings import ServiceSettings

    for url in ("postgresql://u@h/db", "postgres://u@h/db"):
        assert ServiceSettings(db_url=url).db_url == "postgresql+psycopg://u@h/db"
    with pytest.raises(ValueError, match="db_url"):
        ServiceSettings(db_url="mysql://u@h/db")


@one_database("the CLI's rendering of the API's replies")
def test_bids_and_nodes_fit_80_columns_without_cutting_values(service):
    """At 80 columns the tables wrapped their values to stubs ("…")."""
    alice, owner = service.tenant(), service.tenant()
    service.node(owner, reserve=0.9, name="a-rather-long-node-name")
    alice.post(
        "/bids",
        json={"gpu_model": "A100-80G", "gpu_count": 4, "max_price": 1.2, "region": "eu-west"},
    )
    for command, key in (("bids", key_of(alice)), ("nodes", key_of(owner))):
        out = spotgpu_at(service, command, key=key, columns="80")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "…" not in out.stdout, out.stdout
        assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout


class FakeTime:
    """``time`` for ``stack.wait_for``: its sleeps move a clock of its own, and are recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_for_eases_off_to_four_polls_a_second_unless_given_an_interval(monkeypatch):
    from prefect_spotgpu.cli import stack

    clock = FakeTime()
    monkeypatch.setattr(stack, "time", clock)
    assert stack.wait_for(lambda: clock.now >= 10 and "done", 30) == "done"
    assert clock.sleeps[0] == stack.FIRST_POLL_SECONDS  # a short wait is seen as soon as before
    assert clock.sleeps == sorted(clock.sleeps) and max(clock.sleeps) == stack.SLOWEST_POLL_SECONDS
    assert sum(clock.sleeps[:10]) < 1.5  # at full slowness from about the first second
    assert len(clock.sleeps) < 50  # ten seconds: not the 200 polls of a fixed 0.05 s

    clock.sleeps.clear()
    with pytest.raises(TimeoutError, match="waiting for a tick"):
        stack.wait_for(lambda: False, 1, "a tick", 0.002)
    assert set(clock.sleeps) == {0.002}  # an explicit interval stays fixed
