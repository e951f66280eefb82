"""The trainers people use, through a real reclaim (docs/users/checkpointing.md): a Hugging Face
``Trainer`` with ``SpotTrainerCallback``, and a Lightning ``fit`` with
``SpotLightningCheckpoint``, run as a job on a real agent; its node is reclaimed mid-run; the
notice makes the trainer save and stop, the job acknowledges, the agent stops it, and the run
resumes on the other node from that save. Its losses, step by step, and its final weights are an
uninterrupted run's (same seed, same data order), bit for bit. Tiny models built from a
configuration; nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_for as wait
from test_agent import a_market, post_job, start_agent, stop_agents

HERE = Path(__file__).parent
LORA = HERE.parent / "flows" / "lora.py"  # the recipe: peft's LoRA under the Trainer
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def entries(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def command(script: str, steps: int) -> list[str]:
    if script == "lora":
        return [sys.executable, str(LORA), "--steps", str(steps)]
    return [sys.executable, str(HERE / script), str(steps)]


def uninterrupted(script: str, steps: int, tmp_path: Path) -> list[dict]:
    """The script run once, start to end, with no market: its log."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calm.jsonl"
    env = {
        **os.environ,
        **OFFLINE,
        "JOB_LOG": str(log),
        "SPOTGPU_CHECKPOINT_URL": str(tmp_path / "calm-ckpt"),
        "OUTPUT": str(tmp_path / "out"),
    }
    done = subprocess.run(command(script, steps), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return entries(log)


def through_a_reclaim(script: str, steps: int, tmp_path: Path) -> tuple[list[dict], dict]:
    """The script as a job on one of two real agents, its node reclaimed after a third of its
    steps: the job's log and the bid's allocations."""
    tmp_path.mkdir(mode=0o700, parents=True, exist_ok=True)  # (the market's files: ours only)
    server, admin, owner_key, buyer_key = a_market(tmp_path, heartbeat_timeout=10)
    agents = {n: start_agent(server, owner_key, n, tmp_path) for n in ("a", "b")}
    try:
        wait(lambda: len(admin.get("/nodes").json()) == 2, 30, "agents")
        buyer, log = server.client(buyer_key), tmp_path / "job.jsonl"
        job = {"command": command(script, steps),
               "env": {**OFFLINE, "JOB_LOG": str(log), "STEP_SECONDS": "0.2"},
               "checkpoint_url": str(tmp_path / "ckpt")}  # fmt: skip
        bid = post_job(buyer, job)
        wait(lambda: sum("loss" in e for e in entries(log)) >= steps // 3, 120, "a third")
        (first,) = buyer.get(f"/bids/{bid['id']}/allocations").json()
        owner = server.client(owner_key)
        assert owner.patch(f"/nodes/{first['node_id']}", json={"state": "reclaimed"}).is_success
        wait(lambda: [e for e in entries(log) if "done" in e], 180, "the resumed run's end")
        wait(lambda: buyer.get(f"/bids/{bid['id']}").json()["status"] == "finished", 30, "")
        allocations = buyer.get(f"/bids/{bid['id']}/allocations").json()
        ledger = buyer.get("/ledger").json()["entries"]
        assert not [e for e in ledger if e["kind"] == "compensation"]  # nothing was lost
        return entries(log), {"allocations": allocations}
    finally:
        stop_agents(agents, server, tmp_path)


def by_step(log: list[dict]) -> dict[int, float]:
    steps: dict[int, float] = {}
    for entry in log:
        if "loss" in entry:
            assert entry["step"] not in steps, f"step {entry['step']} trained twice"
            steps[entry["step"]] = entry["loss"]
    return steps


def resumed_like_the_calm_run(script: str, steps: int, tmp_path: Path, saved_step) -> int:
    """``script`` uninterrupted, and through a reclaim: the second attempt resumed from the
    first's final save (``saved_step(its start entry)``: that step) with every step's loss and
    the final weights of the uninterrupted run, bit for bit; the step it resumed from."""
    calm = uninterrupted(script, steps, tmp_path / "calm")
    noticed, market = through_a_reclaim(script, steps, tmp_path / "market")
    allocations = market["allocations"]
    assert sorted(a["status"] for a in allocations) == ["finished", "preempted"]
    preempted = next(a for a in allocations if a["status"] == "preempted")
    assert preempted["end_reason"] == "final save acknowledged", preempted
    starts = [e for e in noticed if "start" in e]
    assert len(starts) == 2 and starts[0]["start"] is None  # the same command both times
    saved_at = saved_step(starts[1]["start"])
    first = [e["step"] for e in noticed if "loss" in e and e["attempt"] == starts[0]["attempt"]]
    assert max(first) == saved_at >= steps // 3  # stopped at the step it saved
    assert by_step(noticed) == by_step(calm) and len(by_step(calm)) == steps
    (done,) = [e for e in noticed if "done" in e]
    (calm_done,) = [e for e in calm if "done" in e]
    assert done["weights"] == calm_done["weights"]
    return saved_at


@pytest.mark.slow
def test_lora_under_the_trainer_resumes_through_a_reclaim_on_the_uninterrupted_curve(tmp_path):
    # flows/lora.py: peft's adapters on a small GPT-2, SpotTrainerCallback; the adapter's bytes
    resumed_like_the_calm_run("lora", 30, tmp_path, lambda path: int(path.rsplit("-", 1)[1]))


@pytest.mark.slow
def test_a_lightning_fit_resumes_through_a_reclaim_with_nothing_but_the_callback(tmp_path):
    # two epochs of 16 batches: the reclaim mid-epoch, then an epoch boundary; dropout too
    saved_at = resumed_like_the_calm_run("lightning_train.py", 30, tmp_path, int)
    assert saved_at % 16  # mid-epoch


@pytest.mark.parametrize("callback", ["huggingface", "lightning"])
def test_a_callback_without_storage_or_key_says_what_to_set(callback, monkeypatch, tmp_path):
    from prefect_spotgpu.checkpoint.huggingface import SpotTrainerCallback
    from prefect_spotgpu.checkpoint.lightning import SpotLightningCheckpoint

    made = {"huggingface": SpotTrainerCallback, "lightning": SpotLightningCheckpoint}[callback]
    monkeypatch.delenv("SPOTGPU_CHECKPOINT_URL", raising=False)
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    with pytest.raises(ValueError, match="pass one or set SPOTGPU_CHECKPOINT_URL"):
        made(key="run")
    with pytest.raises(ValueError, match="not inside a flow run: pass key="):
        made(str(tmp_path))
    fresh = made(str(tmp_path), key="run", local_dir=tmp_path / "local")
    assert fresh.checkpointer.key == "run"  # nothing saved yet: nothing to resume from
    assert getattr(fresh, "resume_from", None) is None
    assert getattr(fresh, "resumed_step", None) is None
