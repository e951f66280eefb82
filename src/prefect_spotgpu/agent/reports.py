"""What the agent reports about a job's checkpoints and its notice: pure functions of what the
job left in its directory (the saved file, the acknowledgement) and whether it still runs.

The market compensates a lost checkpoint only when the platform caused the loss
(docs/operators/architecture.md#design-7): so a failed final save says why (``cause``): ``storage``
(the checkpointer's write failed and it said so in its acknowledgement), ``job`` (the job exited
without acknowledging), or ``deadline`` (the job still ran at the deadline). Each report is a
``messages.AllocationReport``; ``body()`` is what the agent sends:

    >>> saved = {"step": 40, "saved_at": 1700.0}
    >>> notice_report(epoch=2, ack=saved, exit_code=None, now=1701).body()
    {'epoch': 2, 'outcome': 'saved', 'checkpoint_at': 1700.0, 'step': 40}
    >>> failed = {"failed": True, "cause": "storage"}
    >>> notice_report(epoch=2, ack=failed, exit_code=1, now=1701).body()
    {'epoch': 2, 'outcome': 'save_failed', 'cause': 'storage'}
    >>> notice_report(epoch=2, ack=None, exit_code=0, now=1701).body()
    {'epoch': 2, 'outcome': 'finished'}
    >>> notice_report(epoch=2, ack=None, exit_code=-9, now=1701).body()
    {'epoch': 2, 'outcome': 'save_failed', 'cause': 'job'}
    >>> notice_report(epoch=2, ack=None, exit_code=None, now=1701).body()
    {'epoch': 2, 'outcome': 'save_failed', 'cause': 'deadline'}
    >>> saved = {"step": 9, "saved_at": 1600.5, "final": False}
    >>> checkpoint_report(epoch=1, saved=saved, last=None, now=1601).body()
    {'epoch': 1, 'outcome': 'checkpoint', 'checkpoint_at': 1600.5, 'step': 9}
    >>> checkpoint_report(epoch=1, saved=saved, last=(1600.5, 9), now=1601) is None
    True

A job that exits non-zero says how in its report's ``detail``: its exit code and the last line
it printed, one line of plain text (``one_line``: the market refuses control characters and
more than ``REPORT_DETAIL_CHARS``; a hostile provider or job cannot put escapes in a tenant's
log):

    >>> exit_detail(1, "ModuleNotFoundError: No module named 'prefect_spotgpu'\x1b[0m")
    "exit code 1, last output: ModuleNotFoundError: No module named 'prefect_spotgpu' [0m"
    >>> exit_detail(-9, None)
    'exit code -9'
"""

from __future__ import annotations

import math
from typing import Literal

from prefect_spotgpu.messages import AllocationReport
from prefect_spotgpu.protocol import REPORT_DETAIL_CHARS, ReportOutcome

Cause = Literal["storage", "job", "deadline"]


def _time(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _step(value) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def save_marker(saved: dict | None) -> tuple[float, int | None] | None:
    """The identity of a save the saved file records (its time and step), or None when the
    file is absent or not a valid record."""
    if not saved or saved.get("invalid"):
        return None
    at = _time(saved.get("saved_at"))
    return None if at is None else (at, _step(saved.get("step")))


def checkpoint_report(
    *, epoch: int, saved: dict | None, last: tuple[float, int | None] | None, now: float
) -> AllocationReport | None:
    """The ``checkpoint`` report for a save not reported yet (``last``: the last reported),
    or None. The final save is the notice's to report (``saved``), not this. A time the job
    wrote is never taken as later than ``now``."""
    marker = save_marker(saved)
    if marker is None or marker == last or saved.get("final"):
        return None
    at, step = marker
    return AllocationReport(
        epoch=epoch, outcome=ReportOutcome.CHECKPOINT, checkpoint_at=min(at, now), step=step
    )


def notice_report(
    *, epoch: int, ack: dict | None, exit_code: int | None, now: float
) -> AllocationReport:
    """The outcome of a notice: ``ack`` is the acknowledgement (None: none came),
    ``exit_code`` the job's (None: it still runs, at the deadline)."""
    if ack is not None and not ack.get("invalid"):
        if ack.get("failed"):
            return AllocationReport(
                epoch=epoch, outcome=ReportOutcome.SAVE_FAILED, cause=_cause(ack)
            )
        at = _time(ack.get("saved_at"))
        at = now if at is None else min(at, now)
        step = _step(ack.get("step"))
        return AllocationReport(
            epoch=epoch, outcome=ReportOutcome.SAVED, checkpoint_at=at, step=step
        )
    if ack is None and exit_code == 0:  # it finished its work during the notice
        return AllocationReport(epoch=epoch, outcome=ReportOutcome.FINISHED)
    if ack is None and exit_code is None:
        return AllocationReport(epoch=epoch, outcome=ReportOutcome.SAVE_FAILED, cause="deadline")
    return AllocationReport(
        epoch=epoch, outcome=ReportOutcome.SAVE_FAILED, cause="job"
    )  # crashed, or garbage


def notice_before_start_report(*, epoch: int) -> AllocationReport:
    """The outcome of a notice that came before the job started (its image still being
    pulled): nothing ran since the bid's last checkpoint, nothing was saved. Reported at once
    (not at the deadline: the GPUs are free now), as the job's (no compensation: no work of
    this allocation was lost)."""
    return AllocationReport(epoch=epoch, outcome=ReportOutcome.SAVE_FAILED, cause="job")


def one_line(text: str) -> str:
    """``text`` as a report's ``detail`` takes it: control characters (and any other
    unprintable one) become spaces; cut to ``REPORT_DETAIL_CHARS``."""
    printable = "".join(c if c.isprintable() else " " for c in text)
    return printable[:REPORT_DETAIL_CHARS]


def exit_detail(exit_code: int, last_line: str | None) -> str:
    """What a failed job's report says of its end: its exit code and its last output line."""
    said = f"exit code {exit_code}"
    return one_line(f"{said}, last output: {last_line}" if last_line else said)


def _cause(ack: dict) -> Cause:
    """Only the checkpointer's own storage failure is ``storage``; anything else a job writes
    is the job's."""
    return "storage" if ack.get("cause") == "storage" else "job"
