"""How the ``spot-gpu`` worker places a flow run's bid and, for a run with a deadline, paces it.

``Placement`` is given the market (``MarketApi``) and the flow run's side in Prefect
(``RunSide``: its labels, logger, events and retries; ``attempt.PrefectRun``). The decisions
themselves are ``pacing.plan``'s; this class carries them out against the market: a new bid
(spot at the plan's price, or on-demand), a reprice, a cancel, or a running spot job's release
through the usual notice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from prefect_spotgpu.economics.deadline import PaceMode
from prefect_spotgpu.economics.schedules import cheap_window
from prefect_spotgpu.messages import AllocationResponse, BidRequest, BidResponse
from prefect_spotgpu.protocol import LABELS, Capacity, WorkerEvent
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration
from prefect_spotgpu.worker.market_api import MarketApi
from prefect_spotgpu.worker.pacing import RELEASE_PRICE, Pace, Plan, plan
from prefect_spotgpu.worker.report import describe, lead_allocations

T = TypeVar("T")


class RunSide(Protocol):
    """What placing a bid needs of the flow run in Prefect (``attempt.PrefectRun``)."""

    flow_run: Any
    logger: Any

    async def label(self, labels: dict[str, str]) -> None: ...

    def emit(self, what: WorkerEvent, bid: BidResponse, **payload: Any) -> None: ...

    async def retry(self, doing: str, call: Callable[[], Awaitable[T]]) -> T: ...


@dataclass(frozen=True)
class SwitchBid:
    """Pacing replaced the run's waiting spot bid by this on-demand bid: follow it."""

    bid: BidResponse


