"""``SpotGPUCluster``: a Dask cluster whose every worker is one spot bid on the market.

In the shape of dask-jobqueue's ``JobQueueCluster``: a ``SpecCluster`` whose worker class,
:class:`SpotGPUJob`, is one bid whose job (``python -m prefect_spotgpu.dask.worker_job``, a
plain ``job.command``, in ``image`` when one is given) runs a Dask worker on the node. The
scheduler runs here, in the caller's process, on ``tls://`` with a certificate made for this
cluster alone (``Security.temporary``); the PEMs travel in each bid's sealed ``job.env``, which
the market gives only to the node holding the allocation.

Invariants:

- A job's bid is placed by the cluster alone and cancelled by it alone (``scale``, ``adapt``,
  ``close``). ``Job.start`` returns once the bid is placed: a bid waiting for GPUs is not an
  error. A bid stays open across preemptions: the market places it again, and its next job's
  worker joins under a new name (``rules.worker_name``).
- The cluster is never wider than the market at its price (``rules.bids_to_place`` over
  ``fanout.market_width``); a watcher tops it up, every ``poll_seconds``, as GPUs free up.
- A bid that ended by itself is replaced (while wanted); when its job said the cluster's
  settings are wrong (no Dask in the image, the scheduler unreachable: ``rules.diagnose_exit``),
  the cluster stops bidding and closes, saying what to change, instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time

from distributed.core import Status
from distributed.deploy.spec import ProcessInterface, SpecCluster
from distributed.utils import NoOpAwaitable

from prefect_spotgpu.dask import rules
from prefect_spotgpu.dask.market import MarketView, resolve_market
from prefect_spotgpu.protocol import DASK_CLUSTER_LABEL, DASK_ENV, unfit_node_address

logger = logging.getLogger("prefect_spotgpu.dask")

WORKER_COMMAND = ("python", "-m", "prefect_spotgpu.dask.worker_job")
"""Every worker job's command (a process job's ``python`` is the node's job interpreter)."""


class SpotGPUJob(ProcessInterface):
    """One spot bid whose job runs one Dask worker (dask-jobqueue's ``Job``)."""

    def __init__(self, scheduler=None, name=None, *, view: MarketView, body: dict) -> None:
        super().__init__(scheduler=scheduler, name=name)
        self.name, self.view, self.body = name, view, body
        self.bid_id: int | None = None
        self.checked_at = 0.0
        self.age = 0  # its order of creation in the cluster
        self.ended = False

    async def start(self) -> None:
        """Place the bid (unless the cluster placed it in a batch already); GPUs may come
        later."""
        if self.bid_id is None:
            [self.bid_id] = await self.view.place([self.body])
        await super().start()

    async def close(self) -> None:
        """Cancel the bid (its job is stopped at the market's next tick)."""
        if self.bid_id is not None and not self.ended:
            with contextlib.suppress(Exception):
                await self.view.cancel(self.bid_id)
        await super().close()

    def __repr__(self) -> str:
        return f"<SpotGPUJob {self.name}: bid {self.bid_id}, {self.status.name}>"


