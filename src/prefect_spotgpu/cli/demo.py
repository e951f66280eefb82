"""``spotgpu demo``: the whole stack on this machine, and a pretraining run that survives a reclaim.

It starts a Prefect server (with its UI), the market service on SQLite, two node agents with
declared GPUs and a ``spot-gpu`` worker; deploys the example flows (deployments/prefect.yaml);
runs the pretraining flow; reclaims its node mid-run; and prints the timeline (bid,
allocation, notice, final save, resume, completion) and the cost against on-demand. Ctrl-C
stops every process it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prefect_spotgpu.cli.stack import LocalStack
from prefect_spotgpu.economics.schedules import aware
from prefect_spotgpu.market import NodeState
from prefect_spotgpu.messages import (
    AllocationResponse,
    BidResponse,
    EventResponse,
    EventsPage,
    NodeResponse,
)
from prefect_spotgpu.protocol import LABELS, AllocationStatus, EventKind, EventPlacement, RunState

GPU_MODEL = "A100-80G"
STEP_LOG = re.compile(r"step (\d+)/(\d+) loss ([0-9.]+)")
FINAL_SAVE_LOG = re.compile(r"final checkpoint of \S+ at step (\d+): ([0-9.]+) MB in ([0-9.]+) s")


class DemoError(RuntimeError):
    """The demo could not go on; the message says why and where to look."""


@dataclass
class Moment:
    at: float  # unix time
    what: str
    detail: str = ""


REPOSITORY_VARIABLE = "spotgpu_repository"
"""The Prefect variable deployments/prefect.yaml's ``git_clone`` pull step clones."""


def find_project(start: Path | None = None) -> Path:
    """The clone's root (it has deployments/prefect.yaml), from ``start`` upwards or from
    this package's own location (an editable install)."""
    candidates = [start or Path.cwd()]
    candidates.append(Path(__file__).resolve().parent)
    for base in candidates:
        for directory in (base, *base.parents):
            if (directory / "deployments" / "prefect.yaml").is_file() and (
                directory / "flows" / "pretrain.py"
            ).is_file():
                return directory
    raise DemoError(
        "run `spotgpu demo` in a clone of prefect-spotgpu: it deploys the example flows in "
        "flows/ with deployments/prefect.yaml"
    )


