"""Images a node pulls from a real registry, and what it says of them.

The registry is Debian's ``docker-registry`` on a loopback port (``docker_engine``: no
internet registry is reachable here); its image is the session's job image plus a layer of
32 MB of random bytes, which the engine lacks until it pulls it, at 10 MB/s (the registry's
``Link``: a pull of over 3 s, whatever the machine). The runner's pull reports
its progress in plain lines (bytes and layers), the agent sends them to the market as
``pulling`` reports (the bid's events, then its flow run's log) before the job starts, and the
node's heartbeat lists the image once it is there. A hostile provider cannot push garbage
through the heartbeat's ``images``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

import docker_engine
from conftest import one_database
from conftest import wait_for as wait
from prefect_spotgpu.agent.heartbeat import NodeImages, send_heartbeat
from prefect_spotgpu.agent.isolation import JobUsers
from prefect_spotgpu.agent.runners import JobFault
from prefect_spotgpu.agent.runners.docker import DockerRunner, ImageUnavailable
from prefect_spotgpu.agent.start_failures import StartFailures
from prefect_spotgpu.cli.stack import free_port
from prefect_spotgpu.protocol import PULL_REPORT_SECONDS, REPORT_DETAIL_CHARS, EventKind
from test_agent import a_market, post_job, start_agent
from test_docker_runner import request, wait_exit

PROGRESS = re.compile(
    r"^pulling (?P<ref>\S+): (?P<got>[0-9.]+) of (?P<total>[0-9.]+)\+? (B|kB|MB|GB)"
    r"( \((?P<share>[0-9]+) %\))?, (?P<done>[0-9]+) of (?P<layers>[0-9]+) layers done$"
)
BALLAST_MB = docker_engine.BALLAST_BYTES / 1e6
PULLED = re.compile(r"^pulled (?P<ref>\S+) in (?P<seconds>[0-9.]+) s \((?P<size>[^)]*)\)$")


@pytest.fixture(scope="session")
def pull_image(registry, job_image) -> Iterator[str]:
    """A reference only the registry has (the engine forgets it before each test here, and
    at the end: its random layer is the session's own)."""
    try:
        reference = docker_engine.push_pull_image(registry, job_image)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the pull test image did not build or push: {exc.stderr}", pytrace=False)
    yield reference
    docker_engine.forget_image(reference)


@pytest.fixture
def docker_runner(tmp_path, job_image) -> DockerRunner:
    return DockerRunner(
        users=JobUsers("auto"), checkpoint_root=tmp_path / "checkpoints", gpu_devices=False
    )


@pytest.mark.slow
def test_the_runner_pulls_from_the_registry_telling_how_far_then_runs_the_job(
    tmp_path, docker_runner, pull_image
):
    docker_engine.forget_image(pull_image)
    req = request(
        tmp_path, 31, ["python3", "-c", "print(open('/opt/ballast-id').read())"], pull_image
    )
    assert not docker_runner.ready(req)
    said: list[tuple[float, str]] = []
    began = time.monotonic()
    docker_runner.prepare(req, lambda line: said.append((time.monotonic(), line)))
    took = time.monotonic() - began
    lines = [line for _, line in said]
    *progress, last = lines
    assert all(len(line) <= REPORT_DETAIL_CHARS and line.isprintable() for line in lines)
    assert len(progress) >= 2, lines  # the line when the sizes are known, and more
    counts = [PROGRESS.match(line) for line in progress]
    assert all(counts), progress
    assert {m["ref"] for m in counts} == {pull_image}
    assert any(0 < float(m["got"]) < float(m["total"]) for m in counts), progress  # bytes
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(said[:-1])]
    assert all(gap >= PULL_REPORT_SECONDS for gap in gaps), gaps  # at most every 2 s
    done = PULLED.match(last)
    assert done and done["ref"] == pull_image, last
    fetched = re.fullmatch(r"([0-9.]+) MB in 1 new layer, 4 in all", done["size"])
    assert fetched, last  # the random layer (gzipped: a bit more); the rest was here
    assert BALLAST_MB <= float(fetched[1]) < 1.01 * BALLAST_MB
    assert docker_runner.ready(req)
    assert pull_image in docker_runner.local_images()
    handle = docker_runner.start(req)
    assert wait_exit(docker_runner, handle) == 0
    assert docker_runner.last_line(handle) == "spotgpu-test/pull:1"  # it ran that image
    docker_runner.stop(handle, grace=1)
    print(
        json.dumps(
            {
                "pull_seconds_from_loopback_registry": round(took, 2),
                "pulled_layer_bytes": docker_engine.BALLAST_BYTES,
                "image_bytes": _image_size(pull_image),
                "progress_lines": len(progress),
                "lines": lines,
                "setup": docker_engine.TIMINGS,
            }
        )
    )