class SpotGPUCluster(SpecCluster):
    """Dask workers on spot GPUs: one bid each (module doc).

    Example:
        ```python
        from prefect import flow, task
        from prefect_dask import DaskTaskRunner

        @task
        def render(shard: int) -> str: ...

        @flow(task_runner=DaskTaskRunner(
            cluster_class="prefect_spotgpu.dask.SpotGPUCluster",
            cluster_kwargs={"market": "my-market", "gpu_model": "A100-80G", "max_price": 1.5},
            adapt_kwargs={"minimum": 0, "maximum": 16},
        ))
        def render_all(shards: list[int]):
            return render.map(shards).result()
        ```

    ``market``: a ``SpotMarket`` block or its name (or ``market_url`` and ``api_key``).
    ``env``: more of the worker job's environment. ``resources``: the workers' Dask resources
    (default ``{"GPU": gpu_count}``). ``scheduler_host``: where the scheduler listens, an
    address the nodes reach (default: this host's address on its route to the market);
    ``contact_address``: the address the nodes are told, when it differs (a forwarded port).
    ``join_timeout``: how long a worker tries to reach the scheduler before its job fails.
    """

    def __init__(
        self,
        market=None,
        *,
        gpu_model: str,
        max_price: float,
        gpu_count: int = 1,
        region: str = "any",
        image: str | None = None,
        env: dict[str, str] | None = None,
        nthreads: int = 1,
        resources: dict[str, float] | None = None,
        memory_limit: str = "0",
        scheduler_host: str | None = None,
        scheduler_port: int = 0,
        contact_address: str | None = None,
        join_timeout: float = 60.0,
        market_url: str | None = None,
        api_key: str | None = None,
        poll_seconds: float = 1.0,
        name: str | None = None,
        asynchronous: bool = False,
        loop=None,
        shutdown_on_close: bool = True,
    ) -> None:
        from distributed import Scheduler
        from distributed.security import Security

        self.spot_market = resolve_market(market, url=market_url, api_key=api_key)
        self.gpu_model = rules.normal_gpu_model(gpu_model)
        self.gpu_count, self.region, self.max_price = int(gpu_count), region, float(max_price)
        if self.gpu_count < 1 or nthreads < 1:
            raise ValueError("gpu_count and nthreads must be at least 1")
        self.image = self._check_market(image)
        host = scheduler_host or _route_to(self.spot_market.url)
        unfit = unfit_node_address(host)
        if unfit:
            raise ValueError(f"scheduler_host {host!r} is {unfit}: give an address nodes reach")
        self.contact_address = contact_address
        self.worker_env = {
            **(env or {}),
            DASK_ENV.NTHREADS: str(nthreads),
            DASK_ENV.RESOURCES: " ".join(
                f"{k}={v:g}" for k, v in (resources or {"GPU": self.gpu_count}).items()
            ),
            DASK_ENV.MEMORY_LIMIT: str(memory_limit),
            DASK_ENV.JOIN_TIMEOUT: f"{join_timeout:g}",
        }
        self.poll_seconds = poll_seconds
        self.flow_run_id = None if asynchronous else _flow_run_id()
        self.view = MarketView(self.spot_market)
        self.problem: str | None = None
        self.bids_placed: list[int] = []
        self._target = 0
        self._holding: dict[int, list[str]] = {}
        self._joined: set[int] = set()  # bids whose worker joined at least once
        self._ages = itertools.count()
        self._grow_lock: asyncio.Lock | None = None
        self._watcher: asyncio.Task | None = None
        security = Security.temporary()
        self._prefix = name or "spot"
        scheduler = {
            "cls": Scheduler,
            "options": {
                "protocol": "tls",
                "host": host,
                "port": scheduler_port,
                "security": security,
                "dashboard": False,
                "dashboard_address": None,
            },
        }
        worker = {"cls": SpotGPUJob, "options": {}}
        super().__init__(
            scheduler=scheduler,
            worker=worker,
            security=security,
            asynchronous=asynchronous,
            loop=loop,
            name=name,
            shutdown_on_close=shutdown_on_close,
        )

    # ---------------------------------------------------------------- checks up front

    def _check_market(self, image: str | None) -> str | None:
        """The market's prices (and catalogue, for ``image``): fail now, saying what to
        change, rather than bid for what no node will run."""
        from prefect_spotgpu.messages import QuoteResponse

        with self.spot_market.get_client(timeout=30.0) as http:
            response = http.get("/prices")
            if response.status_code >= 400:
                raise ValueError(f"the market at {self.spot_market.url} answered "
                                 f"{response.status_code}: {response.text}")  # fmt: skip
            quotes = [QuoteResponse.model_validate(q) for q in response.json()]
            problem = rules.check_terms(
                quotes, gpu_model=self.gpu_model, region=self.region, max_price=self.max_price
            )
            if problem:
                raise ValueError(problem)
            if image is None:
                return None
            catalogue = {i["name"]: i for i in http.get("/images").json()}
        names = {key for i in catalogue.values() for key in (i["name"], i["reference"])}
        if image not in names:
            raise ValueError(
                f"image {image!r} is not in the market's catalogue; its images: "
                + (", ".join(sorted(catalogue)) or "none")
            )
        return image

    # ---------------------------------------------------------------- SpecCluster's seams

    def _new_worker_name(self, worker_number) -> str:
        return f"{self._prefix}-{worker_number}"

    async def _start(self) -> None:
        await super()._start()
        if self._watcher is None and self.status == Status.running:
            self._grow_lock = asyncio.Lock()
            self._watcher = asyncio.ensure_future(self._watch())

    @property
    def scheduler_contact(self) -> str:
        return self.contact_address or self.scheduler.address

    def _job_env(self) -> dict[str, str]:
        ca = self.security.tls_ca_file
        return {
            **self.worker_env,
            DASK_ENV.SCHEDULER: self.scheduler_contact,
            DASK_ENV.TLS_CA: ca,
            DASK_ENV.TLS_CERT: self.security.tls_worker_cert,
            DASK_ENV.TLS_KEY: self.security.tls_worker_key,
        }

    def _bid_body(self) -> dict:
        job = {"command": list(WORKER_COMMAND), "env": self._job_env()}
        if self.image:
            job["image"] = self.image
        return {
            "gpu_model": self.gpu_model,
            "gpu_count": self.gpu_count,
            "max_price": self.max_price,
            "region": self.region,
            "labels": {DASK_CLUSTER_LABEL: str(self.scheduler.id)[:256]},
            "job": job,
        }

    async def _correct_state_internal(self) -> None:
        """SpecCluster's, with three changes: workers of closed jobs are found by their bids
        (their names are per allocation); new jobs' bids are placed in one batch; nothing is
        opened once the cluster stopped bidding (``problem``)."""
        async with self._lock:
            self._correct_state_waiting = None
            to_close = set(self.workers) - set(self.worker_spec)
            if to_close:
                bids = {self.workers[n].bid_id for n in to_close}
                names = [w["name"] for w in self.scheduler_info.get("workers", {}).values()
                         if rules.bid_of_worker(w["name"]) in bids]  # fmt: skip
                if names and self.scheduler.status == Status.running:
                    await self.scheduler_comm.retire_workers(names=names, close_workers=True)
                await asyncio.gather(*(self.workers[n].close() for n in to_close))
                for name in to_close:
                    del self.workers[name]
            to_open = sorted(set(self.worker_spec) - set(self.workers))
            if not to_open or self.problem or self.status in (Status.closing, Status.closed):
                return
            body = self._bid_body()
            jobs = [
                SpotGPUJob(self.scheduler_contact, n, view=self.view, body=body) for n in to_open
            ]
            ids = await self.view.place([body] * len(jobs))
            for job, bid_id in zip(jobs, ids, strict=True):
                job.bid_id, job.age = bid_id, next(self._ages)
                self._created.add(job)
            self.bids_placed.extend(ids)
            await asyncio.gather(*(asyncio.ensure_future(_started(job)) for job in jobs))
            self.workers.update({job.name: job for job in jobs})

    @property
    def observed(self) -> set[str]:
        """The jobs with a worker connected (for ``Adaptive``, which compares them with the
        jobs it asked for; worker names are per allocation, job names per bid)."""
        names = [w["name"] for w in self.scheduler_info.get("workers", {}).values()]
        return rules.jobs_observed(names, self._job_of_bid())

    def _job_of_bid(self) -> dict[int, str]:
        return {job.bid_id: name for name, job in self.workers.items() if job.bid_id is not None}

    def scale(self, n: int = 0, memory=None, cores=None):
        """Aim for ``n`` workers: down at once (waiting bids cancelled first, then workers
        retired by Dask); up as far as the market offers at the price, the rest as GPUs free
        up (the watcher)."""
        if memory is not None:
            n = max(
                n,
                math.ceil(
                    _parse_bytes(memory)
                    / _parse_bytes(self.worker_env[DASK_ENV.MEMORY_LIMIT] or "0")
                ),
            )
        if cores is not None:
            n = max(n, math.ceil(cores / int(self.worker_env[DASK_ENV.NTHREADS])))
        self._target = int(n)
        if len(self.worker_spec) > n:
            for name in rules.jobs_to_cancel(target=n, jobs=self._views()):
                del self.worker_spec[name]
            self.loop.add_callback(self._correct_state)
        elif self.status == Status.running:
            self.loop.add_callback(self._grow)
        if self.asynchronous:
            return NoOpAwaitable()

    def _views(self) -> list[rules.JobView]:
        views = []
        for name in self.worker_spec:
            job = self.workers.get(name)
            bid = job.bid_id if job is not None else None
            age = job.age if job is not None else 1 << 60  # not placed yet: the newest
            views.append(rules.JobView(name, bid in self._holding, age))
        return views

    async def scale_down(self, workers) -> None:
        """``Adaptive``'s scale-down: ``workers`` are worker names (``<bid>-<allocation>``) or
        job names; their jobs' bids are cancelled, and the target follows."""
        job_of_bid = self._job_of_bid()
        for w in workers:
            name = job_of_bid.get(rules.bid_of_worker(w), w)
            self.worker_spec.pop(name, None)
        self._target = min(self._target, len(self.worker_spec))
        await self

    # ---------------------------------------------------------------- the watcher

    async def _grow(self) -> None:
        """Place bids up to the target, within the market's width at the price."""
        if self.problem or self.status != Status.running or self._grow_lock is None:
            return
        async with self._grow_lock:
            from prefect_spotgpu.fanout import market_width

            self._holding = await self.view.holding()
            width = market_width(
                await self.view.prices(), gpu_model=self.gpu_model, region=self.region,
                max_price=self.max_price, gpus_per_child=self.gpu_count,
            )  # fmt: skip
            waiting = sum(1 for v in self._views() if not v.holds_gpus)
            count = rules.bids_to_place(
                target=self._target, live=len(self.worker_spec), waiting=waiting,
                market_width=width,
            )  # fmt: skip
            for _ in range(count):
                self.worker_spec.update(self.new_worker_spec())
            if count:
                await self._correct_state()

    async def _watch(self) -> None:
        while self.status == Status.running:
            try:
                await self._check_jobs()
                await self._grow()
            except Exception:  # the market restarting, a network blip: try again next round
                logger.warning("spot cluster: watching the market failed", exc_info=True)
            await asyncio.sleep(self.poll_seconds)

    async def _check_jobs(self) -> None:
        """Jobs whose bids ended by themselves leave the cluster (the target places new
        ones); one that says the cluster's settings are wrong stops it (module doc)."""
        self._holding = await self.view.holding()
        names = [w["name"] for w in self.scheduler_info.get("workers", {}).values()]
        self._joined.update(b for b in map(rules.bid_of_worker, names) if b is not None)
        now = time.monotonic()
        for name, job in list(self.workers.items()):
            joined, holds = job.bid_id in self._joined, job.bid_id in self._holding
            if (joined and holds) or now - job.checked_at < 3 * self.poll_seconds:
                continue
            job.checked_at = now
            if not joined:  # its jobs fail before joining: do they say why?
                detail = await self.view.last_failure(job.bid_id)
                problem = rules.diagnose_exit(
                    detail, image=self.image, scheduler=self.scheduler_contact
                )
                if problem:
                    await self._stop_bidding(problem)
                    return
            if holds or await self.view.is_live(job.bid_id):
                continue  # running, or waiting for GPUs
            job.ended = True
            logger.info("spot cluster: bid %s ended by itself; replacing it", job.bid_id)
            self.workers.pop(name, None)
            self.worker_spec.pop(name, None)
            await job.close()

    async def _stop_bidding(self, problem: str) -> None:
        self.problem = problem
        logger.error("spot cluster: %s; it stops bidding and closes", problem)
        self.worker_spec.clear()
        await self._correct_state()
        with contextlib.suppress(Exception):
            await self.scheduler.close(reason=f"spot cluster: {problem}")

    # ---------------------------------------------------------------- cost and close

    def cost_report(self) -> dict:
        """The spot cost of every bid this cluster placed, against the same GPU-hours on
        demand, and their preemptions (``fanout.cost_report``)."""
        report = self.sync(self.view.costs, list(self.bids_placed))
        return {**report, "bids": len(self.bids_placed)}

    def close(self, timeout: float | None = None):
        if self.flow_run_id and self.status == Status.running and self.bids_placed:
            try:
                publish_cost(self.cost_report(), self.flow_run_id)
            except Exception:  # the report is a courtesy: closing goes on
                logger.warning("spot cluster: the cost artifact failed", exc_info=True)
        return super().close(timeout=timeout)

    async def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.problem and self.scheduler_comm is not None:  # its scheduler closed already:
            await self.scheduler_comm.close_rpc()  # nothing to terminate (no connect timeout)
            self.scheduler_comm = None
        await super()._close()
        await self.view.aclose()


