"""One attempt of a flow run: follow its bid and carry out each reaction of ``reactions.py``.

``PrefectRun`` is the flow run's side in Prefect (its state, labels, logger and events);
``Attempt`` follows one bid's events from the market (``MarketApi``), folds each into the
track, asks ``reactions.react`` what it means and does it: hand the run to its allocation,
reschedule it as ``Scheduled("Preempted")`` after its engine's last word, fail it, cancel the
bid, or publish the cost report when the attempt ends. Every effect is idempotent (labels,
state proposals, cancels) and retried while the market or Prefect is briefly unreachable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
from prefect.client.schemas.actions import ArtifactCreate
from prefect.events import emit_event
from prefect.exceptions import Abort
from prefect.states import Cancelled, Crashed, Failed, Pending, Scheduled
from prefect.utilities.engine import propose_state

from prefect_spotgpu.messages import BidResponse, EventResponse
from prefect_spotgpu.protocol import (
    HOLDING_STATUSES,
    LABELS,
    LIVE_BID_STATUSES,
    RunState,
    WorkerEvent,
)
from prefect_spotgpu.worker import reactions as rules
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration
from prefect_spotgpu.worker.market_api import POLL_SECONDS, MarketApi, retry
from prefect_spotgpu.worker.pacing import PACE_SECONDS
from prefect_spotgpu.worker.placement import Placement, SwitchBid
from prefect_spotgpu.worker.reactions import Facts, Phase, RunView, Track
from prefect_spotgpu.worker.report import allocation_report, describe

T = TypeVar("T")

CANCEL_STOP_SECONDS = 30.0
"""How long a cancelled run waits for the market to stop its job."""
REPORT_BIDS = 8
"""How many bids of a run (each replacing the one before) the cost report follows back."""
FIRST_HOLD_CHECK_SECONDS = 3.0
HOLD_CHECK_SECONDS = 15.0
"""While no allocation runs, how soon and then how often the worker reads its bid for a hold
no node can lift (``_say_unserved``): a read per waiting run, not per poll."""


def phase_of(state) -> Phase | None:
    return None if state is None else Phase(state.type.value)


def view_of(flow_run) -> RunView:
    state = flow_run.state
    return RunView(phase_of(state), "" if state is None else state.name)


class PrefectRun:
    """The flow run's side in Prefect, for one worker: read it, label it, propose its
    states, log to it and emit its bid's events."""

    def __init__(self, worker, flow_run) -> None:
        self.worker = worker
        self.client = worker.client
        self.flow_run = flow_run
        self.logger = worker.get_flow_run_logger(flow_run)

    async def read(self):
        return await self.client.read_flow_run(self.flow_run.id)

    async def view(self) -> RunView:
        return view_of(await self.read())

    async def label(self, labels: dict[str, str]) -> None:
        await self.client.update_flow_run_labels(self.flow_run.id, labels)

    async def set_state(self, state, force: bool = False):
        try:
            return await propose_state(
                self.client, state, flow_run_id=self.flow_run.id, force=force
            )
        except Abort as exc:  # the run moved on (e.g. cancelled); network errors propagate
            self.logger.debug("state %s not set: %s", state.name, exc)
            return None

    async def retry(self, doing: str, call: Callable[[], Awaitable[T]]) -> T:
        return await retry(doing, call, self.logger.warning)

    def emit(self, what: WorkerEvent, bid: BidResponse, **payload: Any) -> None:
        pool = self.worker.work_pool
        emit_event(
            event=what.event,
            resource={
                "prefect.resource.id": f"spotgpu.bid.{bid.id}",
                "prefect.resource.name": f"bid {bid.id}",
                "spotgpu.gpu-model": bid.gpu_model,
            },
            related=[
                {
                    "prefect.resource.id": f"prefect.flow-run.{self.flow_run.id}",
                    "prefect.resource.role": "flow-run",
                    "prefect.resource.name": self.flow_run.name,
                },
                {
                    "prefect.resource.id": f"prefect.work-pool.{pool.id}",
                    "prefect.resource.role": "work-pool",
                    "prefect.resource.name": pool.name,
                },
            ],
            payload={"bid_id": bid.id, **payload},
        )

    async def engine_done(self, seconds: float) -> RunView:
        """The run once it has left Running (its engine's last word), or after ``seconds``
        (an engine that was killed outright never reports)."""
        deadline = time.monotonic() + seconds
        while True:
            run = await self.view()
            if run.phase is not Phase.RUNNING or time.monotonic() > deadline:
                return run
            await anyio.sleep(0.5)

    async def insist(self, new_state: Callable[[], Any], force: bool, check: bool = True) -> None:
        """Set ``new_state()``; with ``check``, set it again (up to three times) while a
        stopped engine's forced Crashed lands on top of it."""
        for _ in range(3):
            await self.set_state(new_state(), force=force)
            if not check:
                return
            await anyio.sleep(1.0)
            if (await self.view()).phase is not Phase.CRASHED:
                return
        self.logger.error("The run stays Crashed: its engine had the last word")


