"""``spotgpu demo`` run as a user would (its output: ``test_demo.check_the_demo_output``), and
what it promises to show in the Prefect UI, read off the real UI in a headless
Chromium (Debian's ``chromium``, driven by Playwright): the flow-run page the demo prints shows
the run Completed, a ``Preempted`` state on its timeline, the ``spotgpu.bid.*`` events of its bid
(the Event Feed, filtered on the run) and the cost artifact the worker publishes for it.

Everything is asserted on the rendered page, never on the API: the run graph is a canvas, so its
states are read from the popover a click on the graph's state bar opens, as a user reads them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import pytest

from test_dashboard import CHROMIUM, FLAGS
from test_demo import assert_all_stopped, check_the_demo_output, demo_until_it_idles, start_demo

pytestmark = pytest.mark.slow

UI_TIMEOUT_MS = 60_000  # a Vue app on 2 slow cores, next to the whole demo stack
BID_EVENTS = ("created", "allocated", "noticed", "preempted", "resumed")  # worker.py / placement.py
SCREENSHOTS = Path(os.environ.get("SPOTGPU_SCREENSHOTS", tempfile.gettempdir()))
"""Where the test saves its screenshot of the preempted run; ``SPOTGPU_SCREENSHOTS=docs/images``
refreshes the docs' copy."""


def state_at(page, x: float) -> str | None:
    """The state the run graph's state bar shows at ``x`` (canvas pixels): click it, read the
    popover. None where the bar has no state."""
    box = page.locator(".flow-run-graph canvas").bounding_box()
    # the bar runs along the graph's bottom; the mouse, not the locator: an open popover
    # covers part of the canvas, and Playwright would wait for it to go away
    page.mouse.click(box["x"] + x, box["y"] + box["height"] - 4)
    popover = page.locator(".flow-run-graph-state-popover")
    try:
        popover.wait_for(timeout=1500)
        text = popover.inner_text(timeout=1500)
    except Exception:  # no popover: nothing at x
        return None
    match = re.search(r"State\s+(\S+)\s+Occurred", text)
    return match[1] if match else None


def timeline_states(page) -> tuple[list[str], dict[int, str | None]]:
    """The states along the run graph's state bar, left to right (runs of one state once),
    and what each x sampled showed: a coarse pass, then, if it missed ``Preempted`` (a state
    of a second or so), a fine one between neighbours that differ."""
    width = int(page.locator(".flow-run-graph canvas").bounding_box()["width"])
    samples = {}
    for x in [*range(2, width - 2, 12), width - 2]:  # the last: Completed, a sliver at the end
        samples[x] = state_at(page, x)
    if "Preempted" not in samples.values():
        xs = sorted(samples)
        for left, right in pairwise(xs):
            if samples[left] != samples[right]:
                for x in range(left + 2, right, 2):
                    samples[x] = state_at(page, x)
    states = []
    for x in sorted(samples):
        if samples[x] and (not states or states[-1] != samples[x]):
            states.append(samples[x])
    return states, samples


def text_appears(page, needles: list[str], seconds: float = 60, reload_every: float = 15) -> str:
    """The page's text once every needle is in it (reloading now and then: the Event Feed
    polls only every minute); fails naming the missing ones."""
    deadline = time.monotonic() + seconds
    reloaded = time.monotonic()
    while True:
        body = page.inner_text("body")
        missing = [n for n in needles if n not in body]
        if not missing:
            return body
        assert time.monotonic() < deadline, f"not in the page: {missing}\n{body}"
        if time.monotonic() - reloaded > reload_every:
            page.reload()
            reloaded = time.monotonic()
        time.sleep(1)


