"""How the ``spot-gpu`` worker places a flow run's bid and, for a run with a deadline, paces it.

A mixin of ``prefect_spotgpu.worker.SpotGPUWorker`` (it uses the worker's Prefect client,
logger, retries and events). The decisions themselves are ``prefect_spotgpu.worker.pacing.plan``'s;
this module carries them out against the market: a new bid (spot at the plan's price, or
on-demand), a reprice, a cancel, or a running spot job's release through the usual notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from prefect.client.schemas.objects import FlowRun

from prefect_spotgpu.economics.schedules import cheap_window
from prefect_spotgpu.launch import BID_LABEL
from prefect_spotgpu.worker.config import SpotGPUJobConfiguration
from prefect_spotgpu.worker.market_api import Track, cancel_bid, checked, describe, set_webhook
from prefect_spotgpu.worker.pacing import RELEASE_PRICE, Pace, Plan, plan

FLOW_RUN_LABEL = "prefect.flow-run-id"
REPLACES_LABEL = "spotgpu.replaces"
"""On a bid that replaced an earlier bid of the same run (spot -> on-demand): that bid's id."""
POOL_LABEL = "prefect.work-pool"
RELEASED_LABEL = "spotgpu.released-by"
"""On a flow run: the worker that stopped while following it. While it still names the run's
owner (label ``prefect.worker.name``), the next worker adopts the run at once instead of
waiting for the owner's heartbeats to age."""


@dataclass
class Attempt:
    """One attempt of a flow run: what every step of following its bid needs."""

    http: httpx.AsyncClient
    flow_run: FlowRun
    configuration: SpotGPUJobConfiguration
    bid: dict
    track: Track


@dataclass(frozen=True)
class SwitchBid:
    """Pacing replaced the run's waiting spot bid by this on-demand bid: follow it."""

    bid: dict


class BidPlacement:
    """Placing, steering and pacing a flow run's bid (see the module docstring)."""

    async def _place_bid(
        self,
        http,
        flow_run,
        configuration: SpotGPUJobConfiguration,
        course: Plan | None,
        replaces: dict | None = None,
    ) -> dict:
        """A new bid for the run (idempotent: retries are safe), named on the run; a bid that
        ``replaces`` another names it (label ``spotgpu.replaces``) for the run's cost report."""
        if configuration.notice_webhook:
            await set_webhook(http, configuration.notice_webhook)
        body = self._bid_body(flow_run, configuration, course)
        if replaces is not None:
            body["labels"][REPLACES_LABEL] = str(replaces["id"])
        bid = await self._retry_checked(
            flow_run, "place the bid", lambda: http.post("/bids", json=body)
        )
        await self.client.update_flow_run_labels(flow_run.id, {BID_LABEL: str(bid["id"])})
        why = f" ({course.describe()})" if course else ""
        logger = self.get_flow_run_logger(flow_run)
        logger.info("Bid %s placed: %s%s", bid["id"], describe(bid), why)
        self._event("created", flow_run, bid)
        return bid

    async def _steer(self, http, flow_run, pace: Pace, bid: dict | None):
        """Ask the run's bidding policy (``pacing.plan``); returns the bid to keep (None:
        place a new one), the plan, and the bid it cancelled. A waiting spot bid is repriced
        to the plan's price, or cancelled when the plan moves the run to on-demand capacity."""
        allocations = []
        if bid is not None:
            allocations = checked(
                await http.get(f"/bids/{bid['id']}/allocations"), "list the bid's allocations"
            )
        course = plan(pace, datetime.now(UTC), bid, allocations)
        if bid is None:
            return None, course, None
        logger = self.get_flow_run_logger(flow_run)
        if course.mode == "on_demand" and bid.get("capacity") != "on_demand":
            logger.warning("Moving to on-demand capacity: %s", course.describe())
            await cancel_bid(http, bid["id"])
            self._event("on-demand", flow_run, bid, plan=course.describe())
            return None, course, bid
        if course.mode == "spot" and bid["max_price"] != course.price:
            bid = checked(
                await http.patch(f"/bids/{bid['id']}", json={"max_price": course.price}),
                "reprice the bid",
            )
            logger.info("Bid %s repriced: %s", bid["id"], course.describe())
        return bid, course, None

    async def _pace_running(self, attempt: Attempt, pace: Pace) -> SwitchBid | None:
        """Every ``PACE_SECONDS`` of a paced attempt: a waiting bid is steered (repriced, or
        replaced by an on-demand bid); a running spot job that must move to on-demand gets
        the usual notice, through its bid lowered below every reserve, and saves first."""
        http, flow_run, bid = attempt.http, attempt.flow_run, attempt.bid
        if attempt.track.live is None:
            kept, course, replaced = await self._steer(http, flow_run, pace, bid)
            if kept is None:
                configuration = attempt.configuration
                return SwitchBid(
                    await self._place_bid(http, flow_run, configuration, course, replaced)
                )
            attempt.bid = kept
            return None
        if bid.get("capacity") == "on_demand" or bid["max_price"] == RELEASE_PRICE:
            return None
        allocations = checked(await http.get(f"/bids/{bid['id']}/allocations"), "list")
        course = plan(pace, datetime.now(UTC), bid, allocations)
        if course.mode == "on_demand":
            self.get_flow_run_logger(flow_run).warning(
                "Moving to on-demand capacity after a final save: %s", course.describe()
            )
            attempt.bid = checked(
                await http.patch(f"/bids/{bid['id']}", json={"max_price": RELEASE_PRICE}),
                "release the spot GPUs",
            )
        return None

    def _bid_body(
        self, flow_run, configuration: SpotGPUJobConfiguration, course: Plan | None = None
    ) -> dict:
        on_demand = course is not None and course.mode == "on_demand"
        body: dict[str, Any] = {
            "gpu_model": configuration.gpu_model,
            "gpu_count": configuration.gpu_count,
            "max_price": course.price if course is not None else configuration.max_price,
            "region": configuration.region,
            "idempotency_key": f"prefect-flow-run-{flow_run.id}-{flow_run.run_count}",
            "labels": {
                FLOW_RUN_LABEL: str(flow_run.id),
                "prefect.flow-run-name": flow_run.name,
                POOL_LABEL: self._work_pool_name,
            },
            "job": configuration.job_spec(),
        }
        finish_by = configuration.finish_by(flow_run)
        if finish_by is not None:
            body["deadline"] = finish_by.isoformat()
        if on_demand:  # the deadline beats the cheap window
            body["capacity"] = "on_demand"
            body["idempotency_key"] += "-on-demand"
        elif configuration.cheap_window_only:
            start, end = cheap_window(datetime.now(UTC), configuration.timezone)
            body["window_start"], body["window_end"] = start.isoformat(), end.isoformat()
            body["idempotency_key"] += f"-window-{int(start.timestamp())}"
        return body