async def open_bid(
    run: PrefectRun, market: MarketApi, placement: Placement, configuration
) -> BidResponse:
    """The flow run's open bid (a resumed run), or a new one; then Pending "AwaitingGPU"."""
    bid = None
    known = (run.flow_run.labels or {}).get(LABELS.BID)
    if known:
        found = await run.retry("read the bid", lambda: market.bid_or_none(known))
        if found is not None and found.status in LIVE_BID_STATUSES:
            bid = found
            terms = await run.retry("read the market's terms", market.terms)
            if rules.window_over(bid, datetime.now(UTC), terms.notice_seconds):  # paused:
                await market.cancel(bid.id)  # bid for the next window
                bid = None
    pace, course, replaced = configuration.pace(run.flow_run), None, None
    if pace is not None:
        bid, course, replaced = await run.retry("pace the run", lambda: placement.steer(pace, bid))
    if bid is None:
        bid = await placement.place(course, replaced)
    quote, refused = await market.quote(bid)
    if refused:  # it would wait for ever: say so at once, in the run's logs too
        run.logger.warning("Bid %s: %s", bid.id, quote)
    if bid.window_start is not None and bid.window_end is not None:
        window = f"{bid.window_start.isoformat()} to {bid.window_end.isoformat()}"
        quote += f"; runs in the cheap window {window}"
    await run.set_state(
        Pending(name=RunState.AWAITING_GPU, message=f"Bid {bid.id}: {describe(bid)}; {quote}")
    )
    return bid


def gang_lead(bid: BidResponse) -> int | None:
    """Rank 0's bid id for a gang bid (the id the worker follows), None for a one-node bid."""
    return bid.id if bid.node_count > 1 else None


