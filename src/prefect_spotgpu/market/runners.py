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

RUNNER_OF = {  # what a node serves, back as its (runner, default_image): the same to the market
    SERVES_ALL: (None, False),
    SERVES_PROCESS: (Runner.PROCESS, False),
    SERVES_IMAGES: (Runner.DOCKER, False),
}


class RunnersMixin(MarketIndex):
    """What :class:`prefect_spotgpu.market.engine.Market` says of bids no node serves, and
    of what a node serves."""

    def _node_value(self, r: int) -> Node:
        """Node row ``r`` as a ``Node`` (its runner as what it serves: the same to the market)."""
        pool = self._pools[self.n_pool[r]]
        return Node(
            self.n_id[r],
            self._models[pool.model],
            self._regions[pool.region],
            self.n_cap[r],
            self.n_reserve[r],
            self.n_state[r],
            self._model_capacity[pool.model],
            frozenset(self._images[i] for i in self.n_images[r]),
            *RUNNER_OF[self.n_serves[r]],
        )

    def unserved(self, bid: Bid) -> str | None:
        """Why no registered node of the bid's pools can run it (``types.Runner``), or None.
        The service holds a new bid with this reason instead of adding it; the market itself
        never places a bid on a node that does not serve it. Pools without nodes yet say
        nothing (nodes may come); lost nodes do not count."""
        model = self._model_index.get((DEFAULT_CATALOG.normalize(bid.gpu_model), bid.capacity))
        if model is None:
            return None
        region = -1 if bid.region == ANY_REGION else self._region_index.get(bid.region, -2)
        need = needs_mask(bid.image)
        pools = (
            self._model_pools.get(model, [])
            if region == -1
            else [p for p in [self._pool_index.get((model, region))] if p is not None]
        )
        rows = [r for p in pools for r in self._pools[p].nodes if self.n_state[r] != NodeState.LOST]
        if not rows or any(self.n_serves[r] & need for r in rows):
            return None
        where = f"the {bid.gpu_model} nodes in {'any region' if region == -1 else bid.region}"
        if need == SERVES_IMAGES:
            return (
                f"{where} run jobs as host processes (--runner process); the image "
                f"{bid.image} needs a Docker node (--runner docker)"
            )
        return (
            f"{where} are Docker nodes without a default image (spotgpu agent start "
            "--default-image); a job without an image needs one, or a process node"
        )
