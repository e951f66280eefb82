"""A node whose jobs cannot start stops taking work, instead of failing (and billing) every bid the
market places on it.

A job that cannot start is reported failed at once, and the market places its bid again — often
on the same node, the cheapest, about twice a second. When the cause is the node's own (its job
interpreter out of reach of its job users, its Docker engine down, an image registry out of its
reach, its disk full), every attempt fails the same way. So the agent counts the jobs *in a row*
that could not start for a reason of the node's; at ``DRAIN_AFTER`` it drains its own node
(``POST /nodes/{node_id}/drain``, then the failure report, in that order: the bid must not come
back here) and logs an error saying how to offer it again. A job that starts resets the count.

A failure that is the job's own (``runners.JobFault``: its program missing, its arguments too
long, a checkpoint URL refused, an image its registry says it does not have) neither counts nor
resets: it says nothing of the node, and a tenant must not be able to drain a healthy node with
three broken bids.

A drained node stays drained until its owner offers it again (``spotgpu node live``). Not a
timed back-off: the agent cannot see when the cause is fixed (a permission, a registry, a disk),
and each timed retry would fail a bid again. The count and the decision are pure
(:class:`StartFailures`); :func:`drain_node` is the one call to the market.

    >>> count = StartFailures(limit=2)
    >>> count.failed(PermissionError("[Errno 13] Permission denied: '/root/venv/bin/python'"))
    >>> count.failed(JobFault("[Errno 2] No such file or directory: 'trian.py'"))  # the job's
    >>> count.failed(PermissionError("[Errno 13] Permission denied: '/root/venv/bin/python'"))
    "2 jobs in a row could not start: [Errno 13] Permission denied: '/root/venv/bin/python'"
    >>> count.drained()  # (a drain that did not reach the market is tried at the next failure)
    >>> count.in_a_row
    0
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import httpx

from prefect_spotgpu.agent.reports import one_line
from prefect_spotgpu.agent.runners import JobFault

logger = logging.getLogger("prefect_spotgpu.agent")

DRAIN_AFTER = 3
"""Jobs in a row that could not start, for a reason of the node's, before it drains."""


class StartFailures:
    """The jobs in a row that could not start for a reason of the node's (thread-safe)."""

    def __init__(self, limit: int = DRAIN_AFTER) -> None:
        self.limit = limit
        self.in_a_row = 0
        self._lock = threading.Lock()

    def started(self) -> None:
        """A job started: the node can start jobs."""
        with self._lock:
            self.in_a_row = 0

    def drained(self) -> None:
        """The market drained the node: a new count starts (should its owner offer it again
        before it is fixed, it drains again after ``limit`` more)."""
        with self._lock:
            self.in_a_row = 0

    def failed(self, exc: BaseException) -> str | None:
        """A job could not start (``exc``): the reason to drain the node with, from the
        ``limit``-th in a row of the node's on (until :meth:`drained`), else None."""
        if isinstance(exc, JobFault):
            return None
        with self._lock:
            self.in_a_row += 1
            if self.in_a_row < self.limit:
                return None
            count = self.in_a_row
        return one_line(f"{count} jobs in a row could not start: {exc}")


def drain_node(client: httpx.Client, node_id: int, reason: str) -> bool:
    """Drain the node at the market (its running jobs go on; it takes no new work); whether
    the market did. Logged either way: the owner must fix the node and offer it again."""
    try:
        response = client.post(f"/nodes/{node_id}/drain", json={"reason": reason})
    except httpx.HTTPError as exc:
        logger.error("node %s could not be drained (%s): %s", node_id, exc, reason)
        return False
    if response.status_code != 200:
        logger.error(
            "node %s could not be drained (%s %s): %s",
            node_id,
            response.status_code,
            response.text[:200],
            reason,
        )
        return False
    logger.error(
        "node %s drained: %s. It takes no new work until its owner fixes it and offers it "
        "again (spotgpu node live %s)",
        node_id,
        reason,
        node_id,
    )
    return True


def report_not_started(
    failures: StartFailures,
    exc: BaseException,
    *,
    drain: Callable[[str], bool],
    report: Callable[[], None],
) -> None:
    """Count a job that could not start, and report it (``report``); on the node's
    ``limit``-th in a row, on a thread of its own, ``drain`` the node first."""
    reason = failures.failed(exc)
    if reason is None:
        report()
        return

    def drain_then_report() -> None:
        try:
            if drain(reason):
                failures.drained()
        finally:
            report()

    threading.Thread(target=drain_then_report, name="spotgpu-drain", daemon=True).start()
