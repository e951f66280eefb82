"""The decisions of a spot Dask cluster, as functions of plain data (no I/O, no clock).

``SpotGPUCluster`` (``cluster.py``) is the shell: it reads the market, asks these functions,
and places or cancels bids. Invariants they keep:

- **Never wider than the market.** New bids are placed only into GPUs the market offers now at
  the bid's price (``fanout.market_width``), less the GPUs the cluster's waiting bids will take;
  except that a cluster with no bid at all places one, so the work always moves (a bid waiting
  for GPUs is not an error).
- **Waiting bids go first.** Scaling down cancels bids that hold no GPUs before any worker is
  retired; a worker with GPUs is retired by Dask (its results moved), then its bid cancelled.
- **One name per allocation.** A Dask worker is named ``<bid>-<allocation>``: a bid placed again
  after a preemption (or whose old node lost its agent but not its job) gets a new worker name,
  so two processes of one bid never clash on the scheduler.

    >>> bids_to_place(target=16, live=0, waiting=0, market_width=10)
    10
    >>> bids_to_place(target=16, live=10, waiting=10, market_width=10)  # taken by the waiting
    0
    >>> bids_to_place(target=4, live=0, waiting=0, market_width=0)  # one waits: work moves
    1
    >>> worker_name(bid=7, allocation=31), bid_of_worker("7-31")
    ('7-31', 7)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefect_spotgpu.fanout import check_terms as check_terms  # shared with fan_out
from prefect_spotgpu.market import DEFAULT_CATALOG
from prefect_spotgpu.protocol import DASK_UNREACHABLE_EXIT


def bids_to_place(*, target: int, live: int, waiting: int, market_width: int) -> int:
    """How many new bids (one Dask worker each) to place now: up to ``target`` in all, into
    the ``market_width`` workers' worth of GPUs free at the price, less what the ``waiting``
    bids (placed, no GPUs yet) will take. One when the cluster has none and wants some."""
    want = max(0, target - live)
    room = max(0, market_width - waiting)
    if live == 0 and want:
        room = max(room, 1)
    return min(want, room)


@dataclass(frozen=True, slots=True)
class JobView:
    """A cluster job (one bid) as the rules see it."""

    name: str
    """Its name in the cluster's spec."""
    holds_gpus: bool
    """Its bid has an allocation (running, noticed or reserved)."""
    age: int = 0
    """Higher is newer (its order of creation)."""


def jobs_to_cancel(*, target: int, jobs: Sequence[JobView]) -> tuple[str, ...]:
    """Which jobs to end to come down to ``target``: waiting ones first (they cost nothing
    and hold nothing), the newest first; then jobs with GPUs, the newest first.

    >>> js = [JobView("a", True, 0), JobView("b", False, 1), JobView("c", True, 2)]
    >>> jobs_to_cancel(target=1, jobs=js)
    ('b', 'c')
    """
    excess = len(jobs) - max(0, target)
    if excess <= 0:
        return ()
    order = sorted(jobs, key=lambda j: (j.holds_gpus, -j.age))
    return tuple(j.name for j in order[:excess])


def worker_name(*, bid: int, allocation: int) -> str:
    """The Dask worker name of a bid's allocation (unique per allocation)."""
    return f"{bid}-{allocation}"


def bid_of_worker(name: object) -> int | None:
    """The bid a worker named by :func:`worker_name` serves (None: not one of ours)."""
    head, sep, tail = str(name).partition("-")
    if not sep or not head.isdigit() or not tail.isdigit():
        return None
    return int(head)


def jobs_observed(worker_names: Iterable[object], job_of_bid: dict[int, str]) -> set[str]:
    """The cluster's jobs that have a Dask worker connected (what ``Adaptive`` compares with
    the jobs it asked for).

    >>> sorted(jobs_observed(["7-31", "8-2", "x"], {7: "spot-0", 9: "spot-1"}))
    ['spot-0']
    """
    found = set()
    for name in worker_names:
        bid = bid_of_worker(name)
        if bid is not None and bid in job_of_bid:
            found.add(job_of_bid[bid])
    return found


def retire_seconds(*, deadline: float | None, now: float, margin: float = 10.0) -> float:
    """How long a noticed worker may spend retiring gracefully (moving its results, finishing
    its running task) so that its acknowledgement still comes before the notice's deadline:
    the time left less ``margin`` (at least 1 s; 60 s when the notice gave no deadline).

    >>> retire_seconds(deadline=400.0, now=100.0)
    290.0
    >>> retire_seconds(deadline=None, now=0.0), retire_seconds(deadline=5.0, now=4.0)
    (60.0, 1.0)
    """
    if deadline is None:
        return 60.0
    return max(1.0, deadline - now - margin)


# ---------------------------------------------------------------- checks of the terms


def normal_gpu_model(name: str) -> str:
    """The catalogue's name of ``name``; ValueError listing the known models when unknown.

    >>> normal_gpu_model("a100-80g")
    'A100-80G'
    """
    return DEFAULT_CATALOG.normalize(name)


def diagnose_exit(detail: str | None, *, image: str | None, scheduler: str) -> str | None:
    """What a worker job that ended by itself says of the cluster's settings (None: nothing
    about them; the bid is simply placed again). ``detail`` is the agent's report of it
    ("exit code N, last output: ...").

    >>> diagnose_exit("exit code 1, last output: ModuleNotFoundError: No module named "
    ...               "'distributed'", image="cuda-base", scheduler="tls://10.0.0.5:8786")
    ... # doctest: +ELLIPSIS
    "the worker image 'cuda-base' has no Dask (distributed): use an image with ..."
    >>> diagnose_exit(f"exit code {DASK_UNREACHABLE_EXIT}, last output: ...", image=None,
    ...               scheduler="tls://10.0.0.5:8786")  # doctest: +ELLIPSIS
    'the nodes cannot reach the Dask scheduler at tls://10.0.0.5:8786: give scheduler_host ...'
    """
    if not detail:
        return None
    if "No module named 'distributed'" in detail or "No module named 'dask'" in detail:
        where = f"the worker image {image!r}" if image else "the nodes' Python"
        return (
            f"{where} has no Dask (distributed): use an image with prefect-spotgpu[dask] installed"
        )
    if "No module named 'prefect_spotgpu" in detail:
        where = f"the worker image {image!r}" if image else "the nodes' Python"
        return f"{where} has no prefect-spotgpu: install prefect-spotgpu[dask] in it"
    if detail.startswith(f"exit code {DASK_UNREACHABLE_EXIT},"):
        return (
            f"the nodes cannot reach the Dask scheduler at {scheduler}: give scheduler_host "
            "an address they reach (and open its port)"
        )
    return None
