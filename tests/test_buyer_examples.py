"""The buyer pages' examples run as written: the restore example (flows/resumable_training.py)
and the fan-out child (flows/embed_corpus.py), each through a notice and a resume.

Each attempt is a process with the environment a node's agent gives a job (the agent's own
``JobRequest.job_variables``, plus what the worker adds: the run's storage, its signing key,
the flow run's id), running the flow's body; the test does what the agent does at a notice:
writes the notice file (``write_notice``), sends SIGUSR1, waits for the acknowledgement and
stops the job with SIGKILL. The flow engine around the body is the end-to-end tests' concern.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from prefect_spotgpu.agent.runners.runner import JobRequest, clear_job_files, write_notice
from prefect_spotgpu.protocol import JOB_ENV

ROOT = Path(__file__).resolve().parent.parent
FLOWS = ROOT / "flows"
sys.path.insert(0, str(FLOWS))  # the examples' own modules, as their processes import them
RUN_BODY = """
import json, sys
module = __import__(sys.argv[1])
result = getattr(module, sys.argv[2]).fn(**json.loads(sys.argv[3]))
print("RESULT " + json.dumps(result), flush=True)
"""
"""One attempt: the body of the flow ``argv[2]`` of the module ``argv[1]`` (in flows/), called
with the keyword arguments ``argv[3]``; its return value on the last line."""

pytestmark = pytest.mark.slow


class Attempt:
    """One attempt of a flow run on a node: its job's files in ``workdir``, its process."""

    def __init__(self, tmp: Path, storage: Path, run_id: str, allocation: int) -> None:
        self.request = JobRequest(
            allocation_id=allocation,
            epoch=1,
            bid_id=7,
            command=[],
            env={},
            gpu_indices=[],
            workdir=tmp / f"alloc-{allocation}",
            checkpoint_url=str(storage),
        )
        self.request.workdir.mkdir(parents=True)
        clear_job_files(self.request)
        self.env = {
            **os.environ,
            **self.request.job_variables(
                workdir=str(self.request.workdir), checkpoint_url=str(storage)
            ),
            JOB_ENV.CHECKPOINT_SIGNING_KEY: "9f" * 32,  # the worker's, the same every attempt
            "PREFECT__FLOW_RUN_ID": run_id,
            "PYTHONPATH": str(FLOWS),
            "OMP_NUM_THREADS": "1",  # one thread: a reduction split over threads may round
        }  # otherwise, on a busy machine

    def start(self, module: str, flow: str, **arguments) -> subprocess.Popen:
        self.process = subprocess.Popen(
            [sys.executable, "-c", RUN_BODY, module, flow, json.dumps(arguments)],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return self.process

    def finish(self, timeout: float = 300) -> tuple[object, str]:
        output, _ = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, output
        return json.loads(output.splitlines()[-1].removeprefix("RESULT ")), output

    def notice(self) -> None:
        """What the agent does at a notice: the notice file, then SIGUSR1."""
        write_notice(self.request, time.time() + 300)
        self.process.send_signal(signal.SIGUSR1)

    def stop_after_the_final_save(self, timeout: float = 120) -> dict:
        """What the agent does next: wait for the final save's acknowledgement, then SIGKILL;
        the acknowledgement."""
        deadline = time.monotonic() + timeout
        while not self.request.ack_file.exists():
            assert self.process.poll() is None, self.process.communicate()[0]
            assert time.monotonic() < deadline, "no acknowledgement"
            time.sleep(0.01)
        assert self.process.poll() is None, "after its final save a job waits to be stopped"
        self.process.kill()
        self.process.communicate()
        return json.loads(self.request.ack_file.read_text())

    def wait_for_a_save(self, timeout: float = 120) -> None:
        """Until the job has reported a durable checkpoint (its saved file)."""
        deadline = time.monotonic() + timeout
        while not self.request.saved_file.exists():
            assert self.process.poll() is None, self.process.communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint saved"
            time.sleep(0.005)


def test_the_restore_example_resumes_on_the_same_losses_after_a_notice(tmp_path):
    steps, arguments = 1500, {"steps": 1500, "checkpoint_minutes": 0.002}  # a save ~0.1 s
    whole = Attempt(tmp_path / "whole", tmp_path / "whole-storage", str(uuid.uuid4()), 1)
    whole.start("resumable_training", "train_classifier", **arguments)
    uninterrupted, _ = whole.finish()
    assert uninterrupted["device"] == "cpu" and len(uninterrupted["losses"]) == steps
    assert uninterrupted["final_loss"] < uninterrupted["losses"][0] / 2  # it learns

    storage, run_id = tmp_path / "storage", str(uuid.uuid4())
    first = Attempt(tmp_path / "node-a", storage, run_id, allocation=1)
    first.start("resumable_training", "train_classifier", **arguments)
    first.wait_for_a_save()
    first.notice()
    ack = first.stop_after_the_final_save()
    assert ack["durable"] is True and 0 <= ack["step"] < steps - 1, ack

    second = Attempt(tmp_path / "node-b", storage, run_id, allocation=2)  # another node
    second.start("resumable_training", "train_classifier", **arguments)
    resumed, output = second.finish()
    assert f"resuming at step {ack['step'] + 1} of {steps}" in output
    assert [x.hex() for x in resumed["losses"]] == [x.hex() for x in uninterrupted["losses"]]


def test_the_fan_out_child_stores_each_output_once_through_a_notice_and_a_retry(tmp_path):
    from embed_corpus import INPUTS, write_corpus

    from prefect_spotgpu.checkpoint.objects import LocalObjects

    storage = tmp_path / "storage"  # the run's storage, as every node reaches it
    write_corpus(LocalObjects(storage), "corpus", parts=6, rows=256)
    reference = tmp_path / "reference"  # one uninterrupted child for the whole corpus
    write_corpus(LocalObjects(reference), "corpus", parts=6, rows=256)
    shard = {"source": "corpus", "out": "night-1", "first": 0, "stop": 6}
    whole = Attempt(tmp_path / "whole", reference, str(uuid.uuid4()), 1)
    whole.start("embed_corpus", "embed_shard", **shard)
    names, _ = whole.finish()
    assert names == [f"outputs/night-1/part-{i:05d}.npy" for i in range(6)]

    run_id = str(uuid.uuid4())
    first = Attempt(tmp_path / "node-a", storage, run_id, allocation=1)
    write_notice(first.request, time.time() + 300)  # a notice while its first part is embedded
    first.start("embed_corpus", "embed_shard", **shard)
    ack = first.stop_after_the_final_save()
    assert ack["durable"] is True and ack["step"] == 0
    assert sorted(LocalObjects(storage).names("outputs")) == names[:1]
    stored = {name: (storage / name).stat() for name in names[:1]}

    second = Attempt(tmp_path / "node-b", storage, run_id, allocation=2)
    second.start("embed_corpus", "embed_shard", **shard)
    assert second.finish()[0] == names
    for name in names:  # the same bytes as one uninterrupted child
        assert (storage / name).read_bytes() == (reference / name).read_bytes(), name
        vectors = np.load(storage / name)
        assert vectors.shape == (256, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1)
    for name, before in stored.items():  # the resumed attempt skipped what was stored
        assert (storage / name).stat().st_mtime_ns == before.st_mtime_ns, name
    stored = {name: (storage / name).stat() for name in names}

    retried = Attempt(tmp_path / "node-c", storage, str(uuid.uuid4()), allocation=3)
    retried.start("embed_corpus", "embed_shard", **shard)  # the shard given to a new child run
    assert retried.finish()[0] == names
    for name, before in stored.items():  # nothing stored twice, nothing rewritten
        after = (storage / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name
    assert sorted(LocalObjects(storage).names("outputs")) == names
    assert len(LocalObjects(storage).names(INPUTS)) == 6
