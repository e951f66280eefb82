"""``prefect_spotgpu.dask.SpotGPUCluster``: the pure rules; then, on a real ``LocalStack`` (the
market, agents as processes with declared GPUs, the process runner): the checks of its terms,
scaling and computing over TLS, foreign workers refused, an unreachable scheduler reported, the
end-to-end proof (2,000 shards through three reclaims and an agent killed with SIGKILL, every
output byte-identical to an uninterrupted run's and stored once, no recompute from a notice),
and a Prefect flow mapped over ``DaskTaskRunner`` through a reclaim, with no task run Failed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers import quote, slow_link
from prefect_spotgpu.cli.stack import LocalStack, wait_for
from prefect_spotgpu.dask import rules

TESTS = str(Path(__file__).resolve().parent)
sys.path.insert(0, TESTS)

from dask_tasks import output_name, read_log, run_shard, shard_bytes  # noqa: E402
from dask_trouble import Trouble  # noqa: E402

# ---------------------------------------------------------------- the rules


def test_bids_follow_the_target_within_the_market_width():
    place = rules.bids_to_place
    assert place(target=16, live=0, waiting=0, market_width=10) == 10
    assert place(target=16, live=10, waiting=4, market_width=10) == 6  # 4 of the 10 are taken
    assert place(target=16, live=16, waiting=0, market_width=10) == 0
    assert place(target=3, live=0, waiting=0, market_width=0) == 1  # one waits: work moves
    assert place(target=3, live=1, waiting=1, market_width=0) == 0  # never more than that
    assert place(target=0, live=0, waiting=0, market_width=9) == 0


def test_scaling_down_cancels_waiting_bids_before_retiring_workers():
    jobs = [rules.JobView("a", True, 0), rules.JobView("b", False, 1),
            rules.JobView("c", True, 2), rules.JobView("d", False, 3)]  # fmt: skip
    assert rules.jobs_to_cancel(target=3, jobs=jobs) == ("d",)
    assert rules.jobs_to_cancel(target=1, jobs=jobs) == ("d", "b", "c")
    assert rules.jobs_to_cancel(target=5, jobs=jobs) == ()


def test_worker_names_are_per_allocation_and_map_back_to_their_jobs():
    assert rules.worker_name(bid=4, allocation=9) != rules.worker_name(bid=4, allocation=10)
    assert rules.bid_of_worker("4-10") == 4
    assert rules.bid_of_worker("tls://x:1") is None and rules.bid_of_worker(7) is None
    assert rules.jobs_observed(["4-9", "4-10", "5-1"], {4: "spot-0"}) == {"spot-0"}


def test_a_notice_leaves_time_to_acknowledge():
    assert rules.retire_seconds(deadline=1300.0, now=1000.0) == 290.0
    assert rules.retire_seconds(deadline=1000.5, now=1000.0) == 1.0


def test_terms_no_node_accepts_are_named():
    quotes = [quote("a", reserve_price=0.9, clearing_price=1.1, gpus_free=2)]
    assert rules.check_terms(quotes, gpu_model="A100-80G", region="any", max_price=1.0) is None
    low = rules.check_terms(quotes, gpu_model="A100-80G", region="any", max_price=0.5)
    assert "lowest price offered is 0.9" in low
    assert "no spot node of H100-80G" in rules.check_terms(
        quotes, gpu_model="H100-80G", region="any", max_price=9
    )
    with pytest.raises(ValueError, match="A100-80G"):  # lists the models
        rules.normal_gpu_model("B300-1T")


def test_a_worker_jobs_end_names_what_to_change():
    no_dask = "exit code 1, last output: ModuleNotFoundError: No module named 'distributed'"
    said = rules.diagnose_exit(no_dask, image="cuda", scheduler="tls://h:1")
    assert "image 'cuda' has no Dask" in said
    said = rules.diagnose_exit("exit code 4, last output: x", image=None, scheduler="tls://h:1")
    assert "cannot reach the Dask scheduler at tls://h:1" in said
    assert rules.diagnose_exit("exit code 1, last output: boom", image=None, scheduler="") is None


# ---------------------------------------------------------------- a worker's last task

NOTICED_WORKER = """
import asyncio, os, sys, time
from types import SimpleNamespace

from prefect import task
from prefect.events import emit_event

