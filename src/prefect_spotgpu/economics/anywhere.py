"""The price forecast of a bid for ``any`` region: the regions' forecasts as one.

A bid that may run in any region takes spot capacity wherever its price is at most the cap, and
the market places it in the cheapest pool that fits. So, hour by hour:

- spot is usable when **some** region's price is at most the cap: with the regions' prices
  taken as independent, ``P = 1 - prod(1 - p_r)`` (each ``p_r`` from that region's forecast);
- the price paid is the cheapest region's expected price.

It offers what :func:`prefect_spotgpu.market.forecast.estimate` reads of a forecast
(``predict`` and ``p_at_most``), so one estimator serves one region or many. Pure: arrays in,
arrays out.

>>> import numpy as np
>>> from prefect_spotgpu.market.forecast import HourOfWeekForecast
>>> hours = np.arange(168) * 3600.0
>>> night = HourOfWeekForecast.fit(hours, np.where(hours % 86400 < 43200, 0.9, 1.6))
>>> day = HourOfWeekForecast.fit(hours, np.where(hours % 86400 < 43200, 1.6, 1.0))
>>> both = AnyRegionForecast({"a": night, "b": day})
>>> [round(float(x), 2) for x in both.predict(np.array([3600.0, 50400.0]))[0]]
[0.9, 1.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefect_spotgpu.market.forecast import HourOfWeekForecast


@dataclass(frozen=True)
class AnyRegionForecast:
    """Several regions' forecasts, read as the forecast of a bid for any of them."""

    regions: dict[str, HourOfWeekForecast]

    def __post_init__(self) -> None:
        if not self.regions:
            raise ValueError("no region to forecast")

    def predict(self, times: np.ndarray, z: float = 1.2816) -> tuple[np.ndarray, ...]:
        """The cheapest region's expected price at ``times``, and the band of the cheapest."""
        each = [f.predict(times, z) for f in self.regions.values()]
        return tuple(np.min([e[i] for e in each], axis=0) for i in range(3))

    def p_at_most(self, times: np.ndarray, price: float) -> np.ndarray:
        """Probability that some region's price is at most ``price`` (regions independent)."""
        none = np.ones(len(np.atleast_1d(times)))
        for forecast in self.regions.values():
            none = none * (1 - forecast.p_at_most(times, price))
        return 1 - none
