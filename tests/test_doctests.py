"""The examples in the market's docstrings run."""

import doctest
import importlib
import pkgutil

import pytest

import prefect_spotgpu.market

MODULES = [
    m.name for m in pkgutil.iter_modules(prefect_spotgpu.market.__path__, "prefect_spotgpu.market.")
] + [
    "prefect_spotgpu.economics.schedules",
    "prefect_spotgpu.worker.report",
    "prefect_spotgpu.worker.reactions",
    "prefect_spotgpu.deploy",
    "prefect_spotgpu.protocol",
    "prefect_spotgpu.api_client",
    "prefect_spotgpu.service.sealing",
    "prefect_spotgpu.cli.pool",
    "prefect_spotgpu.agent.reports",
    "prefect_spotgpu.agent.runners.pull",
    "prefect_spotgpu.agent.runners.runner",
    "prefect_spotgpu.fanout",
    "prefect_spotgpu.checkpoint.flow",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
    if not name.startswith("prefect_spotgpu.market."):
        assert result.attempted > 0
