"""The flow the end-to-end tests deploy on a spot-gpu pool: counts with a seeded random walk,
checkpoints, and answers a notice with a final save. Its result is a pure function of ``steps``.

``SPOTGPU_TEST_SETUP_SECONDS`` and ``SPOTGPU_TEST_FINAL_SAVE_SECONDS`` (benchmarks/recovery.py)
stand in for a job's start-up (a ``@warm_up`` set-up) and for the write of a large final save.

Progress goes to ``progress`` (JSON lines, one file shared by every attempt) so a test can see
where each attempt started and on which allocation it ran. Once a file ``hurry`` exists beside
it, the remaining steps run without their pause: a test that has seen what it waits for (an
adoption, a resume) lets the run finish at once instead of waiting out a margin for slow
machines. The result does not depend on it.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from prefect import flow

from prefect_spotgpu.checkpoint import Checkpointer, warm_up


def count(
    ckpt: Checkpointer,
    steps: int,
    step_seconds: float,
    progress: Path | None,
    finish_on_notice: bool = False,
) -> dict:
    """The work: resumes from ``ckpt``, returns the result. Deterministic given ``steps``.

    ``finish_on_notice``: a job that answers a notice by finishing its work at once, with no
    final save (the race of a run that is over while its node is taken back)."""
    restored = ckpt.restore()
    if restored is None:
        start, state = 0, {"total": 0, "walk": 0, "rng": random.Random(7).getstate()}
    else:
        start, state = restored.step + 1, restored.state
    rng = random.Random()
    rng.setstate(_as_rng_state(state["rng"]))
    hurry = None if progress is None or str(progress) in ("", ".") else progress.parent / "hurry"
    _log(progress, {"start": start, "alloc": os.environ.get("SPOTGPU_ALLOCATION_ID")})
    for step in range(start, steps):
        state["walk"] += rng.choice((-1, 1))
        state["total"] += step * state["walk"]
        state["rng"] = rng.getstate()
        _log(progress, {"step": step})
        if not ckpt.notice_received and ckpt.notice_pending():
            if finish_on_notice:
                continue  # the rest at once, never acknowledged: the job exits 0 in its notice
            # this step's save is the final one: said first, as the agent stops the job as soon
            # as the save is acknowledged (a SIGTERM that can land before any line after it)
            _log(progress, {"saved": step})
            _hold_the_final_save()
            ckpt.maybe_save(state, step)
        else:
            ckpt.maybe_save(state, step)
            if ckpt.notice_received:  # (a notice that came during the call: saved now)
                _log(progress, {"saved": step})
        if ckpt.notice_received:  # saved and acknowledged: the agent stops this process
            time.sleep(max(0.0, (ckpt.notice_deadline or time.time() + 60) - time.time()))
        time.sleep(0.0 if hurry is not None and hurry.exists() else step_seconds)
    result = {"total": state["total"], "walk": state["walk"]}
    _log(progress, {"done": result})
    return result


def _hold_the_final_save() -> None:
    """``SPOTGPU_TEST_FINAL_SAVE_SECONDS`` of wait before the final save; with
    ``SPOTGPU_TEST_FINAL_SAVE_AWAITS_WARM``, only until a replacement's set-up is noted in
    ``SPOTGPU_TEST_WARM_LOG`` (a test of the warm start that holds however slow the machine)."""
    seconds = float(os.environ.get("SPOTGPU_TEST_FINAL_SAVE_SECONDS", "0"))
    if not os.environ.get("SPOTGPU_TEST_FINAL_SAVE_AWAITS_WARM"):
        time.sleep(seconds)
        return
    warm_log, deadline = Path(os.environ["SPOTGPU_TEST_WARM_LOG"]), time.monotonic() + seconds
    while time.monotonic() < deadline and not _warm_elsewhere(warm_log):
        time.sleep(0.05)


def _warm_elsewhere(warm_log: Path) -> bool:
    """Whether another allocation than this job's has noted its set-up."""
    if not warm_log.exists():
        return False
    lines = warm_log.read_text().splitlines()
    return any(line.endswith("}") and json.loads(line)["warm"] != _allocation() for line in lines)


@warm_up
def set_up() -> float:
    """The job's start-up cost: ``SPOTGPU_TEST_SETUP_SECONDS`` of sleep (none by default),
    run before the go (while a warm replacement waits); noted in ``SPOTGPU_TEST_WARM_LOG``."""
    seconds = float(os.environ.get("SPOTGPU_TEST_SETUP_SECONDS", "0"))
    time.sleep(seconds)
    _log(Path(os.environ.get("SPOTGPU_TEST_WARM_LOG", "")), {"warm": _allocation()})
    return seconds


def _allocation() -> str | None:
    return os.environ.get("SPOTGPU_ALLOCATION_ID")


@flow(name="spot-count")
def spot_count(
    steps: int = 60, step_seconds: float = 0.1, progress: str = "", finish_on_notice: bool = False
) -> dict:
    from prefect_spotgpu.checkpoint.flow import checkpointer_for_run

    os.umask(0o002)  # in containers each attempt is another uid of the tenant's group: the
    # progress file they share must stay group-writable
    set_up()  # at once when the launcher ran it before the go
    ckpt = checkpointer_for_run(every=0.3)
    return count(ckpt, steps, step_seconds, Path(progress) or None, finish_on_notice)


def _as_rng_state(value):
    """A ``random.Random`` state after a JSON-ish round trip (lists back to tuples)."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def _log(path: Path | None, entry: dict) -> None:
    if path is None or str(path) in ("", "."):
        return
    with open(path, "a") as f:
        f.write(json.dumps({**entry, "t": time.time()}) + "\n")