from prefect_spotgpu.dask import worker_job


class Idle:  # what ``retire`` uses of a Dask worker, with nothing left running on it
    status = None
    state = SimpleNamespace(executing=(), long_running=())

    async def close_gracefully(self, reason):
        pass


if sys.argv[2] == "task":  # a task finished just before the notice: its run's id
    state = task(lambda: 7, name="last-before-the-notice")(return_state=True)
    print(state.state_details.task_run_id, flush=True)
else:  # an event only (a task run needs answers from Prefect first)
    emit_event("spotgpu.test.last-event", resource={"prefect.resource.id": "spotgpu.test"})
settings = SimpleNamespace(notice_file="/nonexistent", ack_file=sys.argv[1], name="w-1")
began = time.monotonic()
asyncio.run(worker_job.retire(Idle(), settings))
print(time.monotonic() - began, flush=True)  # (the seconds retiring took)
os._exit(0)  # (as the worker job ends: no exit hooks)
"""


def noticed_worker(tmp_path, prefect_api_url: str, what: str) -> list[str]:
    """``NOTICED_WORKER`` run with Prefect at ``prefect_api_url``: the lines it printed (the
    task run's id first, for a task; the seconds retiring took last)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", NOTICED_WORKER, str(tmp_path / "ack"), what],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PREFECT_API_URL": prefect_api_url},
    )  # fmt: skip
    assert done.returncode == 0 and (tmp_path / "ack").exists(), done.stderr[-3000:]
    return done.stdout.splitlines()


def test_a_task_finished_just_before_the_notice_is_completed_in_prefect(prefect_api_url, tmp_path):
    """A Dask worker's task that finished just before its notice: the worker retires and exits
    at once, and Prefect, which records a task run's states from the events a background
    thread sends, still gets the task's last state. Prefect is 1.5 s away here (a far API, or
    a busy machine), longer than retiring an idle worker takes: the events were still queued
    at the exit, and the task run was never even recorded."""
    from urllib.parse import urlsplit

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    api = urlsplit(prefect_api_url)
    with slow_link(api.port, delay=1.5) as port:
        far_api = api._replace(netloc=f"127.0.0.1:{port}").geturl()
        task_run_id = noticed_worker(tmp_path, far_api, "task")[0]
    with get_client(sync_client=True) as client:

        def final_state():
            try:
                state = client.read_task_run(task_run_id).state
            except ObjectNotFound:  # (its first event not yet recorded)
                return None
            return state if state.is_final() else None

        last = wait_for(final_state, 30, "the task run's last state in Prefect")
    assert last.is_completed(), last


def test_a_prefect_that_never_answers_delays_the_acknowledgement_by_seconds_only(tmp_path):
    """Sending Prefect what is left is bounded: a Prefect API that takes the connection and
    never answers holds the worker's acknowledgement ``PREFECT_SEND_SECONDS`` at most, well
    inside the margin ``retire_seconds`` leaves before the notice's deadline."""
    import socket

    from prefect_spotgpu.dask.worker_job import PREFECT_SEND_SECONDS

    with socket.create_server(("127.0.0.1", 0)) as silent:  # (listens, never accepts)
        api = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        seconds = noticed_worker(tmp_path, api, "event")[-1]
    assert float(seconds) < PREFECT_SEND_SECONDS + 2
    margin = 300.0 - rules.retire_seconds(deadline=300.0, now=0.0)  # (left after retiring)
    assert margin > PREFECT_SEND_SECONDS


# ---------------------------------------------------------------- on a real stack

GPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def stack(prefect_api_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("dask")
    with LocalStack(home, prefect_api_url, heartbeat_timeout_seconds=3) as stack:
        stack.start_market()
        stack.nodes = {
            stack.start_agent(f"node-{c}", gpus=GPUS_PER_NODE): f"node-{c}" for c in "abcd"
        }
        stack.store = home / "outputs"
        yield stack


def cluster_of(stack, **options):
    from prefect_spotgpu.dask import SpotGPUCluster

    options = {"gpu_model": "A100-80G", "max_price": 1.5, "poll_seconds": 0.5, **options}
    env = {"PYTHONPATH": TESTS, **options.pop("env", {})}
    return SpotGPUCluster(market_url=stack.market_url, api_key=stack.buyer_key, env=env, **options)


def test_the_terms_are_checked_before_any_bid(stack):
    from prefect_spotgpu.dask import SpotGPUCluster

    market = {"market_url": stack.market_url, "api_key": stack.buyer_key}
    with pytest.raises(ValueError, match=r"known models: .*A100-80G"):
        SpotGPUCluster(**market, gpu_model="Z9", max_price=1.5)
    with pytest.raises(ValueError, match=r"lowest price offered is 0\.9"):
        SpotGPUCluster(**market, gpu_model="A100-80G", max_price=0.2)
    with pytest.raises(ValueError, match="not in the market's catalogue"):
        SpotGPUCluster(**market, gpu_model="A100-80G", max_price=1.5, image="no-such-image")
    with pytest.raises(ValueError, match="an address no node can have"):
        SpotGPUCluster(**market, gpu_model="A100-80G", max_price=1.5, scheduler_host="0.0.0.0")
    assert stack.market().get("/bids").json() == []


def test_it_scales_computes_over_tls_and_refuses_foreign_workers(stack):
    from distributed import Client, Worker
    from distributed.security import Security

    with cluster_of(stack) as cluster, Client(cluster, security=cluster.security) as client:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        cluster.scale(4)
        client.wait_for_workers(4, timeout=60)
        names = {w["name"] for w in client.scheduler_info()["workers"].values()}
        bids = cluster.bids_placed
        assert len(bids) == 4 and {rules.bid_of_worker(n) for n in names} == set(bids)
        futures = client.map(run_shard, [str(stack.store)] * 40, ["tls"] * 40, range(40),
                             [0.01] * 40, [None] * 40)  # fmt: skip
        digests = client.gather(futures)
        assert digests == [hashlib.sha256(shard_bytes(i)).hexdigest() for i in range(40)]

        async def join(security, address):
            worker = Worker(address, security=security, death_timeout=2, nthreads=1)
            try:
                await asyncio.wait_for(worker, 8)
            finally:
                await worker.close()

        address = cluster.scheduler_address
        refused = [
            (Security.temporary(), address),  # another cluster's certificate
            (Security(), address.replace("tls://", "tcp://")),  # no TLS at all
        ]
        for security, where in refused:
            with pytest.raises(Exception):  # noqa: B017 - refused, however it says so
                asyncio.run(join(security, where))
        assert len(client.scheduler_info()["workers"]) == 4  # nobody else joined
        cluster.scale(1)
        wait_for(lambda: len(client.scheduler_info()["workers"]) == 1, 30, "scaled down")
        cost = cluster.cost_report()
        assert cost["bids"] == 4 and 0 < cost["spot_cost"] < cost["on_demand_cost"]
    live = [b for b in stack.market().get("/bids?status=open").json() if b["id"] in bids]
    assert live == []  # closing cancelled every bid


def test_a_scheduler_the_nodes_cannot_reach_is_reported_in_bounded_time(stack):
    started = time.monotonic()
    with cluster_of(stack, contact_address="tls://127.0.0.1:9", join_timeout=2) as cluster:
        cluster.scale(1)
        wait_for(lambda: cluster.problem, 30, "the cluster to report the unreachable scheduler")
        reported = time.monotonic() - started
        assert "cannot reach the Dask scheduler at tls://127.0.0.1:9" in cluster.problem
    assert reported < 30 and time.monotonic() - started < reported + 15, reported


def test_workers_without_dask_are_reported_in_bounded_time(stack, tmp_path):
    """A worker environment without Dask: the jobs fail as Python says it ("No module named
    'distributed'"), and the cluster stops bidding with a message naming what to change,
    never waits for workers for ever. (The process runner's jobs use the node's interpreter,
    which has Dask here: a package of that name that cannot be imported stands in for its
    absence; a Docker node's image without Dask fails the same way.)"""
    shadow = tmp_path / "no-dask" / "distributed"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'distributed'\", name='distributed')\n"
    )
    started = time.monotonic()
    no_dask = {"PYTHONPATH": f"{shadow.parent}:{TESTS}"}
    with cluster_of(stack, env=no_dask) as cluster:
        cluster.scale(2)
        wait_for(lambda: cluster.problem, 60, "the cluster to report the missing Dask")
        assert "has no Dask (distributed): use an image with prefect-spotgpu[dask]" in (
            cluster.problem
        )
        bids = cluster.bids_placed
    assert time.monotonic() - started < 90
    live = [b for b in stack.market().get("/bids?status=open").json() if b["id"] in bids]
    assert live == []  # it stopped bidding