class Placement:
    """Placing, steering and pacing one flow run's bid (see the module docstring)."""

    def __init__(
        self,
        market: MarketApi,
        run: RunSide,
        configuration: SpotGPUJobConfiguration,
        pool_name: str,
    ) -> None:
        self.market = market
        self.run = run
        self.configuration = configuration
        self.pool_name = pool_name
        self._image: str | None = None
        self._image_read = False

    async def image(self) -> str | None:
        """The reference the run's job runs, from the market's catalogue (read once); an
        image the catalogue does not hold is refused (ValueError, listing the known ones)."""
        if not self._image_read:
            catalogue = await self.run.retry("read the image catalogue", self.market.images)
            self._image, self._image_read = self.configuration.catalogue_image(catalogue), True
        return self._image

    async def place(self, course: Plan | None, replaces: BidResponse | None = None) -> BidResponse:
        """A new bid for the run (idempotent: retries are safe), named on the run; a bid that
        ``replaces`` another names it (label ``spotgpu.replaces``) for the run's cost report."""
        configuration = self.configuration
        if configuration.notice_webhook:
            await self.market.set_webhook(configuration.notice_webhook)
        body = self.bid_body(course, await self.image())
        if replaces is not None:  # (its own key: a run may go back to a capacity it left)
            body.labels[LABELS.REPLACES] = str(replaces.id)
            body.idempotency_key += f"-after-{replaces.id}"
        bid = await self.run.retry("place the bid", lambda: self.market.place(body))
        await self.run.label({LABELS.BID: str(bid.id)})
        why = f" ({course.describe()})" if course else ""
        self.run.logger.info("Bid %s placed: %s%s", bid.id, describe(bid), why)
        self.run.emit(WorkerEvent.CREATED, bid)
        return bid

    async def _plan(
        self, pace: Pace, bid: BidResponse | None, allocations: list[AllocationResponse]
    ):
        """``pacing.plan`` now, on the market's quotes and its hysteresis margin."""
        quotes = await self.market.quotes()
        hysteresis = (await self.market.terms()).hysteresis
        return plan(pace, datetime.now(UTC), bid, lead_allocations(allocations), quotes, hysteresis)

    async def steer(self, pace: Pace, bid: BidResponse | None):
        """Ask the run's bidding policy (``pacing.plan``); returns the bid to keep (None:
        place a new one), the plan, and the bid it cancelled. A waiting spot bid is repriced
        to the plan's price; a waiting bid is cancelled when the plan moves the run to the
        other capacity. A bid whose job runs is kept: ``pace`` releases it with a notice, so
        the job saves first (never a cancel, which stops it without a final save)."""
        allocations = [] if bid is None else await self.market.allocations(bid.id)
        course = await self._plan(pace, bid, allocations)
        if bid is None:
            return None, course, None
        on_demand = bid.capacity == Capacity.ON_DEMAND
        if (course.mode == PaceMode.ON_DEMAND) != on_demand:  # the other capacity
            if course.view.ran:  # a running job moves through ``pace``: a notice, a save
                return bid, course, None
            where, what = (
                ("spot", WorkerEvent.SPOT) if on_demand else ("on-demand", WorkerEvent.ON_DEMAND)
            )
            self.run.logger.warning("Moving to %s capacity: %s", where, course.describe())
            await self.market.cancel(bid.id)
            self.run.emit(what, bid, plan=course.describe())
            return None, course, bid
        if course.mode == PaceMode.SPOT and bid.max_price != course.price:
            bid = await self.market.reprice(bid.id, course.price)
            self.run.logger.info("Bid %s repriced: %s", bid.id, course.describe())
        return bid, course, None

    async def pace(self, pace: Pace, bid: BidResponse, running: bool) -> SwitchBid | BidResponse:
        """Every ``PACE_SECONDS`` of a paced attempt: a waiting bid is steered (repriced, or
        replaced by a bid of the other capacity: ``SwitchBid``); a ``running`` job that must
        move (spot to on-demand, or back) gets the usual notice, through its bid lowered below
        every reserve, and saves first. Returns the bid to follow from now on."""
        if not running:
            kept, course, replaced = await self.steer(pace, bid)
            if kept is None:
                return SwitchBid(await self.place(course, replaced))
            return kept
        if bid.max_price == RELEASE_PRICE:
            return bid  # released already: its job is saving
        course = await self._plan(pace, bid, await self.market.allocations(bid.id))
        on_demand = bid.capacity == Capacity.ON_DEMAND
        if (course.mode == PaceMode.ON_DEMAND) == on_demand:
            return bid
        where = "spot" if on_demand else "on-demand"
        self.run.logger.warning(
            "Moving to %s capacity after a final save: %s", where, course.describe()
        )
        return await self.market.reprice(bid.id, RELEASE_PRICE, "release the GPUs")

    def bid_body(self, course: Plan | None = None, image: str | None = None) -> BidRequest:
        """The ``POST /bids`` body: the run's GPUs (``node_count`` nodes of ``gpu_count``),
        price, job (in ``image``: a reference from the catalogue) and labels; its idempotency
        key names the run's attempt (and the capacity or cheap window it bids for)."""
        configuration, flow_run = self.configuration, self.run.flow_run
        on_demand = course is not None and course.mode == PaceMode.ON_DEMAND
        body = BidRequest(
            gpu_model=configuration.gpu_model,
            gpu_count=configuration.gpu_count,
            node_count=configuration.node_count,
            min_node_count=configuration.min_node_count,  # (sent only when set: body())
            max_price=course.price if course is not None else configuration.max_price,
            region=configuration.region,
            idempotency_key=f"prefect-flow-run-{flow_run.id}-{flow_run.run_count}",
            labels={
                LABELS.FLOW_RUN: str(flow_run.id),
                LABELS.FLOW_RUN_NAME: flow_run.name,
                LABELS.POOL: self.pool_name,
            },
            job=configuration.job_spec(image),
            deadline=configuration.finish_by(flow_run),
        )
        if on_demand:  # the deadline beats the cheap window
            body.capacity = Capacity.ON_DEMAND.value
            body.idempotency_key += "-on-demand"
        elif configuration.cheap_window_only:
            body.window_start, body.window_end = cheap_window(
                datetime.now(UTC), configuration.timezone
            )
            body.idempotency_key += f"-window-{int(body.window_start.timestamp())}"
        return body