class Attempt:
    """Follows one bid of a flow run until this attempt ends (see ``follow``)."""

    def __init__(
        self,
        run: PrefectRun,
        market: MarketApi,
        placement: Placement,
        configuration: SpotGPUJobConfiguration,
        bid: BidResponse,
    ) -> None:
        self.run = run
        self.market = market
        self.placement = placement
        self.configuration = configuration
        self.settings = rules.Settings.of(configuration)  # the market's terms: ``follow``
        self.bid = bid
        self.track = Track(gang_lead(bid))

    async def follow(self) -> int | SwitchBid:
        """Follow the bid's events until the attempt ends: its status code (0: completed,
        rescheduled, or failed or cancelled by us), or a ``SwitchBid`` to follow instead.

        The market or Prefect being briefly unreachable does not end the attempt: every call
        is retried with backoff; each event is folded into the track once and its reaction's
        effects (idempotent) are retried until they land."""
        run, bid_id = self.run, self.bid.id
        terms = await run.retry("read the market's terms", self.market.terms)
        self.settings = rules.Settings.of(self.configuration, terms)
        history = await run.retry("read the bid's events", lambda: self.market.events(bid_id, 0))
        self.track = Track.from_events(history.events, gang_lead(self.bid))
        cursor = history.cursor
        run.logger.info("Following bid %s after its event %s", bid_id, cursor)
        pace, paced_at = self.configuration.pace(run.flow_run), time.monotonic()
        flow_run = await run.read()
        missed = rules.missed_preemption(
            history.events, (flow_run.labels or {}).get(LABELS.ALLOCATION), view_of(flow_run)
        )
        if missed is not None:  # while no worker followed the run (an adoption)
            reaction = rules.preempted(missed, self.track, self.settings, datetime.now(UTC))
            return await self._carry_out(reaction, missed)
        if self.track.live is not None:
            go = rules.Go(
                allocation_id=self.track.live,
                node_id=self.track.nodes.get(self.track.live),
                preemptions=self.track.preemptions,
            )
            await run.retry("start the job", lambda: self._go(go))
        held_check, held_said = time.monotonic() + FIRST_HOLD_CHECK_SECONDS, None
        while True:
            status = await run.retry("check for a cancellation", self._check_cancelled)
            if status is not None:
                return status
            if self.track.live is None and time.monotonic() >= held_check:
                held_check = time.monotonic() + HOLD_CHECK_SECONDS
                held_said = await self._say_unserved(held_said)
            if pace is not None and time.monotonic() - paced_at >= PACE_SECONDS:
                paced_at = time.monotonic()
                following = await run.retry(
                    "pace the run",
                    lambda: self.placement.pace(pace, self.bid, self.track.live is not None),
                )
                if isinstance(following, SwitchBid):
                    return following
                self.bid = following
            page = await run.retry(
                "follow the bid",
                lambda after=cursor: self.market.events(bid_id, after, POLL_SECONDS),
            )
            for event in page.events:
                cursor = event.id
                ended = self.track.apply(event)
                outcome = await run.retry(
                    f"handle the {event.kind} event",
                    lambda e=event, ended=ended: self._on_event(e, ended),
                )
                if outcome is not None:
                    await self._publish_report()
                    run.logger.debug("attempt over after event %s", event.kind)
                    return outcome
            cursor = max(cursor, page.cursor)

    async def _say_unserved(self, said: str | None) -> str | None:
        """Tell the run's logs and Prefect's events (``spotgpu.bid.held``) why its bid waits
        for good: no node of its pools can run it as asked (``rules.unserved_message``); once
        per reason. (Not its state: Prefect refuses Pending over Pending, and forcing it could
        undo a cancellation.) What was said, for the next call."""
        bid = await self.run.retry("read the bid", lambda: self.market.bid(self.bid.id))
        message = rules.unserved_message(bid)
        if message is not None and message != said:
            self.run.logger.warning(message)
            self.run.emit(WorkerEvent.HELD, bid, reason=bid.hold_reason)
        return message

    async def _on_event(self, event: EventResponse, ended_current: bool) -> int | None:
        """The reaction to one event already folded into the track (safe to repeat)."""
        facts = Facts()
        while True:
            reaction = rules.react(
                event, ended_current, self.track, self.settings, datetime.now(UTC), facts
            )
            if not isinstance(reaction, rules.Ask):
                break
            if reaction.what == "run":
                facts = Facts(run=await self.run.view(), bid=facts.bid)
            else:
                facts = Facts(run=facts.run, bid=await self.market.bid(self.bid.id))
        return await self._carry_out(reaction, event)

    async def _carry_out(self, reaction: rules.Reaction, event: EventResponse) -> int | None:
        """Do what ``reaction`` says; the attempt's status code when it ends the attempt."""
        if reaction.emit is not None:
            self.run.emit(reaction.emit.what, self.bid, **reaction.emit.payload)
        if reaction.log is not None:
            level, message = reaction.log
            getattr(self.run.logger, level)(message)
        match reaction:
            case rules.Go():
                await self._go(reaction)
            case rules.Reschedule():
                await self._reschedule(reaction)
                return 0
            case rules.Fail():
                await self.market.cancel(self.bid.id)
                await self.run.set_state(Failed(message=reaction.message), force=True)
                return 0
            case rules.CancelBid():
                await self.market.cancel(self.bid.id)
                return reaction.status_code
            case rules.Ended():
                return reaction.status_code
        return None

    async def _go(self, go: rules.Go) -> None:
        """Hand the flow run to the running allocation: the launcher there waits for this
        (unless the run is past its launcher: ``reactions.hand_over``)."""
        run = self.run
        await run.label({LABELS.ALLOCATION: str(go.allocation_id)})
        state = await run.view()
        if not rules.hand_over(state):
            run.logger.info(
                "Following the job on node %s (allocation %s): the run is %s",
                *(go.node_id, go.allocation_id, state.name),
            )
            return
        message = rules.starting_message(go, self.bid)
        await run.set_state(Pending(name=RunState.STARTING, message=message))
        run.logger.info(
            "%s on node %s (allocation %s)",
            *("Resuming" if go.resumed else "Starting", go.node_id, go.allocation_id),
        )
        what = WorkerEvent.RESUMED if go.resumed else WorkerEvent.ALLOCATED
        self.run.emit(what, self.bid, allocation_id=go.allocation_id, node_id=go.node_id)

    async def _reschedule(self, reschedule: rules.Reschedule) -> None:
        """``Scheduled("Preempted")``, after the engine's own last word (``after_engine``);
        a run that turned out to be over is left so, and its bid cancelled when the reaction
        says so (it must not go on, and bill, without the run)."""
        run = self.run
        state = await run.engine_done(rules.engine_wait_seconds(reschedule))
        then = rules.after_engine(state, reschedule)
        if then.over:
            if reschedule.cancel_if_over:
                run.logger.info("Not rescheduled: the run is %s; its bid is cancelled", state.name)
                await self.market.cancel(self.bid.id)
            else:
                run.logger.info("Not rescheduled: the run is %s", state.name)
            return
        if reschedule.crashed and state.phase is Phase.RUNNING:  # a crash reads as one
            await run.set_state(Crashed(message=reschedule.message), force=True)
        await run.insist(
            lambda: Scheduled(
                name=RunState.PREEMPTED, scheduled_time=reschedule.when, message=reschedule.message
            ),
            # a flow called from code has no deployment, and Prefect lets such a run leave
            # its engine's Crashed for Scheduled only by force (over was ruled out above)
            force=run.flow_run.deployment_id is None,
            check=then.insist,
        )

    async def _check_cancelled(self) -> int | None:
        """When the user cancelled the run: cancel the bid, wait (bounded) for the market to
        stop its job and for the engine's last word, and mark the run Cancelled."""
        run, bid_id = self.run, self.bid.id
        if not rules.cancel_requested(await run.view()):
            return None
        await self.market.cancel(bid_id)
        deadline = time.monotonic() + CANCEL_STOP_SECONDS
        while self.track.live is not None and time.monotonic() < deadline:
            allocations = await self.market.allocations(bid_id)
            if not any(a.status in HOLDING_STATUSES for a in allocations):
                break
            await anyio.sleep(0.2)
        await run.engine_done(max(0.0, deadline - time.monotonic()))
        message = f"Cancelled: bid {bid_id} cancelled and its job stopped"
        run.logger.info(message)
        await run.insist(lambda: Cancelled(message=message), force=True)
        return 0

    async def _publish_report(self) -> None:
        """The run's allocations as a keyed table, and a markdown cost summary (over every bid
        of the run: an on-demand bid names the spot bid it replaced)."""
        run, bid = self.run, self.bid
        try:
            allocations, current = [], bid
            for _ in range(REPORT_BIDS):
                allocations = await self.market.allocations(current.id) + allocations
                earlier = (current.labels or {}).get(LABELS.REPLACES)
                if not earlier:
                    break
                current = await self.market.bid(earlier)
            table, summary = allocation_report(bid, allocations)
            key = f"spotgpu-{run.flow_run.id}"
            for suffix, kind, data, description in (
                ("allocations", "table", json.dumps(table), f"GPU allocations of bid {bid.id}"),
                ("cost", "markdown", summary, "Spot cost, preemptions and work lost"),
            ):
                await run.client.create_artifact(
                    ArtifactCreate(
                        key=f"{key}-{suffix}",
                        type=kind,
                        data=data,
                        description=description,
                        flow_run_id=run.flow_run.id,
                    )
                )
        except Exception:
            run.logger.exception("could not publish the cost summary")
