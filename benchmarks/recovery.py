"""Recovery and pickup times of spot-gpu flow runs, on a real local stack; one JSON object.

    python benchmarks/recovery.py [--trials 5]

A real Prefect server (the test harness's), the market service, two agents with declared GPUs
and two spot-gpu workers side by side: ours (asks for scheduled runs every second) and the same
worker at Prefect's default poll of 10 s, the naive way. Per trial: a flow run of the test
flow is scheduled, bid for, runs, its node is reclaimed mid-run, it saves, stops, and runs
again on the other node (the migration reservation). Measured, medians over the trials:

  pickup_s            flow run created (Scheduled, now) -> bid placed in the market
  resume_after_stop_s the job stopped on the reclaimed node -> the flow run Running again on
                      the other node (target <= 10 s)
  reclaim_to_running_s  the owner's reclaim -> Running again (adds the notice and final save)

Then the start-up cost of a job, cold against warm (--setup-seconds, default 1 10 30: the flow's
``@warm_up`` set-up sleeps that long; its final save takes --final-save-seconds more, default
10, a stand-in for a large state's write), each with our worker, --warm-trials trials:

  cold: the market gives the migration target its job only once it runs (warm_replacement
        off): the set-up is paid after the old job stopped;
  warm: the target starts its job at the notice, runs the set-up while the old job saves and
        waits for its go (warm_replacement on, the default).

Per trial, the timeline of the resume (seconds after the reclaim): reserved (the target held),
warm (the target's set-up done), durable (the final save acknowledged: the old allocation
ended), restored (the flow restored on the target), running (Prefect's Running). Target:
reclaim -> running <= final-save time + 2 s, whatever the start-up cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from uuid import UUID

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"  # the flow the end-to-end tests deploy


def main() -> None:
    parser = argparse.ArgumentParser(description="spot-gpu recovery benchmark")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warm-trials", type=int, default=3)
    parser.add_argument("--setup-seconds", type=float, nargs="*", default=[1.0, 10.0, 30.0])
    parser.add_argument("--final-save-seconds", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="spotgpu-bench-prefect-"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from prefect_spotgpu.cli.stack import LocalStack

    home = Path(tempfile.mkdtemp(prefix="spotgpu-bench-recovery-"))
    results, startup = {}, {}
    with prefect_test_harness(server_startup_timeout=180):  # noqa: SIM117 - the URL exists inside
        with LocalStack(home, PREFECT_API_URL.value(), heartbeat_timeout_seconds=10) as stack:
            stack.start_market()
            for name in ("node-a", "node-b"):
                stack.start_agent(name)
            for label, query_seconds in (("ours_1s_poll", None), ("prefect_default_10s_poll", 10)):
                pool = stack.create_pool(f"bench-{label.split('_')[0]}", defaults={"gpu_count": 2})
                deployment = stack.deploy("spot_flow.py:spot_count", TESTS, "bench", pool)
                if query_seconds is not None:
                    os.environ["PREFECT_WORKER_QUERY_SECONDS"] = str(query_seconds)
                worker = f"worker-{label}"
                stack.start_worker(pool, name=worker)
                os.environ.pop("PREFECT_WORKER_QUERY_SECONDS", None)
                samples = [
                    trial(stack, deployment, home / f"{label}-{i}.jsonl", label, i)
                    for i in range(args.trials)
                ]
                stack.kill(worker)
                results[label] = summarise(samples)
            for mode in ("cold", "warm"):
                os.environ["SPOTGPU_WARM_REPLACEMENT"] = "true" if mode == "warm" else "false"
                stack.restart_market()
                startup[mode] = {
                    f"{setup:g}s": startup_trials(
                        stack, home, mode, setup, args.warm_trials, args.final_save_seconds
                    )
                    for setup in args.setup_seconds
                }
    ours, naive = results["ours_1s_poll"], results["prefect_default_10s_poll"]
    report = {
        "benchmark": "recovery",
        "trials": args.trials,
        "machine": f"{os.cpu_count()} cores",
        **results,
        "resume_speedup_vs_default_poll": round(
            naive["resume_after_stop_s"]["median"] / ours["resume_after_stop_s"]["median"], 2
        ),
        "pickup_speedup_vs_default_poll": round(
            naive["pickup_s"]["median"] / ours["pickup_s"]["median"], 2
        ),
        "targets": {"resume_after_stop_s": 10.0, "pickup_s": 2.0},
        "met": ours["resume_after_stop_s"]["median"] <= 10.0 and ours["pickup_s"]["median"] <= 2,
        "final_save_seconds": args.final_save_seconds,
        "startup_cold_vs_warm": startup,
        "warm_reclaim_to_running_minus_final_save_s": {
            setup: figures["reclaim_to_running_minus_durable_s"]
            for setup, figures in startup.get("warm", {}).items()
        },
        "warm_target_met": all(
            f["reclaim_to_running_minus_durable_s"] <= 2.0 for f in startup.get("warm", {}).values()
        ),
    }
    print(json.dumps(report, indent=2))


def trial(
    stack, deployment: str, progress: Path, label: str, i: int, timeline: Path | None = None
) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from prefect_spotgpu.cli.stack import wait_for as wait_for_every_50ms

    def wait_for(predicate, timeout):  # polls as the earlier runs did: 10 times a second
        return wait_for_every_50ms(predicate, timeout, interval=0.1)

    market, owner = stack.market(), stack.market(stack.owner_key)
    with get_client(sync_client=True) as prefect:
        run = prefect.create_flow_run_from_deployment(
            UUID(deployment),
            parameters={"steps": 100000, "step_seconds": 0.05, "progress": str(progress)},
        )
        bid_id = wait_for(lambda: prefect.read_flow_run(run.id).labels.get("spotgpu.bid"), 60)
        placed = datetime.fromisoformat(market.get(f"/bids/{bid_id}").json()["created_at"])
        first = int(wait_for(lambda: _running_on(prefect, run.id), 120))
        wait_for(lambda: progress.exists() and progress.read_text().count('"step"') >= 20, 60)
        node = market.get(f"/allocations/{first}").json()["node_id"]
        reclaimed_at = time.time()
        owner.patch(f"/nodes/{node}", json={"state": "reclaimed"})
        second = int(
            wait_for(lambda: (a := _running_on(prefect, run.id)) and a != str(first) and a, 120)
        )
        states = prefect.read_flow_run_states(run.id)
        running_again = [s for s in states if s.is_running()][-1].timestamp.timestamp()
        stopped = market.get(f"/allocations/{first}").json()["ended_at"]
        events = market.get(f"/bids/{bid_id}/events").json()["events"]
        prefect.set_flow_run_state(run.id, Cancelling(), force=True)
        wait_for(lambda: prefect.read_flow_run(run.id).state.is_cancelled(), 60)
        owner.patch(f"/nodes/{node}", json={"state": "live"})
        wait_for(lambda: market.get(f"/allocations/{second}").json()["status"] != "running", 60)
    sample = {
        "pickup_s": round((placed - run.created).total_seconds(), 3),
        "resume_after_stop_s": round(running_again - stopped, 3),
        "reclaim_to_running_s": round(running_again - reclaimed_at, 3),
    }
    if timeline is not None:
        sample.update(resume_timeline(events, progress, timeline, second, reclaimed_at))
        sample["reclaim_to_durable_s"] = round(stopped - reclaimed_at, 3)
        sample["reclaim_to_running_minus_durable_s"] = round(running_again - stopped, 3)
        sample["timeline"]["running"] = round(running_again - reclaimed_at, 3)
    print(f"{label} trial {i}: {sample}", file=sys.stderr)
    return sample


def startup_trials(
    stack, home: Path, mode: str, setup: float, trials: int, final_save: float
) -> dict:
    """Trials of a reclaim of a job whose set-up takes ``setup`` seconds and whose final save
    takes ``final_save`` more (a large state's write); medians."""
    name = f"{mode}-{setup:g}".replace(".", "-")
    warm_log = home / f"warm-{name}.jsonl"
    env = {
        "SPOTGPU_TEST_SETUP_SECONDS": str(setup),
        "SPOTGPU_TEST_FINAL_SAVE_SECONDS": str(final_save),
        "SPOTGPU_TEST_WARM_LOG": str(warm_log),
    }
    pool = stack.create_pool(f"bench-{name}", defaults={"gpu_count": 2, "env": env})
    deployment = stack.deploy("spot_flow.py:spot_count", TESTS, "bench", pool)
    worker = f"worker-{name}"
    stack.start_worker(pool, name=worker)
    samples = []
    for i in range(trials):
        progress = home / f"{name}-{i}.jsonl"
        sample = trial(stack, deployment, progress, name, i, timeline=warm_log)
        samples.append(sample)
    stack.kill(worker)
    keys = ("reclaim_to_running_s", "reclaim_to_durable_s", "reclaim_to_running_minus_durable_s")
    figures = {k: round(statistics.median(s[k] for s in samples), 3) for k in keys}
    return {**figures, "timelines": [s["timeline"] for s in samples]}


def _running_on(prefect, run_id) -> str | None:
    run = prefect.read_flow_run(run_id)
    return run.labels.get("spotgpu.allocation") if run.state.is_running() else None


def resume_timeline(events, progress: Path, warm_log: Path, target: int, t0: float) -> dict:
    """Seconds after the reclaim: the target reserved, warm, the final save durable, the
    flow restored on the target (its first progress line there)."""

    def lines(path: Path) -> list[dict]:
        text = path.read_text() if path.exists() else ""
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    def at(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds - t0, 3)

    reserved = next(
        (e for e in events if e["kind"] == "reserved" and e["allocation_id"] == target), None
    )
    warm = [e["t"] for e in lines(warm_log) if e.get("warm") == str(target)]
    restored = [e["t"] for e in lines(progress) if e.get("alloc") == str(target)]
    durable = next(
        (e for e in events if e["kind"] == "preempted" and e["allocation_id"] != target), None
    )
    return {
        "timeline": {
            "reserved": at(reserved and datetime.fromisoformat(reserved["created_at"]).timestamp()),
            "warm": at(warm[0] if warm else None),
            "durable": at(durable and datetime.fromisoformat(durable["created_at"]).timestamp()),
            "restored": at(restored[0] if restored else None),
        }
    }


def summarise(samples: list[dict]) -> dict:
    keys = ("pickup_s", "resume_after_stop_s", "reclaim_to_running_s")
    return {
        key: {
            "median": round(statistics.median(s[key] for s in samples), 3),
            "min": min(s[key] for s in samples),
            "max": max(s[key] for s in samples),
            "samples": [s[key] for s in samples],
        }
        for key in keys
    }


if __name__ == "__main__":
    main()
