"""The node agent: registers its host, heartbeats, and runs what the market assigns to it.

It talks to the market service over HTTP only: a heartbeat every few seconds (with GPU
telemetry), and a long-poll on its node's events. On ``allocated`` it starts the job on free
GPUs; on ``noticed`` it writes the notice file and sends SIGUSR1 to the job's main process,
waits for the checkpoint library's acknowledgement (or the deadline), reports the outcome with
the allocation's epoch (the fencing token), then stops the job's process group; on
``preempted``/``finished``/``released`` it stops whatever still runs. A job that exits by itself
is reported ``finished`` (exit 0) or ``failed``. On start it reconciles: local jobs the market
no longer assigns to this node are killed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from prefect_spotgpu.agent.discovery import GpuInfo
from prefect_spotgpu.agent.runners import JobHandle, JobRequest

logger = logging.getLogger("prefect_spotgpu.agent")


class AgentError(RuntimeError):
    pass


class Agent:
    def __init__(
        self,
        *,
        market: str,
        token: str,
        runner,
        gpus: list[GpuInfo],
        declared: bool,
        state_dir: Path,
        name: str,
        region: str | None = None,
        reserve_price: float | None = None,
        capacity: str = "spot",
        heartbeat_seconds: float = 5.0,
        grace_seconds: float = 5.0,
        telemetry=None,
    ) -> None:
        self.market = market.rstrip("/")
        self.token = token
        self.runner = runner
        self.gpus = gpus
        self.declared = declared
        self.state_dir = Path(state_dir)
        self.name = name
        self.region = region
        self.reserve_price = reserve_price
        self.capacity = capacity
        self.heartbeat_seconds = heartbeat_seconds
        self.grace_seconds = grace_seconds
        self.telemetry = telemetry
        self.node_id: int | None = None
        self.jobs: dict[int, JobHandle] = {}
        self.waiting_for_gpus: dict[int, float] = {}  # allocation -> since (monotonic)
        self.epochs: dict[int, int] = {}
        self.free = set(range(len(gpus)))
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.cursor = 0
        self.client: httpx.Client | None = None

    # ---------------------------------------------------------------- registration

    def _http(self, token: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.market + "/api/v1",
            timeout=60,
            headers={"Authorization": f"Bearer {token}"},
        )

    def register(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        saved = self.state_dir / "node.json"
        node_token = None
        if self.token.startswith("sgn_"):
            node_token = self.token
        elif saved.exists():
            record = json.loads(saved.read_text())
            if record.get("market") == self.market:
                node_token = record["token"]
        if node_token is None:
            if not self.region or (self.capacity == "spot" and not self.reserve_price):
                raise AgentError(
                    "registering a spot node needs --region and --reserve-price "
                    "(an on-demand node needs --region)"
                )
            with self._http(self.token) as owner:
                response = owner.post(
                    "/nodes",
                    json={
                        "name": self.name,
                        "gpu_model": self.gpus[0].model,
                        "region": self.region,
                        "gpu_count": len(self.gpus),
                        "reserve_price": self.reserve_price,
                        "capacity": self.capacity,
                        "declared": self.declared,
                        "inventory": [g.to_json() for g in self.gpus],
                    },
                )
            if response.status_code != 201:
                raise AgentError(
                    f"registering node {self.name!r} failed: {response.status_code} {response.text}"
                )
            node_token = response.json()["token"]
            tmp = saved.with_suffix(".tmp")
            tmp.touch(mode=0o600)
            tmp.write_text(
                json.dumps(
                    {"market": self.market, "token": node_token, "node_id": response.json()["id"]}
                )
            )
            os.replace(tmp, saved)
        self.client = self._http(node_token)
        me = self.client.get("/nodes/me")
        if me.status_code != 200:
            raise AgentError(f"the market refused this node's token: {me.status_code} {me.text}")
        node = me.json()
        if node["gpu_count"] != len(self.gpus) or node["gpu_model"] != self.gpus[0].model:
            raise AgentError(
                f"node {node['id']} sells {node['gpu_count']} x "
                f"{node['gpu_model']}, this host has {len(self.gpus)} x "
                f"{self.gpus[0].model}"
            )
        self.node_id = node["id"]
        cursor_file = self.state_dir / "cursor"
        if cursor_file.exists():
            self.cursor = int(cursor_file.read_text() or 0)
        logger.info(
            "agent for node %s (%s x %s) on %s",
            self.node_id,
            len(self.gpus),
            self.gpus[0].model,
            self.market,
        )

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        self.register()
        self.heartbeat()
        self.reconcile()
        beat = threading.Thread(target=self._heartbeats, name="spotgpu-heartbeat", daemon=True)
        beat.start()
        try:
            while not self.stop_event.is_set():
                self._check_exits()
                for alloc_id in sorted(self.waiting_for_gpus):  # GPUs being freed by a stop
                    try:
                        self.start(alloc_id)
                    except Exception:
                        logger.exception("starting allocation %s failed", alloc_id)
                try:
                    page = self.client.get(
                        f"/nodes/{self.node_id}/events",
                        params={"after": self.cursor, "timeout": 1.0},
                    )
                except httpx.HTTPError as exc:
                    logger.warning("market unreachable (%s); retrying", exc)
                    self.stop_event.wait(1.0)
                    continue
                if page.status_code != 200:
                    logger.warning("events: %s %s", page.status_code, page.text[:200])
                    self.stop_event.wait(1.0)
                    continue
                body = page.json()
                for event in body["events"]:
                    try:
                        self.handle(event)
                    except Exception:  # one bad event must not stop the node
                        logger.exception("handling event %s failed", event.get("id"))
                if body["cursor"] != self.cursor:
                    self.cursor = body["cursor"]
                    (self.state_dir / "cursor").write_text(str(self.cursor))
        finally:
            self.stop_event.set()

    def shutdown(self) -> None:
        """Stop the loop; jobs keep running (the market decides their fate)."""
        self.stop_event.set()

    def heartbeat(self) -> None:
        telemetry = {"jobs": len(self.jobs), "declared": self.declared}
        if self.telemetry is not None:
            with contextlib.suppress(Exception):
                telemetry["gpus"] = self.telemetry()
        response = self.client.post(
            f"/nodes/{self.node_id}/heartbeat", json={"telemetry": telemetry}
        )
        if response.status_code != 200:
            logger.warning("heartbeat refused: %s %s", response.status_code, response.text[:200])

    def _heartbeats(self) -> None:
        while not self.stop_event.wait(self.heartbeat_seconds):
            try:
                self.heartbeat()
            except httpx.HTTPError as exc:
                logger.warning("heartbeat failed: %s", exc)

    # ---------------------------------------------------------------- events

    def handle(self, event: dict) -> None:
        kind, alloc_id = event["kind"], event["allocation_id"]
        payload = event["payload"]
        if "epoch" in payload:
            self.epochs[alloc_id] = payload["epoch"]
        if kind == "allocated":
            self.start(alloc_id)
        elif kind == "noticed":
            self.notice(alloc_id, payload["deadline"], payload.get("epoch"))
        elif kind in ("preempted", "finished", "released"):
            self.stop(alloc_id, reason=kind)

    def assignments(self) -> dict[int, dict]:
        response = self.client.get(f"/nodes/{self.node_id}/allocations")
        response.raise_for_status()
        return {a["id"]: a for a in response.json()}

    def start(self, alloc_id: int, assignment: dict | None = None) -> None:
        with self.lock:
            if alloc_id in self.jobs:
                return
            if assignment is None:
                assignment = self.assignments().get(alloc_id)
            if assignment is None or assignment["status"] != "running":
                self.waiting_for_gpus.pop(alloc_id, None)
                return  # ended meanwhile
            job = assignment.get("job")
            if not job:
                logger.warning("allocation %s has no job to run", alloc_id)
                return
            count = assignment["gpu_count"]
            if len(self.free) < count:  # a stopping job still holds them: retry each loop
                first = self.waiting_for_gpus.setdefault(alloc_id, time.monotonic())
                if time.monotonic() - first < self.grace_seconds + 30:
                    logger.info("allocation %s waits for %s GPUs to be freed", alloc_id, count)
                    return
                del self.waiting_for_gpus[alloc_id]
                logger.error(
                    "allocation %s needs %s GPUs, %s free", alloc_id, count, len(self.free)
                )
                self.client.post(
                    f"/allocations/{alloc_id}/report",
                    json={"epoch": assignment["epoch"], "outcome": "failed"},
                )
                return
            self.waiting_for_gpus.pop(alloc_id, None)
            indices = sorted(self.free)[:count]
            self.free -= set(indices)
            request = JobRequest(
                allocation_id=alloc_id,
                epoch=assignment["epoch"],
                bid_id=assignment["bid_id"],
                command=list(job["command"]),
                env=dict(job.get("env") or {}),
                gpu_indices=indices,
                workdir=self.state_dir / f"alloc-{alloc_id}",
                checkpoint_url=job.get("checkpoint_url"),
                checkpoint_key=assignment["checkpoint_key"],
                image=job.get("image"),
            )
            try:
                handle = self.runner.start(request)
            except Exception as exc:  # e.g. the command does not exist: give the GPUs back
                self.free |= set(indices)
                logger.error("allocation %s: the job could not start: %s", alloc_id, exc)
                self.client.post(
                    f"/allocations/{alloc_id}/report",
                    json={"epoch": assignment["epoch"], "outcome": "failed"},
                )
                return
            self.jobs[alloc_id] = handle
            self.epochs[alloc_id] = assignment["epoch"]
            (request.workdir / "pid").write_text(str(handle.pid))
            logger.info("allocation %s: started pid %s on GPUs %s", alloc_id, handle.pid, indices)

    def notice(self, alloc_id: int, deadline: float, epoch: int | None) -> None:
        with self.lock:
            handle = self.jobs.get(alloc_id)
        if handle is None:
            return
        self.runner.notice(handle, deadline)
        logger.info(
            "allocation %s: notice sent (deadline in %.0f s)", alloc_id, deadline - time.time()
        )
        threading.Thread(
            target=self._await_final_save,
            args=(alloc_id, handle, deadline),
            name=f"spotgpu-notice-{alloc_id}",
            daemon=True,
        ).start()

    def _await_final_save(self, alloc_id: int, handle: JobHandle, deadline: float) -> None:
        """Wait for the acknowledgement (or the deadline), stop the job, then report.

        The job is stopped *before* the report: the report ends the allocation, and the market
        may start the bid's next allocation at once; the old process must be gone by then (its
        engine writes its own Crashed state on SIGTERM, which must not land after the worker
        has rescheduled the run)."""
        ack_file = handle.request.ack_file
        while time.time() < deadline and not ack_file.exists() and handle.poll() is None:
            time.sleep(0.02)
        saved = ack_file.exists()
        finished = not saved and handle.poll() == 0  # it finished its work during the notice
        ack = json.loads(ack_file.read_text()) if saved else {}
        exited = handle.poll() is not None
        self.stop(alloc_id, reason="notice")
        epoch = self.epochs.get(alloc_id, 1)
        if saved:
            body = {
                "epoch": epoch,
                "outcome": "saved",
                "checkpoint_at": ack.get("saved_at") or time.time(),
                "step": ack.get("step"),
            }
        else:
            body = {"epoch": epoch, "outcome": "finished" if finished else "save_failed"}
        response = self.client.post(f"/allocations/{alloc_id}/report", json=body)
        if saved:
            logger.info(
                "allocation %s: final save at step %s acknowledged (%s)",
                alloc_id,
                ack.get("step"),
                response.status_code,
            )
        elif finished:
            logger.info(
                "allocation %s: finished during its notice (%s)", alloc_id, response.status_code
            )
        else:  # not saved: the market decides whether that is compensated
            logger.warning(
                "allocation %s: no final save (job %s) before the deadline; reported (%s)",
                alloc_id,
                "exited" if exited else "still running",
                response.status_code,
            )

    def stop(self, alloc_id: int, reason: str) -> None:
        with self.lock:
            handle = self.jobs.pop(alloc_id, None)
        if handle is None:
            return
        self.runner.stop(handle, grace=self.grace_seconds)
        with self.lock:
            self.free |= set(handle.request.gpu_indices)
        logger.info("allocation %s: stopped (%s)", alloc_id, reason)

    def _check_exits(self) -> None:
        with self.lock:  # jobs under notice are the notice thread's to report
            exited = [
                (a, h, h.poll())
                for a, h in self.jobs.items()
                if h.signalled_at is None and h.poll() is not None
            ]
        for alloc_id, handle, code in exited:
            with self.lock:
                if self.jobs.get(alloc_id) is not handle:
                    continue
                del self.jobs[alloc_id]
                self.free |= set(handle.request.gpu_indices)
            outcome = "finished" if code == 0 else "failed"
            response = self.client.post(
                f"/allocations/{alloc_id}/report",
                json={"epoch": self.epochs.get(alloc_id, 1), "outcome": outcome},
            )
            logger.info(
                "allocation %s: job exited %s -> %s (%s)",
                alloc_id,
                code,
                outcome,
                response.status_code,
            )

    def reconcile(self) -> None:
        """Kill local work the market no longer assigns here; start what it does."""
        active = self.assignments()
        for workdir in sorted(self.state_dir.glob("alloc-*")):
            alloc_id = int(workdir.name.removeprefix("alloc-"))
            pid_file = workdir / "pid"
            if alloc_id in active or not pid_file.exists():
                continue
            if _kill_job(int(pid_file.read_text()), alloc_id):
                logger.warning(
                    "reconcile: killed the job of allocation %s, no longer ours", alloc_id
                )
            pid_file.unlink(missing_ok=True)
        for alloc_id, assignment in active.items():
            if assignment["status"] == "running":
                pid_file = self.state_dir / f"alloc-{alloc_id}" / "pid"
                if pid_file.exists():  # our previous run's job: stop it, start it cleanly
                    _kill_job(int(pid_file.read_text()), alloc_id)
                self.start(alloc_id, assignment)


def _kill_job(pid: int, alloc_id: int) -> bool:
    """SIGKILL the process group of ``pid`` if it still is this allocation's job.

    A recorded pid may have been reused by an unrelated process after a reboot or a long
    outage: the job's environment (``SPOTGPU_ALLOCATION_ID``) must match before we kill.
    """
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone (or not ours to read)
    if f"SPOTGPU_ALLOCATION_ID={alloc_id}".encode() not in environ:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
        return True
    return False