def check_the_ui(page, out: str) -> None:
    url = re.search(r"In the Prefect UI: (http://\S+/runs/flow-run/(\S+))", out)
    assert url, out
    run_url, run_id = url[1], url[2]
    run_name = re.search(r"Flow run (\S+) of pretrain-nightly", out)[1]
    cost = re.search(
        r"spot ([0-9.]+) against on-demand ([0-9.]+) \((\S+) saved\); (\d+) preemption\(s\), "
        r"(\d+) with a final save",
        out,
    )
    assert cost, out
    spot, on_demand, saving, preemptions, final_saves = cost.groups()

    # (1) the printed page is this run's, and it is Completed
    page.goto(run_url)
    heading = page.locator("header.page-heading-flow-run")
    heading.get_by_text(run_name, exact=True).wait_for(timeout=UI_TIMEOUT_MS)
    badge = heading.locator(".state-badge")
    badge.get_by_text("Completed", exact=True).wait_for(timeout=UI_TIMEOUT_MS)

    # (2) its timeline: Running, Preempted, Running again, Completed
    graph = page.locator(".flow-run-graph canvas")
    graph.wait_for(timeout=UI_TIMEOUT_MS)
    deadline = time.monotonic() + 60
    while state_at(page, graph.bounding_box()["width"] / 2) is None:  # the graph has drawn
        assert time.monotonic() < deadline, "the run graph shows no states"
        time.sleep(1)
    states, samples = timeline_states(page)
    assert "Preempted" in states, states
    preempted = states.index("Preempted")
    assert "Running" in states[:preempted], states
    assert "Running" in states[preempted + 1 :], states
    assert states[-1] == "Completed", states
    assert "Crashed" not in states, states  # a preemption never reads as a crash
    # the docs' picture of a preempted run (docs/users/watching-runs.md): its Preempted state
    # open on the run graph, as a user clicks it
    state_at(page, min(x for x, state in samples.items() if state == "Preempted"))
    page.screenshot(path=SCREENSHOTS / "preempted-run.png")

    # (4) the cost artifact, from the run's Artifacts tab. The worker publishes it when an
    # attempt ends, as versions of one key, which the tab lists in no particular order; the
    # key's page lists them newest first.
    page.locator(".p-tabs").get_by_text("Artifacts", exact=True).first.click()
    cost_key = f"spotgpu-{run_id}-cost"
    card = page.locator(".artifact-card").filter(has_text=cost_key).first
    card.wait_for(timeout=UI_TIMEOUT_MS)
    card.click()
    page.locator(".p-bread-crumbs a").filter(has_text=cost_key).click(timeout=UI_TIMEOUT_MS)
    newest = page.locator('.artifact-timeline a[href^="/artifacts/artifact/"]').first
    href = newest.get_attribute("href", timeout=UI_TIMEOUT_MS)
    newest.click()
    page.wait_for_url(f"**{href}", timeout=UI_TIMEOUT_MS)
    names = ("GPU-hours", "Cost paid", "On-demand cost", "Saving", "Preemptions", "Work lost")
    # the artifact's table, and that it is this flow run's (its name comes a moment later)
    body = text_appears(page, ["GPU cost of bid", *names, cost_key, run_name])
    rows = dict(re.findall(rf"^({'|'.join(names)})\t(.+)$", body, re.M))  # the rendered table
    assert set(rows) == set(names), body
    # what the demo printed for the run
    assert float(rows["Cost paid"]) > 0, rows
    assert f"{float(rows['Cost paid']):.4f}" == spot, (rows, cost[0])
    assert f"{float(rows['On-demand cost'].split()[0]):.4f}" == on_demand, (rows, cost[0])
    assert rows["Saving"] == saving, (rows, cost[0])
    assert rows["Preemptions"] == preemptions != "0", (rows, cost[0])
    if final_saves == preemptions:
        assert rows["Work lost"].startswith("0.0 s"), rows  # every final save made it

    # (3) the bid's events, in the Event Feed filtered on the run
    base = run_url.split("/runs/flow-run/")[0]
    page.goto(f"{base}/events?resource=prefect.flow-run.{run_id}&events=spotgpu.bid.*")
    body = text_appears(page, [f"spotgpu.bid.{what}" for what in BID_EVENTS])
    assert "Flow run" in body and run_name in body, body  # related to this run


def test_the_demo_runs_through_a_reclaim_the_prefect_ui_shows_it_and_ctrl_c_stops_all(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y chromium) "
            "or set SPOTGPU_CHROMIUM",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    home = tmp_path / "demo"
    demo = start_demo(tmp_path, home, "--steps", "150")
    stopped = False
    try:
        out = demo_until_it_idles(demo)
        check_the_demo_output(out, home)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=FLAGS
            )
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            try:
                check_the_ui(page, out)
            except BaseException:
                shot = tmp_path / "prefect-ui.png"
                page.screenshot(path=shot, full_page=True)
                print(f"screenshot of the page: {shot}\ndemo output:\n{out}")
                raise
            finally:
                browser.close()
        demo.send_signal(signal.SIGINT)
        rest = demo.communicate(timeout=60)[0]
        stopped = True
        assert "stopping every process" in rest
    finally:
        if not stopped and demo.poll() is None:  # a failure: still stop the whole stack
            demo.send_signal(signal.SIGINT)  # (a SIGKILL would leave its processes running)
            try:
                demo.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                demo.kill()
    assert_all_stopped(home)
