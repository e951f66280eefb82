"""The agent's lifecycle at its ends: started (``register_when_reachable``, waiting out a
market that is down) and started again (``reconcile``: what an earlier agent left, or handed
over), asked to stop (``shutdown``: it leaves as a reclaim of its node,
``leaving``) or to hand its jobs over (``hand_over``: ``handover``). A part of
:class:`~prefect_spotgpu.agent.agent.Agent`, whose state it uses."""

from __future__ import annotations

import logging
import time

import httpx

from prefect_spotgpu.agent.guard import Guard
from prefect_spotgpu.agent.handover import HANDOVER_SECONDS, HandedJob, take_record, write_record
from prefect_spotgpu.agent.isolation import ACK_NAME, read_job_file
from prefect_spotgpu.agent.leaving import REPORTS_AFTER_KILL_SECONDS, Turn
from prefect_spotgpu.agent.reports import notice_report
from prefect_spotgpu.messages import Assignment
from prefect_spotgpu.protocol import STARTABLE, AllocationStatus

logger = logging.getLogger("prefect_spotgpu.agent")


class Lifecycle:
    """How an :class:`~prefect_spotgpu.agent.agent.Agent` starts again and stops."""

    guard: Guard | None = None  # the guard of its jobs (``guard``), if one was started
    handover_seconds: float = HANDOVER_SECONDS  # how long handed-over jobs wait for the next

    def register_when_reachable(self, most_seconds: float = 30.0) -> bool:
        """:meth:`register`, waiting out a market that is down (or not up yet): one line
        naming its URL per try, backing off to ``most_seconds``. False if stopped first."""
        wait = 1.0
        while not self.stop_event.is_set():
            try:
                self.register()
                return True
            except httpx.TransportError as exc:
                logger.warning(
                    "market %s unreachable (%s: %s); retrying in %.0f s",
                    self.market,
                    type(exc).__name__,
                    exc,
                    wait,
                )
            self.stop_event.wait(wait)
            wait = min(most_seconds, wait * 2)
        return False

    def shutdown(self) -> None:
        """Stop the agent, as a reclaim of its node (``leaving``): its jobs save, stop and
        resume elsewhere, within ``grace_seconds``; a second call kills them now. An agent
        not registered yet just stops."""
        if self.node_id is None:
            self.stop_event.set()
        self.leaving.ask(time.time())

    def hand_over(self) -> None:
        """Exit soon, leaving the jobs running for the next agent on this state directory
        (``handover``); a stop asked before stands."""
        self.leaving.hand_over()

    def _hand_over(self) -> None:
        """Record the jobs for the next agent and tell the guard to wait for it."""
        with self.lock:
            handles = list(self.jobs.values())
        write_record(self.state_dir, handles)
        if self.guard is not None:
            self.guard.keep(self.handover_seconds)
        logger.warning(
            "the agent hands %s job(s) over: the next agent on %s must start within %.0f s, "
            "or they are killed",
            len(handles),
            self.state_dir,
            self.handover_seconds,
        )

    def _back(self) -> None:
        """Tell the market the agent runs again: a node it left is offered as it was."""
        try:
            response = self.client.post(f"/nodes/{self.node_id}/back")
        except httpx.HTTPError as exc:
            logger.warning("could not tell the market this agent is back: %s", exc)
            return
        if response.status_code != 200:
            logger.warning("back: %s %s", response.status_code, response.text[:200])

    def _leave_turn(self) -> bool:
        """One turn of leaving (``leaving``): True when the agent may exit."""
        if self.leaving.handing_over:
            self._hand_over()
            return True
        if not self.leaving.told:
            self.leaving.told = True
            self._tell_market_leaving()
        with self.lock:
            notices = [t for t in self.notice_threads if t.is_alive()]
            busy = bool(self.jobs or self.preparing or notices)
        turn = self.leaving.turn(busy=busy, now=time.time())
        if turn is Turn.KILL:
            with self.lock:
                left = sorted(self.jobs) + sorted(self.preparing)
            logger.error("the agent stops: killing the jobs of allocations %s now", left)
            for alloc_id in left:
                self.stop(alloc_id, reason="the agent stops", grace=0)
            for thread in notices:  # their reports, if the market answers
                thread.join(timeout=REPORTS_AFTER_KILL_SECONDS)
        return turn is not Turn.WAIT

    def _tell_market_leaving(self) -> None:
        """``POST /nodes/{id}/leave``: the market notices this node's allocations. If it
        cannot be told, the agent notices its jobs itself (their saves are durable; the runs
        resume once the market finds the node lost)."""
        try:
            response = self.client.post(f"/nodes/{self.node_id}/leave")
            told = response.status_code == 200
            why = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            told, why = False, str(exc)
        with self.lock:
            running = sorted(self.jobs)
        if told:
            logger.warning(
                "the agent stops: its node is reclaimed; %s job(s) save and stop within %.0f s",
                len(running),
                self.grace_seconds,
            )
            return
        logger.error("the market was not told this agent stops (%s): noticing its jobs", why)
        for alloc_id in running:
            self.notice(alloc_id, self.leaving.by, None)

    # ---------------------------------------------------------------- restart

    def reconcile(self) -> None:
        """Kill local work the market no longer assigns here; adopt what the last agent
        handed over, start the rest of what it does assign."""
        handed = take_record(self.state_dir)
        active = self.assignments()
        for _ in handed.keys() - active.keys():  # handed over, no longer assigned here
            self.metrics.handover_job(adopted=False)
        for workdir in sorted(self.state_dir.glob("alloc-*")):
            alloc_id = int(workdir.name.removeprefix("alloc-"))
            if alloc_id in active:
                continue
            if self.runner.reconcile(alloc_id, workdir):
                logger.warning(
                    "reconcile: killed the job of allocation %s, no longer ours", alloc_id
                )
        for alloc_id, assignment in active.items():
            if alloc_id in handed:
                adopted = self._adopt(handed[alloc_id], assignment)
                self.metrics.handover_job(adopted)
                if adopted:
                    continue
            if assignment.status == AllocationStatus.NOTICED:  # its notice outlived an agent
                self._settle_left_notice(alloc_id, assignment.epoch)
            elif assignment.status in STARTABLE:
                # our previous run's job, if any: stop it, start it cleanly
                self.runner.reconcile(alloc_id, self.state_dir / f"alloc-{alloc_id}")
                self.start(alloc_id, assignment)

    def _adopt(self, job: HandedJob, assignment: Assignment) -> bool:
        """Take over a job the last agent handed over, still running or ended since (its end
        reported by ``_check_exits``); a noticed one is noticed again (its final save may
        be done: the acknowledgement is read as after any notice). False: it is gone."""
        alloc_id = job.allocation_id
        handle = self.runner.adopt(job.request(self.state_dir), job.ref, job.job_ref)
        if handle is None:
            return False
        with self.lock:
            if not self.gpu_book.hold(alloc_id, tuple(job.gpu_indices)):
                logger.error("allocation %s: its GPUs %s are not free here: not adopted",
                             alloc_id, job.gpu_indices)  # fmt: skip
                return False
            self.jobs[alloc_id] = handle
            self.epochs[alloc_id] = assignment.epoch
        logger.warning("allocation %s: adopted its job (%s %s) from the last agent",
                       alloc_id, self.runner.name, handle.ref)  # fmt: skip
        if assignment.status == AllocationStatus.NOTICED and assignment.deadline is not None:
            self.notice(alloc_id, assignment.deadline, assignment.epoch)
        return True

    def _settle_left_notice(self, alloc_id: int, epoch: int) -> None:
        """A noticed allocation an earlier agent did not see through (killed mid-notice):
        what is left of its job is killed and its outcome reported now, by its
        acknowledgement, so the run resumes at once instead of at the notice's deadline."""
        workdir = self.state_dir / f"alloc-{alloc_id}"
        self.runner.reconcile(alloc_id, workdir)
        ack = read_job_file(workdir / ACK_NAME)
        body = notice_report(epoch=epoch, ack=ack, exit_code=None, now=time.time())
        logger.warning("allocation %s: noticed under the last agent; reported %s", alloc_id,
                       body.outcome)  # fmt: skip
        self.reporter.report_later(alloc_id, body)