def run_demo(
    console: Console,
    home: Path,
    steps: int = 500,
    keep_running: bool = True,
    prefect_database_url: str | None = None,
) -> dict:
    """Bring the stack up, run the pretraining flow through a reclaim, print the timeline."""
    project = find_project()
    home.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: stop what the demo started
        signal.signal(sig, _interrupt)
    with LocalStack(home, gpu_model=GPU_MODEL, region="local") as stack:
        try:
            ui = _bring_up(console, stack, project, home, prefect_database_url)
            summary = _pretrain_with_a_reclaim(console, stack, ui, steps)
            if keep_running:
                console.print(
                    f"\nThe stack keeps running: Prefect UI {ui}, market dashboard "
                    f"{stack.market_url}/dashboard (sign in with {stack.buyer_key} to see the "
                    "demo's bids). [bold]Ctrl-C[/bold] stops everything."
                )
                while True:
                    time.sleep(1)
            return summary
        except KeyboardInterrupt:
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a second one: wait
                signal.signal(sig, signal.SIG_IGN)
            console.print("\n[yellow]Ctrl-C: stopping every process the demo started[/yellow]")
            return {}
        finally:
            console.print(f"Logs of every process: {stack.logs}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _bring_up(
    console: Console, stack: LocalStack, project: Path, home: Path, database_url: str | None
) -> str:
    with console.status("Starting the Prefect server (its UI too)...") as status:
        api = stack.start_prefect_server(database_url=database_url)
        ui = api.removesuffix("/api")
        console.log(f"Prefect server and UI at [link={ui}]{ui}[/link]")
        status.update("Starting the market service (SQLite)...")
        stack.start_market()
        console.log(f"Market service at {stack.market_url} (database {home / 'market.db'})")
        for name in ("node-a", "node-b"):
            status.update(f"Starting the node agent {name}...")
            stack.start_agent(name, gpus=2, reserve_price=0.9)
            console.log(f"Agent {name}: 2 x {GPU_MODEL} (declared), reserve 0.90 per GPU-hour")
        status.update("Creating the spot-gpu work pool and its blocks...")
        stack.create_pool("spot", checkpoint_dir=home / "checkpoints")
        status.update("Deploying the example flows (prefect deploy --all)...")
        # the deployments' pull step clones the repository this variable names: this clone
        with stack._prefect_settings():
            from prefect.variables import Variable

            Variable.set(REPOSITORY_VARIABLE, project.as_uri(), overwrite=True)
        deployed = subprocess.run(
            [
                *(sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"),
                *("--prefect-file", str(project / "deployments" / "prefect.yaml")),
            ],
            cwd=project,
            env={**os.environ, "PREFECT_API_URL": stack.prefect_api_url, "PWD": str(project)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if deployed.returncode != 0:
            raise DemoError(f"prefect deploy failed:\n{deployed.stdout[-2000:]}{deployed.stderr}")
        console.log(
            "Deployed pretrain-nightly, pretrain-gang-nightly, clean-nightly, render-nightly "
            "(night-only)"
        )
        status.update("Starting the spot-gpu worker...")
        stack.start_worker("spot")
        console.log("Worker started: prefect worker start --pool spot --type spot-gpu")
    return ui


def _pretrain_with_a_reclaim(console: Console, stack: LocalStack, ui: str, steps: int) -> dict:
    from prefect.client.orchestration import get_client

    market, owner = stack.market(), stack.market(stack.owner_key)
    nodes = {n.id: n.name for n in map(NodeResponse.model_validate, owner.get("/nodes").json())}
    moments: list[Moment] = []
    with stack._prefect_settings(), get_client(sync_client=True) as prefect:
        deployment = prefect.read_deployment_by_name("pretrain/pretrain-nightly")
        run = prefect.create_flow_run_from_deployment(
            deployment.id,
            parameters={"steps": steps, "checkpoint_minutes": 0.05},
            job_variables={  # now, not tonight: it is a demo; logs reach the UI quickly
                "cheap_window_only": False,
                "env": {"PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3"},
            },
        )
        url = f"{ui}/runs/flow-run/{run.id}"
        console.print(
            f"\nFlow run [bold]{run.name}[/bold] of pretrain-nightly: {steps} steps on "
            f"1 x {GPU_MODEL}, now (cheap_window_only off)\n  {url}"
        )
        moments.append(Moment(run.created.timestamp(), "flow run created", "Scheduled"))
        reclaimed = None
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("Scheduled", total=steps, info="")
            deadline = time.monotonic() + 900
            while True:
                flow_run = prefect.read_flow_run(run.id)
                state = flow_run.state
                logs = _logs(prefect, run.id)
                step, loss = _last_step(logs)
                progress.update(
                    task,
                    completed=step,
                    description=f"{state.name:<12}",
                    info=f"loss {loss:.3f}" if loss else "",
                )
                allocation = flow_run.labels.get(LABELS.ALLOCATION)
                if reclaimed is None and state.is_running() and step >= steps * 0.4:
                    reply = market.get(f"/allocations/{allocation}").json()
                    node = AllocationResponse.model_validate(reply).node_id
                    owner.patch(f"/nodes/{node}", json={"state": NodeState.RECLAIMED})
                    reclaimed = time.time()
                    moments.append(
                        Moment(
                            reclaimed, "owner reclaims the node", f"{nodes[node]}, at step {step}"
                        )
                    )
                    progress.console.log(f"Reclaimed {nodes[node]} at step {step}")
                if state.is_final() and not state.is_crashed():
                    break
                crashed_for = time.time() - state.timestamp.timestamp()
                if state.is_crashed() and crashed_for > 30:  # not a preemption: a real crash
                    raise DemoError(
                        f"the run crashed: {state.message}\n{url}\n"
                        f"job logs: {stack.home}/agent-*/alloc-*/job.log"
                    )
                if time.monotonic() > deadline:
                    raise DemoError(f"the run did not finish in 15 minutes: {url}")
                time.sleep(0.5)
        if not state.is_completed():
            raise DemoError(f"the run ended {state.name}: {state.message}\n{url}")
        states = prefect.read_flow_run_states(run.id)
        logs = _logs(prefect, run.id)
        bid_id = flow_run.labels[LABELS.BID]
    allocations = _ended_allocations(market, bid_id)
    bid = BidResponse.model_validate(market.get(f"/bids/{bid_id}").json())
    page = market.get(f"/bids/{bid_id}/events", params={"after": 0, "timeout": 0}).json()
    events = EventsPage.model_validate(page).events
    moments += _timeline(bid, events, states, logs, nodes, allocations)
    summary = _cost(allocations, bid)
    _print(console, sorted(moments, key=lambda m: m.at), summary, url, run.created.timestamp())
    return {"flow_run": str(run.id), "state": state.name, **summary}


def _ended_allocations(market, bid_id, seconds: float = 30.0) -> list[AllocationResponse]:
    """The bid's allocations once none holds GPUs: the run is Completed a moment before its
    job exits and its allocation stops paying. Then the cost printed is the one the worker's
    cost artifact shows in the Prefect UI (published when the allocation has ended)."""
    deadline = time.monotonic() + seconds
    while True:
        listed = market.get(f"/bids/{bid_id}/allocations").json()
        allocations = [AllocationResponse.model_validate(a) for a in listed]
        held = [a for a in allocations if AllocationStatus(a.status).holds_gpus()]
        if not held or time.monotonic() > deadline:
            return allocations
        time.sleep(0.2)


def _logs(prefect, run_id) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    return prefect.read_logs(
        log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
        sort=LogSort.TIMESTAMP_ASC,
        limit=200,
    )


def _last_step(logs) -> tuple[int, float | None]:
    for log in reversed(logs):
        match = STEP_LOG.search(log.message)
        if match:
            return int(match[1]), float(match[3])
    return 0, None


def _timeline(
    bid: BidResponse,
    events: list[EventResponse],
    states,
    logs,
    nodes: dict,
    allocations: list[AllocationResponse],
) -> list[Moment]:
    moments = [Moment(_ts(bid.created_at), "bid placed", _bid_text(bid))]
    for e in events:
        node = nodes.get(e.node_id, e.node_id)
        what = {
            EventKind.ALLOCATED: "GPUs allocated"
            if e.payload.placement == EventPlacement.NEW
            else "resumes on the reserved node",
            EventKind.RESERVED: "migration target reserved",
            EventKind.NOTICED: "notice (SIGUSR1, webhook, Prefect event)",
            EventKind.PREEMPTED: "job stopped",
            EventKind.FINISHED: "job finished",
        }.get(e.kind, e.kind)
        detail = f"{node}, allocation {e.allocation_id}"
        if e.kind == EventKind.NOTICED:
            detail += f", deadline in {e.payload.deadline - e.payload.at:.0f} s"
        if e.kind == EventKind.PREEMPTED:
            detail += f" ({e.payload.reason})"
        moments.append(Moment(_ts(e.created_at), what, detail))
    running = 0
    for s in states:
        if s.is_running():
            running += 1
            moments.append(Moment(s.timestamp.timestamp(), "Running", f"attempt {running}"))
        elif s.name in (*RunState, "Completed", "Crashed"):
            message = s.message or ""
            if len(message) > 80:
                message = message[:80].rsplit(" ", 1)[0] + " ..."
            moments.append(Moment(s.timestamp.timestamp(), s.name, message))
    saves = [FINAL_SAVE_LOG.search(log.message) for log in logs]
    saves = [m for m in saves if m]  # the checkpoint library's own log lines, when they arrived
    notices = {e.allocation_id: e.payload.at for e in events if e.kind == EventKind.NOTICED}
    for a in allocations:  # the market's record of each acknowledged final save
        if a.final_save == "ok" and a.last_checkpoint_at:
            detail = f"{a.last_checkpoint_at - notices.get(a.id, a.started_at):.2f} s "
            detail += "after the notice"
            if saves:
                match = saves.pop(0)
                detail += f": step {match[1]}, {float(match[2]):.1f} MB in {float(match[3]):.2f} s"
            moments.append(Moment(a.last_checkpoint_at, "final save durable", detail))
    return moments


def _cost(allocations: list[AllocationResponse], bid: BidResponse) -> dict:
    from prefect_spotgpu.worker.report import bid_costs

    c = bid_costs(bid, allocations)
    return {
        "gpu_seconds": round(c.gpu_hours * 3600, 1),
        "spot_cost": round(c.spot_cost, 6),
        "on_demand_cost": round(c.on_demand_cost, 6),
        "saving": None if c.saving is None else round(c.saving, 3),
        "preemptions": c.preemptions,
        "final_saves_ok": c.final_saves_ok,
    }


def _print(console: Console, moments: list[Moment], cost: dict, url: str, t0: float) -> None:
    table = Table(title="Timeline", title_justify="left")
    table.add_column("t (s)", justify="right")
    table.add_column("what")
    table.add_column("detail")
    for m in moments:
        table.add_row(f"{m.at - t0:+.2f}", m.what, m.detail)
    console.print(table)
    saving = f"{cost['saving']:.0%}" if cost["saving"] is not None else "n/a"
    console.print(
        f"Cost: {cost['gpu_seconds']:.0f} GPU-seconds of {GPU_MODEL}: spot "
        f"{cost['spot_cost']:.4f} against on-demand {cost['on_demand_cost']:.4f} "
        f"([bold green]{saving} saved[/bold green]); {cost['preemptions']} preemption(s), "
        f"{cost['final_saves_ok']} with a final save (nothing lost).\nIn the Prefect UI: {url}"
    )


def _bid_text(bid: BidResponse) -> str:
    price = f"{bid.max_price:.2f}"
    return f"bid {bid.id}: {bid.gpu_count} x {bid.gpu_model} at most {price}/GPU-h"


def _ts(value: datetime) -> float:
    return aware(value).timestamp()
