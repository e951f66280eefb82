"""The run's logs are whole (docs/users/watching-runs.md): the final save's line reaches the
flow run's logs in Prefect although the agent stops the job the moment it reads the
acknowledgement. Each of 10 flow runs, run by Prefect's engine as a node runs it, is noticed
(notice file, SIGUSR1) and SIGKILLed within milliseconds of its acknowledgement, as the agent
does; every run's logs hold its "final checkpoint ... at step N" line and the flow's line
before the acknowledgement."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for

HERE = Path(__file__).parent
RECLAIMS = 10

pytestmark = pytest.mark.slow


def reclaim_like_the_agent(proc: subprocess.Popen, workdir: Path, progress: Path) -> float:
    """Once the flow has counted a few steps: the notice file and SIGUSR1, then SIGKILL to
    its group as soon as the acknowledgement is there; seconds from notice to kill."""

    def counting() -> bool:
        assert proc.poll() is None, (workdir / "job.log").read_text()[-3000:]
        return progress.exists() and int(progress.read_text() or 0) >= 3

    wait_for(counting, 120, "steps")
    notice = {"deadline": time.time() + 60, "allocation_id": 1}
    (workdir / "notice.json.tmp").write_text(json.dumps(notice))
    os.replace(workdir / "notice.json.tmp", workdir / "notice.json")
    noticed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGUSR1)
    while not (workdir / "notice.json.ack").exists():
        assert proc.poll() is None, "the flow ended before its acknowledgement"
        assert time.monotonic() - noticed_at < 60, "no acknowledgement"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    return time.monotonic() - noticed_at


def test_the_final_saves_line_is_in_the_runs_logs_in_every_reclaim(prefect_api_url, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from prefect_spotgpu.protocol import JOB_ENV

    @flow(name="noticed")
    def stand_in():  # the run's flow: the engine loads the real one from its entrypoint
        pass

    runs = []
    for attempt in range(RECLAIMS):
        with get_client(sync_client=True) as client:
            run = client.create_flow_run(stand_in)
        workdir = tmp_path / f"alloc-{attempt}"
        workdir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
        env.update(
            PREFECT_API_URL=prefect_api_url,
            PREFECT__FLOW_RUN_ID=str(run.id),
            PREFECT__FLOW_ENTRYPOINT=f"{HERE / 'noticed_flow.py'}:noticed",
            PREFECT_LOGGING_EXTRA_LOGGERS="prefect_spotgpu",  # as the worker sets it
            NOTICED_PROGRESS=str(workdir / "progress"),
            **{
                JOB_ENV.CHECKPOINT_URL: str(tmp_path / "store"),
                JOB_ENV.NOTICE_FILE: str(workdir / "notice.json"),
                JOB_ENV.ACK_FILE: str(workdir / "notice.json.ack"),
                JOB_ENV.SAVED_FILE: str(workdir / "saved.json"),
            },
        )
        with open(workdir / "job.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "prefect.engine"], env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            reclaim_like_the_agent(proc, workdir, workdir / "progress")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        step = json.loads((workdir / "notice.json.ack").read_text())["step"]
        runs.append((run.id, step, workdir))

    whole = 0
    with get_client(sync_client=True) as client:
        for run_id, step, workdir in runs:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            messages = [log.message for log in logs]
            final = f"final checkpoint of flow-run-{run_id} at step {step}"
            job_log = (workdir / "job.log").read_text()
            assert final in job_log, job_log[-2000:]  # what the run's logs must also hold
            whole += any(m.startswith(final) for m in messages) and f"step {step}" in messages
    assert whole == RECLAIMS, f"the final save's line reached {whole} of {RECLAIMS} runs' logs"
