"""``@warm_up``: set-up the launcher runs before the go, whose result the flow then reuses."""

from __future__ import annotations

import logging

from prefect_spotgpu.checkpoint import warm
from prefect_spotgpu.checkpoint.warm import run_warm_ups, warm_up


def test_a_marked_function_runs_once_and_the_flow_gets_what_the_launcher_built(monkeypatch):
    monkeypatch.setattr(warm, "_MARKED", [])
    calls = []

    @warm_up
    def build() -> dict:
        calls.append(1)
        return {"model": object()}

    assert run_warm_ups() >= 0 and calls == [1]  # before the go
    first = build()
    assert build() is first and calls == [1]  # the flow's calls: at once, the same object


def test_a_set_up_that_failed_before_the_go_runs_again_when_the_flow_calls_it(monkeypatch, caplog):
    monkeypatch.setattr(warm, "_MARKED", [])
    attempts = []

    @warm_up
    def flaky() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the GPU is not ready")
        return 42

    with caplog.at_level(logging.WARNING):
        run_warm_ups()  # logged, not raised: the launcher goes on waiting for its go
    assert "the GPU is not ready" in caplog.text
    assert flaky() == 42 and len(attempts) == 2