@pytest.mark.slow
def test_two_thousand_shards_survive_three_reclaims_and_a_killed_agent(stack, tmp_path):
    """The issue's end-to-end proof: every output byte-identical to an uninterrupted run's and
    stored once; no task errs; a notice makes no work be redone (only the killed node's)."""
    from distributed import Client, as_completed

    shards, seconds, prefix = 2000, 0.02, "e2e"
    log = str(tmp_path / "work.log")
    store = stack.store
    done = []
    trouble = Trouble(
        stack, lambda: len(done),
        [("reclaim", (150, 400)), ("reclaim", (550, 800)), ("reclaim", (950, 1200)),
         ("kill", (1350, 1600))], seed=40, gpus=GPUS_PER_NODE,
    )  # fmt: skip
    started = time.monotonic()
    with cluster_of(stack) as cluster, Client(cluster) as client:
        cluster.scale(4 * GPUS_PER_NODE)
        client.wait_for_workers(6, timeout=60)
        trouble.start()
        futures = client.map(run_shard, [str(store)] * shards, [prefix] * shards, range(shards),
                             [seconds] * shards, [log] * shards, pure=False)  # fmt: skip
        index = {f.key: i for i, f in enumerate(futures)}
        pending, futures, digests = as_completed(futures), None, {}
        for future in pending:  # each result let go once read (the outputs are stored):
            digests[index[future.key]] = future.result()  # a lost worker's is not wanted
            done.append(1)  # again, so not recomputed; .result() raises if a task erred
        trouble.done.set()
        trouble.join(timeout=60)
        cost = cluster.cost_report()
    elapsed = time.monotonic() - started
    assert trouble.error is None, trouble.error
    kinds = Counter(what for _, what, _, _ in trouble.log)
    assert kinds == {"reclaim": 3, "kill": 1}, trouble.log

    from prefect_spotgpu.checkpoint.objects import LocalObjects

    objects = LocalObjects(store)
    names = [output_name(prefix, i) for i in range(shards)]
    for i, name in enumerate(names):  # the uninterrupted run's bytes, computed here
        assert objects.get(name) == shard_bytes(i), name
        assert digests[i] == hashlib.sha256(shard_bytes(i)).hexdigest()
    assert objects.names(prefix) == names
    begun, stored = read_log(log)
    assert len(stored) == len(set(stored))  # no output stored twice
    killed_at = next(at for at, what, _, _ in trouble.log if what == "kill")
    # an attempt killed between its store and its log line leaves no "stored" line (its node's
    # worker dies a moment after the agent's SIGKILL); its retry finds the output there and
    # stores nothing: such a shard was begun twice, and only the killed node's tasks can be one
    unlogged = set(range(shards)) - set(stored)
    assert len(unlogged) <= GPUS_PER_NODE, unlogged
    for shard in unlogged:
        times = sorted(at for s, at in begun if s == shard)
        assert len(times) >= 2 and times[-1] > killed_at, (shard, times, killed_at)
    seen, redone_before_kill, redone = set(), 0, 0
    for shard, at in sorted(begun, key=lambda b: b[1]):
        if shard in seen:
            redone += 1
            redone_before_kill += at < killed_at
        seen.add(shard)
    assert redone_before_kill == 0  # a notice is not a failure: nothing recomputed for it
    # after the kill Dask recomputes what the lost workers ran and what they held that is still
    # wanted: its count varies (reported, not bounded); the outputs above are stored once anyway
    assert cost["preemptions"] >= 3
    print({"shards": shards, "reclaims": kinds["reclaim"], "kills": kinds["kill"],
           "recomputed_tasks": redone, "outputs_compared": len(names),
           "seconds": round(elapsed, 1), "trouble": trouble.log, "cost": cost})  # fmt: skip