@pytest.mark.slow
def test_an_image_the_registry_lacks_fails_at_once_naming_it(tmp_path, docker_runner, registry):
    """The registry's "no such image" is the image's fault, never the node's: a catalogue
    entry gone from its registry must not drain every node it is tried on. A registry out of
    reach is the node's (its network may be the cause)."""
    missing = f"{registry.address}/spotgpu-test/absent:1"
    req = request(tmp_path, 32, ["python3", "-c", "pass"], missing)
    said: list[str] = []
    began = time.monotonic()
    with pytest.raises(ImageUnavailable, match=re.escape(repr(missing))) as refused:
        docker_runner.prepare(req, said.append)
    assert time.monotonic() - began < 10  # never a hang
    assert "could not be pulled" in str(refused.value) and "manifest unknown" in str(refused.value)
    assert isinstance(refused.value, JobFault) and not said
    count = StartFailures(limit=1)
    assert count.failed(refused.value) is None and count.in_a_row == 0  # the node not blamed
    with pytest.raises(JobFault, match=re.escape(repr(missing))):
        docker_runner.start(req)  # a start without a prepare pulls (and fails) the same way

    unreachable = f"127.0.0.1:{free_port()}/spotgpu-test/absent:1"  # no registry answers
    with pytest.raises(ImageUnavailable, match=re.escape(repr(unreachable))) as refused:
        docker_runner.prepare(request(tmp_path, 32, ["true"], unreachable), said.append)
    assert not isinstance(refused.value, JobFault)
    assert "connection refused" in count.failed(refused.value)  # the node's: it counts


@pytest.mark.slow
def test_a_failed_container_says_its_last_line(tmp_path, docker_runner, job_image):
    no_module = (
        "import sys; print('starting', flush=True); "
        "sys.exit(\"ModuleNotFoundError: No module named 'prefect_spotgpu'\")"
    )
    handle = docker_runner.start(request(tmp_path, 33, ["python3", "-c", no_module], job_image))
    assert wait_exit(docker_runner, handle) == 1
    line = docker_runner.last_line(handle)  # its error output's last line
    assert line == "ModuleNotFoundError: No module named 'prefect_spotgpu'"
    docker_runner.stop(handle, grace=1)


def _image_size(reference: str) -> int:
    out = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Size}}", reference],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


# ---------------------------------------------------------------- a real agent and market


@contextlib.contextmanager
def docker_market(tmp_path: Path, pull_image: str):
    """A market (its catalogue holding ``pull-test``: the registry's image), a docker agent
    of 2 GPUs that lacks that image, a buyer: ``(buyer, owner, node, agent log)``."""
    docker_engine.forget_image(pull_image)
    server, admin, owner_key, buyer_key = a_market(tmp_path)
    entry = {"reference": pull_image, "framework": "Debian python3", "cuda_version": None}
    assert admin.put("/images/pull-test", json={**entry, "description": ""}).status_code == 201
    buyer, owner = server.client(buyer_key), server.client(owner_key)
    checkpoints = ("--checkpoint-root", str(tmp_path / "checkpoints"))
    agent = start_agent(
        server, owner_key, "a", tmp_path, "--runner", "docker", *checkpoints, job_user="auto"
    )
    try:
        (node,) = wait(lambda: admin.get("/nodes").json(), 30, "the agent registered")
        wait(lambda: owner.get(f"/nodes/{node['id']}").json()["images"] is not None, 15, "images")
        assert pull_image not in owner.get(f"/nodes/{node['id']}").json()["images"]
        yield buyer, owner, node, tmp_path / "agent-a.log"
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        agent.logfile.close()
        server.stop()
        docker_engine.remove_job_containers()