async def _started(job: SpotGPUJob) -> SpotGPUJob:
    return await job


def _flow_run_id():
    """The flow run this cluster serves (made inside one: DaskTaskRunner's), or None."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return None if context is None or context.flow_run is None else context.flow_run.id


def publish_cost(report: dict, flow_run_id) -> None:
    """The cost report as a markdown artifact of ``flow_run_id`` (the task runner closes its
    cluster after the flow run's context is gone, so the run is named, not looked up)."""
    from prefect.artifacts import MarkdownArtifact

    saving = "n/a" if report["saving"] is None else f"{report['saving']:.0%}"
    MarkdownArtifact(
        flow_run_id=flow_run_id,
        key="spot-dask-cost",
        markdown=(
            "| bids | GPU-hours | preemptions | spot cost | on-demand | saved |\n"
            "|---|---|---|---|---|---|\n"
            f"| {report['bids']} | {report['gpu_hours']:.4f} | {report['preemptions']} | "
            f"{report['spot_cost']:.4f} | {report['on_demand_cost']:.4f} | {saving} |"
        ),
        description="Dask workers on spot GPUs: cost against on-demand",
    ).create()


def _route_to(url: str) -> str:
    """This host's address on its route to the market (where nodes likely reach it too)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 443
    family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


def _parse_bytes(text: str) -> int:
    from dask.utils import parse_bytes

    return max(1, parse_bytes(text))
