"""The console script and the Prefect collection entry point, run as a user would."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def spotgpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_spotgpu.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
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
    assert scripts.get("spotgpu") == "prefect_spotgpu.cli:app"
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