def job_bid(buyer, command: str) -> dict:
    """A bid for the node's 2 GPUs running ``python3 -c COMMAND`` in the catalogue's image."""
    return post_job(buyer, {"command": ["python3", "-c", command], "image": "pull-test"})


def events_of(client, bid_id: int) -> list[dict]:
    page = client.get(f"/bids/{bid_id}/events", params={"after": 0, "timeout": 0})
    return page.json()["events"]


@pytest.mark.slow
def test_a_docker_agent_pulls_a_catalogue_image_reporting_progress_then_lists_it(
    sandbox, pull_image
):
    with docker_market(sandbox, pull_image) as (buyer, owner, node, _):
        bid = job_bid(buyer, "import time; open('/spotgpu/started', 'w').write(repr(time.time()))")
        assert bid["job"]["image"] == pull_image, bid  # the catalogue name, resolved
        wait(
            lambda: buyer.get(f"/bids/{bid['id']}").json()["status"] == "finished",
            90,
            "the job pulled, run and finished",
        )
        events = events_of(buyer, bid["id"])
        pulling = [e for e in events if e["kind"] == EventKind.PULLING]
        details = [e["payload"]["detail"] for e in pulling]
        assert details and PULLED.match(details[-1]), details
        assert all(PROGRESS.match(d) for d in details[:-1]) and len(details) > 1, details
        (started_file,) = sandbox.glob("state-a/alloc-*/started")
        first_at = datetime.fromisoformat(pulling[0]["created_at"]).timestamp()
        assert first_at < float(started_file.read_text())  # progress before the job ran
        kinds = [e["kind"] for e in events]
        assert kinds.index("allocated") < kinds.index(EventKind.PULLING)
        wait(
            lambda: pull_image in (owner.get(f"/nodes/{node['id']}").json()["images"] or []),
            15,
            "the node's heartbeat listing the pulled image",
        )

        # a catalogue image without prefect-spotgpu: the job exits 1; the ending event says why
        failing = job_bid(
            buyer,
            "import sys; sys.exit(\"ModuleNotFoundError: No module named 'prefect_spotgpu'\")",
        )
        (ended,) = wait(
            lambda: [e for e in events_of(buyer, failing["id"]) if e["kind"] == "preempted"],
            60,
            "the failed job's allocation ended",
        )
        assert ended["payload"]["detail"] == (
            "exit code 1, last output: ModuleNotFoundError: No module named 'prefect_spotgpu'"
        )
        assert not [e for e in events_of(buyer, failing["id"]) if e["kind"] == "pulling"]
        buyer.post(f"/bids/{failing['id']}/cancel")
        print(json.dumps({"pulling_reports": len(pulling), "details": details}))


@pytest.mark.slow
def test_an_allocation_ended_or_noticed_while_its_image_pulls_never_starts(sandbox, pull_image):
    import docker

    client = docker.from_env()
    with docker_market(sandbox, pull_image) as (buyer, owner, node, agent_log):

        def pulling(bid):
            return [e for e in events_of(buyer, bid["id"]) if e["kind"] == EventKind.PULLING]

        def containers(bid):
            label = f"io.spotgpu.bid-id={bid['id']}"
            return client.containers.list(ignore_removed=True, all=True, filters={"label": label})

        def not_started(alloc_id: int) -> bool:
            return f"allocation {alloc_id}: ended while it was prepared" in agent_log.read_text()

        # ended: the tenant cancels while the image is being pulled
        cancelled = job_bid(buyer, "open('/spotgpu/started', 'w').close()")
        wait(lambda: pulling(cancelled), 30, "the pull under way")
        assert buyer.post(f"/bids/{cancelled['id']}/cancel").status_code == 200
        (alloc,) = buyer.get(f"/bids/{cancelled['id']}/allocations").json()
        wait(lambda: not_started(alloc["id"]), 60, "the pull over, the job not started")
        assert not containers(cancelled) and not list(sandbox.glob("state-a/alloc-*/started"))
        assert f"allocation {alloc['id']}: started" not in agent_log.read_text()

        # noticed: the owner reclaims the node while the image is being pulled; nothing ran,
        # so the allocation ends at once (not at the 300 s deadline) and is not started
        docker_engine.forget_image(pull_image)
        noticed = job_bid(buyer, "open('/spotgpu/started', 'w').close()")
        wait(lambda: pulling(noticed), 30, "the pull under way")
        reclaimed_at = time.monotonic()
        owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"})
        (ended,) = wait(
            lambda: [
                a
                for a in buyer.get(f"/bids/{noticed['id']}/allocations").json()
                if a["status"] == "preempted"
            ],
            30,
            "the noticed allocation ended",
        )
        assert time.monotonic() - reclaimed_at < 20
        assert ended["final_save"] == "failed"  # no save: none ran (not compensated)
        wait(lambda: not_started(ended["id"]), 60, "the pull over, the job not started")
        assert not containers(noticed) and not list(sandbox.glob("state-a/alloc-*/started"))
        assert f"allocation {ended['id']}: started" not in agent_log.read_text()
        buyer.post(f"/bids/{noticed['id']}/cancel")


