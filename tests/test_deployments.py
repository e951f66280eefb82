"""deployments/prefect.yaml: it loads, its night-only schedules give the expected next runs, and
``prefect deploy --all`` creates its deployments on a real Prefect server, whose pull step
(``git_clone`` of the repository the ``spotgpu_repository`` variable names) loads the flow."""

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
FIRST_HOUR = ROOT / "docs" / "get-started" / "first-hour.md"
PULL_STEP = "prefect.deployments.steps.git_clone"
REPOSITORY_TEMPLATE = "{{ prefect.variables.spotgpu_repository }}"


def deployments() -> list[dict]:
    return yaml.safe_load(PREFECT_YAML.read_text())["deployments"]


def test_night_only_deployments_on_the_spot_pool():
    found = {d["name"]: d for d in deployments()}
    assert set(found) == {
        "pretrain-nightly",
        "pretrain-gang-nightly",
        "clean-nightly",
        "render-nightly",
    }
    for d in found.values():
        assert d["work_pool"]["name"] == "spot"
        variables = d["work_pool"]["job_variables"]
        assert variables["cheap_window_only"] is True
        assert variables["timezone"] == "Europe/Berlin"
        assert {"gpu_model", "gpu_count", "max_price"} <= set(variables)
        assert "image" not in variables  # the default, "process": both kinds of node run it
        path, name = d["entrypoint"].split(":")
        assert f"def {name}(" in (ROOT / path).read_text()  # the flow function exists
    # the gang: the single pretraining run's variables (merged from the same anchor), two nodes
    gang = found["pretrain-gang-nightly"]["work_pool"]["job_variables"]
    assert gang == {**found["pretrain-nightly"]["work_pool"]["job_variables"], "node_count": 2}
    assert found["pretrain-gang-nightly"]["parameters"]["batch"] % gang["node_count"] == 0


def test_the_pull_step_clones_the_repository_a_variable_names():
    (step,) = yaml.safe_load(PREFECT_YAML.read_text())["pull"]
    assert step == {PULL_STEP: {"repository": REPOSITORY_TEMPLATE}}


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


def set_variable(name: str, value: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    with get_client(sync_client=True) as client:
        if client.read_variable_by_name(name) is None:
            client.create_variable(VariableCreate(name=name, value=value))
        else:
            client.update_variable(VariableUpdate(name=name, value=value))


@pytest.mark.slow
def test_prefect_deploy_all_creates_them(prefect_api_url, tmp_path):
    from prefect.client.orchestration import get_client

    ensure_spot_pool("spot")
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
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
            assert deployment.job_variables == d["work_pool"]["job_variables"]
            (schedule,) = deployment.schedules
            assert schedule.schedule.cron == "0 18 * * 1-5" and schedule.active
            # the variable is resolved on the node, at run time: not at deploy time
            assert deployment.pull_steps == [{PULL_STEP: {"repository": REPOSITORY_TEMPLATE}}]
        gang = client.read_deployment_by_name("pretrain/pretrain-gang-nightly")
        assert gang.job_variables["node_count"] == 2

        # On a node: the pull step clones the repository the variable names (here this
        # checkout, by its file:// URL) into the job's directory, and the flow loads from there.
        set_variable("spotgpu_repository", ROOT.as_uri())
        deployment = client.read_deployment_by_name("pretrain/pretrain-nightly")
        run = client.create_flow_run_from_deployment(deployment.id)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", LOAD_FLOW, str(run.id)],
            cwd=job_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        with get_client(sync_client=True) as client:
            client.delete_flow_run(run.id)
    assert loaded.returncode == 0, loaded.stdout[-3000:] + loaded.stderr[-3000:]
    name, cwd = loaded.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "pretrain"
    assert Path(cwd) == job_dir / ROOT.name  # git_clone's directory: the repository's name
    assert (Path(cwd) / "flows" / "pretrain.py").is_file()


LOAD_FLOW = """
import asyncio, os, sys
from prefect.client.orchestration import get_client
from prefect.flows import load_flow_from_flow_run

async def main():
    async with get_client() as client:
        flow_run = await client.read_flow_run(sys.argv[1])
        flow = await load_flow_from_flow_run(flow_run, use_placeholder_flow=False)
    print(flow.name, os.getcwd())

asyncio.run(main())
"""
"""What a node's engine does first: run the deployment's pull steps, import the entrypoint."""


def test_the_first_hours_example_agents_offer_what_the_example_deployments_ask_for():
    """A newcomer who starts the example agents of the docs' first hour and deploys
    prefect.yaml gets GPUs: every deployment's model is offered by an example agent at a
    reserve it accepts, on as many agents (nodes) as a gang asks for."""
    import re
    from collections import Counter

    # the agents' commands, each on one line (the bash block continues them with "\\")
    first_hour = FIRST_HOUR.read_text().replace("\\\n", " ")
    agents = set()  # (line, model, reserve, region): a gang's nodes share a region
    for number, line in enumerate(first_hour.splitlines()):
        gpus = re.search(r"--gpus ([\w-]+):\d+", line)
        reserve = re.search(r"--reserve-price ([\d.]+)", line)
        region = re.search(r"--region (\S+)", line)
        if "spotgpu agent start" in line and gpus and reserve:
            agents.add((number, gpus[1], float(reserve[1]), region[1] if region else "any"))
    assert agents, f"no example agent in {FIRST_HOUR}"
    for deployment in deployments():
        wanted = deployment["work_pool"]["job_variables"]
        offering = Counter(
            region
            for _, model, reserve, region in agents
            if model == wanted["gpu_model"] and reserve <= wanted["max_price"]
        )
        needed = wanted.get("node_count", 1)
        assert any(n >= needed for n in offering.values()), (deployment["name"], wanted, agents)


@pytest.mark.slow
def test_a_python_deployment_from_source_with_checked_job_variables(prefect_api_url, tmp_path):
    """``flow.from_source(...).deploy(...)`` on a spot-gpu pool, its job variables
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