def test_a_prefect_flow_maps_over_spot_workers_and_no_task_run_fails(stack, tmp_path):
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.settings import PREFECT_API_URL
    from prefect_dask import DaskTaskRunner

    log, shards = str(tmp_path / "flow.log"), 24
    runner = DaskTaskRunner(
        cluster_class="prefect_spotgpu.dask.SpotGPUCluster",
        cluster_kwargs={
            "market_url": stack.market_url, "api_key": stack.buyer_key,
            "gpu_model": "A100-80G", "max_price": 1.5, "poll_seconds": 0.5,
            "env": {"PYTHONPATH": TESTS, "PREFECT_API_URL": PREFECT_API_URL.value()},
        },
        adapt_kwargs={"minimum": 3, "maximum": 6},
    )  # fmt: skip
    shard = task(run_shard, name="shard")
    trouble = Trouble(stack, lambda: len(read_log(log)[1]), [("reclaim", (6, 12))], seed=3)

    store = str(tmp_path / "store")

    @flow(task_runner=runner)  # (its closure travels with each task: no thread in it)
    def mapped() -> list[str]:
        return shard.map(store, "flow", list(range(shards)), 0.3, log).result()

    trouble.start()
    state = mapped(return_state=True)
    trouble.join(timeout=60)
    assert state.is_completed(), state
    assert state.result() == [hashlib.sha256(shard_bytes(i)).hexdigest() for i in range(shards)]
    assert [what for _, what, _, _ in trouble.log] == ["reclaim"]
    with get_client(sync_client=True) as client:
        mine = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))

        def task_runs():  # (Prefect records a task run's states from its events: a moment late)
            runs = client.read_task_runs(flow_run_filter=mine)
            done = len(runs) == shards and all(r.state.is_final() for r in runs)
            return runs if done else None

        runs = wait_for(task_runs, 90, f"the {shards} task runs recorded")
        costs = ArtifactFilter(key=ArtifactFilterKey(any_=["spot-dask-cost"]))
        artifacts = client.read_artifacts(artifact_filter=costs)  # (not a page of them all)
    assert {r.state.type.value for r in runs} == {"COMPLETED"}
    assert artifacts, "no spot-dask-cost artifact"


def test_the_example_flows_render_and_clean_on_spot_dask_workers(stack, tmp_path):
    """``flows/render.py``'s and ``flows/clean.py``'s Dask paths: every frame is an
    uninterrupted render's and stored once; the cleaning report and clean shards are an
    uninterrupted ``clean``'s, byte for byte."""
    from prefect.settings import PREFECT_API_URL

    flows = str(Path(TESTS).parent / "flows")
    sys.path.insert(0, flows)
    from clean import clean, clean_on_dask, make_dataset
    from render import animation, frame_name, png, render_frame, render_on_dask

    from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage
    from prefect_spotgpu.checkpoint.flow import wait_to_be_stopped
    from prefect_spotgpu.checkpoint.objects import LocalObjects

    cluster = {
        "market_url": stack.market_url, "api_key": stack.buyer_key, "gpu_model": "A100-80G",
        "max_price": 1.5, "poll_seconds": 0.5,
        "env": {"PYTHONPATH": f"{flows}:{TESTS}", "PREFECT_API_URL": PREFECT_API_URL.value()},
    }  # fmt: skip
    store = LocalObjects(tmp_path / "store")
    made = render_on_dask(str(tmp_path / "store"), "rq-dask", frames=8, cluster=cluster,
                          workers=4, width=16, height=12)  # fmt: skip
    names = [frame_name("outputs/rq-dask", i) for i in range(8)]
    assert made["frames"] == names
    assert [store.get(n) for n in names] == [png(render_frame(i, 8, 16, 12)) for i in range(8)]
    assert store.get(made["animation"]) == animation(store, names)

    make_dataset(store, pairs=120, shards=8, seed=4, prefix="outputs/pairs")
    reference = tmp_path / "reference"
    whole = clean(
        Checkpointer(LocalStorage(tmp_path / "ckpt"), "ref", every=1e9),
        store, LocalObjects(reference), wait_to_be_stopped, source_prefix="outputs/pairs",
    )  # fmt: skip
    report = clean_on_dask(str(tmp_path / "store"), "pairs", "pairs-clean", cluster=cluster,
                           workers=4)  # fmt: skip
    assert report == whole
    for path in sorted(reference.iterdir()):
        assert store.get(f"outputs/pairs-clean/{path.name}") == path.read_bytes(), path.name