# ---------------------------------------------------------------- a hostile provider


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # refused before the database
@pytest.mark.parametrize(
    "images",
    [
        [f"spotgpu/many:{i}" for i in range(501)],
        ["spotgpu/ok:1", "spotgpu/evil:1\n"],
        ["spotgpu/ok:1", "../../etc/passwd"],
        ["spotgpu/../../etc:1"],
        ["x" * 10_000],
        "spotgpu/not-a-list:1",
    ],
    ids=["501 images", "newline", "dot-dot", "dot-dot inside", "10 kB", "not a list"],
)
def test_a_hostile_heartbeat_is_refused_naming_images_and_writes_nothing(service, images):
    owner = service.tenant()
    node, node_client = service.node(owner, gpus=1)
    kept = ["registry.example:5000/team/pytorch:2.5"]
    assert node_client.post(f"/nodes/{node['id']}/heartbeat", json={"images": kept}).is_success
    before = owner.get(f"/nodes/{node['id']}").json()
    response = node_client.post(f"/nodes/{node['id']}/heartbeat", json={"images": images})
    assert response.status_code == 422, response.text
    assert {e["loc"][1] for e in response.json()["detail"]} == {"images"}, response.text
    after = owner.get(f"/nodes/{node['id']}").json()
    assert after["images"] == kept
    assert after["last_heartbeat_at"] == before["last_heartbeat_at"]  # nothing written


# ---------------------------------------------------------------- the heartbeat's images


def test_images_are_read_at_start_after_a_pull_and_once_a_minute_and_sent_when_changed():
    held, reads, now = ["team/a:1"], [], [0.0]

    def read():
        reads.append(now[0])
        return list(held)

    images = NodeImages(read, clock=lambda: now[0])
    assert images.to_send() == ["team/a:1"] and reads == [0.0]  # the first heartbeat
    images.accepted(["team/a:1"])
    now[0] = 30.0
    assert images.to_send() is None and reads == [0.0]  # no engine call within the minute
    held.append("team/b:2")
    images.pulled()
    assert images.to_send() == ["team/a:1", "team/b:2"] and reads == [0.0, 30.0]
    assert images.to_send() == ["team/a:1", "team/b:2"]  # not accepted yet: sent again
    images.accepted(["team/a:1", "team/b:2"])
    now[0] = 89.0
    assert images.to_send() is None and reads == [0.0, 30.0]
    now[0] = 90.0
    assert images.to_send() is None and reads == [0.0, 30.0, 90.0]  # read; unchanged


@one_database("the agent's side; the service's runs on both databases in its own tests")
def test_a_node_whose_image_list_is_refused_still_heartbeats_and_offers_it_once(driven):
    owner = driven.tenant()
    node, node_client = driven.node(owner, gpus=1)
    too_many = [f"team/many:{i}" for i in range(501)]
    images = NodeImages(lambda: too_many)
    before = owner.get(f"/nodes/{node['id']}").json()["last_heartbeat_at"]
    driven.advance(1.0)
    answer = send_heartbeat(node_client, node["id"], telemetry={"jobs": 0}, images=images)
    assert answer.status_code == 200  # sent again without the refused field
    seen = owner.get(f"/nodes/{node['id']}").json()
    assert seen["last_heartbeat_at"] > before and not seen["images"]
    assert images.to_send() is None  # not offered again until it changes
