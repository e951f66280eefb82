"""Runners and images meet (a part of ``Market``): which bids no node can serve.

A node says how it runs jobs (``types.Runner``); the index keeps what each node serves as bits
(``n_serves``) and, in a pool whose nodes do not all serve every bid (``Pool.mixed``), its free
capacity per kind, so fits, claims and evictions look only at nodes that serve the bid. This
part answers the service's question before a new bid enters the book: can any node of its
pools run it at all? (The service holds a bid none can, naming why.)
"""

from __future__ import annotations

from prefect_spotgpu.market.gpus import DEFAULT_CATALOG
from prefect_spotgpu.market.index import MarketIndex
from prefect_spotgpu.market.serving import (
    SERVES_ALL,
    SERVES_GANGS,
    SERVES_IMAGES,
    SERVES_PROCESS,
    Runner,
    needs_mask,
)
from prefect_spotgpu.market.types import (
    ANY_REGION,
    Bid,
    Node,
    NodeState,
)

RUNNER_OF = {  # what a node serves, back as (runner, default_image, job_network): the same to
    SERVES_ALL: (None, False, False),  # the market
    SERVES_PROCESS | SERVES_GANGS: (Runner.PROCESS, False, False),
    SERVES_IMAGES: (Runner.DOCKER, False, False),
    SERVES_IMAGES | SERVES_PROCESS: (Runner.DOCKER, True, False),
    SERVES_IMAGES | SERVES_GANGS: (Runner.DOCKER, False, True),
}


class Runners:
    """What a market says of bids no node serves, and of what a node serves, on its index."""

    def __init__(self, index: MarketIndex) -> None:
        self.index = index

    def node_value(self, r: int) -> Node:
        """Node row ``r`` as a ``Node`` (its runner as what it serves: the same to the market)."""
        ix = self.index
        pool = ix.pools[ix.n_pool[r]]
        return Node(
            ix.n_id[r],
            ix.models[pool.model],
            ix.regions[pool.region],
            ix.n_cap[r],
            ix.n_reserve[r],
            ix.n_state[r],
            ix.model_capacity[pool.model],
            frozenset(ix.images[i] for i in ix.n_images[r]),
            *RUNNER_OF[ix.n_serves[r]],
        )

    def unserved(self, bid: Bid) -> str | None:
        """Why no registered node of the bid's pools can run it (``types.Runner``), or None.
        The service holds a new bid with this reason instead of adding it; the market itself
        never places a bid on a node that does not serve it. Pools without nodes yet say
        nothing (nodes may come); lost nodes do not count."""
        ix = self.index
        model = ix.model_index.get((DEFAULT_CATALOG.normalize(bid.gpu_model), bid.capacity))
        if model is None:
            return None
        region = -1 if bid.region == ANY_REGION else ix.region_index.get(bid.region, -2)
        need = needs_mask(bid.image)
        pools = (
            ix.model_pools.get(model, [])
            if region == -1
            else [p for p in [ix.pool_index.get((model, region))] if p is not None]
        )
        rows = [r for p in pools for r in ix.pools[p].nodes if ix.n_state[r] != NodeState.LOST]
        where = f"the {bid.gpu_model} nodes in {'any region' if region == -1 else bid.region}"
        gangs_nowhere = not any(ix.n_serves[r] & SERVES_GANGS for r in rows)
        if bid.node_count > 1 and gangs_nowhere and any(ix.n_serves[r] & need for r in rows):
            return (
                f"{where} are Docker nodes without a job network: a gang's containers "
                "reach each other across hosts only there (spotgpu agent start "
                "--job-subnet); bid for process nodes, or ask the operator for one"
            )
        if not rows or any(ix.n_serves[r] & need for r in rows):
            return None
        if need == SERVES_IMAGES:
            return (
                f"{where} run jobs as host processes (--runner process); the image "
                f"{bid.image} needs a Docker node (--runner docker)"
            )
        return (
            f"{where} are Docker nodes without a default image (spotgpu agent start "
            "--default-image); a job without an image needs one, or a process node"
        )
