"""deployments/prefect.yaml: it loads, its night-only schedules give the expected next runs, and
``prefect deploy --all`` creates the three deployments on a real Prefect server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml
from prefect.server.schemas.schedules import CronSchedule

from prefect_spotgpu.economics.schedules import cheap_window

ROOT = Path(__file__).resolve().parent.parent
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
BERLIN = ZoneInfo("Europe/Berlin")


def deployments() -> list[dict]:
    return yaml.safe_load(PREFECT_YAML.read_text())["deployments"]


def test_three_night_only_deployments_on_the_spot_pool():
    found = {d["name"]: d for d in deployments()}
    assert set(found) == {"pretrain-nightly", "clean-nightly", "render-nightly"}
    for d in found.values():
        assert d["work_pool"]["name"] == "spot"
        variables = d["work_pool"]["job_variables"]
        assert variables["cheap_window_only"] is True
        assert variables["timezone"] == "Europe/Berlin"
        assert {"gpu_model", "gpu_count", "max_price"} <= set(variables)
        path, name = d["entrypoint"].split(":")
        assert f"def {name}(" in (ROOT / path).read_text()  # the flow function exists


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        # Wednesday noon: Wednesday, Thursday, Friday (the weekend's run), then Monday
        (datetime(2026, 12, 2, 12, tzinfo=BERLIN), [(12, 2), (12, 3), (12, 4), (12, 7)]),
        # across the spring DST change: still 18:00 local on either side
        (datetime(2027, 3, 25, 19, tzinfo=BERLIN), [(3, 26), (3, 29), (3, 30), (3, 31)]),
    ],
)
def test_the_schedules_start_runs_as_the_cheap_window_opens(start, expected):
    for d in deployments():
        (schedule,) = d["schedules"]
        cron = CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])
        dates = asyncio.run(cron.get_dates(n=4, start=start))
        local = [x.astimezone(BERLIN) for x in dates]
        assert [(x.month, x.day) for x in local] == expected
        assert all((x.hour, x.minute) == (18, 0) for x in local)
        for x in dates:  # each run starts exactly as a cheap window opens
            assert cheap_window(x, "Europe/Berlin")[0] == x


def ensure_spot_pool(name: str) -> None:
    """A spot-gpu work pool of that name, with the worker's default base job template."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from prefect_spotgpu.worker import SpotGPUWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except Exception:
            client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type="spot-gpu",
                    base_job_template=SpotGPUWorker.get_default_base_job_template(),
                )
            )


@pytest.mark.slow
def test_prefect_deploy_all_creates_them(prefect_api_url):
    from prefect.client.orchestration import get_client

    ensure_spot_pool("spot")
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "PWD": str(ROOT)}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"),
            *("--prefect-file", str(PREFECT_YAML)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with get_client(sync_client=True) as client:
        for d in deployments():
            flow_name = {"pretrain": "pretrain", "clean_pairs": "clean-pairs"}.get(
                d["entrypoint"].split(":")[1], "render-animation"
            )
            deployment = client.read_deployment_by_name(f"{flow_name}/{d['name']}")
            assert deployment.work_pool_name == "spot"
            assert deployment.job_variables["cheap_window_only"] is True
            (schedule,) = deployment.schedules
            assert schedule.schedule.cron == "0 18 * * 1-5" and schedule.active
            assert deployment.pull_steps[0]["prefect.deployments.steps.set_working_directory"][
                "directory"
            ] == str(ROOT)


def test_the_readmes_example_agents_offer_what_the_example_deployments_ask_for():
    """A newcomer who starts the README's agents and deploys prefect.yaml gets GPUs (issue 16,
    5): every deployment's model is offered by an example agent at a reserve it accepts."""
    import re

    readme = (ROOT / "README.md").read_text()
    offers = [
        (m["model"], float(m["reserve"]))
        for m in re.finditer(
            r"--gpus (?P<model>[\w-]+):\d+ [^\n]*--reserve-price (?P<reserve>[\d.]+)", readme
        )
    ]
    assert offers, "no example agent in the README"
    config = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    for deployment in config["deployments"]:
        wanted = deployment["work_pool"]["job_variables"]
        assert any(
            model == wanted["gpu_model"] and reserve <= wanted["max_price"]
            for model, reserve in offers
        ), (deployment["name"], wanted, offers)


@pytest.mark.slow
def test_a_python_deployment_from_source_with_checked_job_variables(prefect_api_url, tmp_path):
    """Issue 16 (4): ``flow.from_source(...).deploy(...)`` on a spot-gpu pool, its job variables
    from ``spot_job_variables``: a spelling the market accepts is normalised, so the pool's
    schema takes it; a typo fails at deploy time, naming it."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    from prefect_spotgpu.deploy import spot_job_variables

    ensure_spot_pool("spot-py")
    (tmp_path / "train.py").write_text(
        "from prefect import flow\n\n@flow\ndef train(steps: int = 3):\n    return steps\n"
    )
    variables = spot_job_variables(gpu_model="nvidia a100 80gb", max_price=1.1, gpu_count=2)
    deployment_id = flow.from_source(source=str(tmp_path), entrypoint="train.py:train").deploy(
        name="train-py", work_pool_name="spot-py", job_variables=variables, print_next_steps=False
    )
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
    assert deployment.work_pool_name == "spot-py"
    assert deployment.job_variables == {"gpu_model": "A100-80G", "max_price": 1.1, "gpu_count": 2}
    with pytest.raises(ValueError, match="unknown job variable 'gpu_modle'"):
        spot_job_variables(gpu_modle="A100-80G")
    with pytest.raises(ValueError, match="gpu_count"):
        spot_job_variables(gpu_count=0)
