# ruff: noqa: RUF001 -- pages write the multiplication sign and en dashes, so does this file
"""Where each benchmark figure on a page comes from: ``tests/test_docs_truth.py`` reads this.

One ``Shown`` per paragraph, list item or table row that shows a measurement: its page, a piece
of its text that finds it (``where``), the results file its figures come from, and every figure
in it in order, as the page writes it. ``"0.74 s = ours_1s_poll.pickup_s.median"`` is a figure
and the JSON value it shows (rounded as written; ``FILE.json:path`` for another results file,
``{path}`` terms for arithmetic: ``{a} / {b}``, ``{share} * 100``); a figure alone
(``"1 GiB"``) is not a benchmark's output, and ``why`` says what such figures are.

When a benchmark is run again, the test names each figure that no longer matches: update the
page, and this table if a figure was added or removed.
"""

from __future__ import annotations

from dataclasses import dataclass

BENCHMARKS = "explanation/benchmarks.md"


@dataclass(frozen=True)
class Shown:
    page: str
    where: str
    results: str
    figures: tuple[str, ...]
    why: str = ""


EARLIER = "an earlier run's figure, said to be one"
WORKLOAD = "the workload's size or a setting, not a measurement"
TARGET = "a target, not a measurement"

FIGURES: tuple[Shown, ...] = (
    # ------------------------------------------------------------------ the auction
    Shown(
        BENCHMARKS,
        "`benchmarks/clearing.py` prints one JSON object",
        "clearing.json",
        ("10 %", "1 %"),
        WORKLOAD,
    ),
    Shown(
        BENCHMARKS,
        "| 10,000    | 1,000   |",
        "clearing.json",
        (
            "1,000 = results.0.nodes",
            "0.019 s = results.0.cold_seconds_per_tick",
            "0.014 s = results.0.cold_load_seconds",
            "0.007 s = results.0.steady_seconds_per_tick",
            "0.063 s = results.0.naive_one_by_one_cold_seconds",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 100,000   | 10,000  |",
        "clearing.json",
        (
            "10,000 = results.1.nodes",
            "0.100 s = results.1.cold_seconds_per_tick",
            "0.080 s = results.1.cold_load_seconds",
            "0.023 s = results.1.steady_seconds_per_tick",
            "0.66 s = results.1.naive_one_by_one_cold_seconds",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 1,000,000 | 100,000 |",
        "clearing.json",
        (
            "100,000 = results.2.nodes",
            "0.89 s = results.2.cold_seconds_per_tick",
            "0.89 s = results.2.cold_load_seconds",
            "0.170 s = results.2.steady_seconds_per_tick",
            "5.97 s = results.2.naive_one_by_one_cold_seconds",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The same plain market at 10⁶ bids, measured beside",
        "clearing.json",
        (
            "0.43 s = clearing_gangs.json:results.1.cold_seconds_per_tick",
            "0.58 s = clearing_runners.json:results.2.cold_seconds_per_tick",
            "0.079 s = clearing_gangs.json:results.1.steady_seconds_per_tick",
            "0.089 s = clearing_runners.json:results.2.steady_seconds_per_tick",
            "0.44",
            "0.49 s",
            "0.055",
            "0.075 s",
            "2.1",
            "2.6 s",
        ),
        EARLIER,
    ),
    Shown(
        BENCHMARKS,
        "Targets (10⁶ bids, 800,000 GPUs): cold tick ≤ 1 s",
        "clearing.json",
        (
            "1 s",
            "0.1 s",
            "3.3× = results.0.speedup_vs_one_by_one",
            "6.6× = results.1.speedup_vs_one_by_one",
            "6.7× = results.2.speedup_vs_one_by_one",
        ),
        TARGET,
    ),
    Shown(
        BENCHMARKS,
        "Welfare (Σ max price × GPUs of the winners)",
        "clearing.json",
        (
            "0.975 = welfare_vs_optimum.best-fit.mean",
            "84 % = {welfare_vs_optimum.best-fit.optimal_share} * 100",
            "0.13 = welfare_vs_optimum.best-fit.worst",
            "0.968 = welfare_vs_optimum.first-fit.mean",
            "83 % = {welfare_vs_optimum.first-fit.optimal_share} * 100",
        ),
    ),
    Shown(
        BENCHMARKS,
        "**Images.** The same run with every bid naming",
        "clearing.json",
        (
            "1.41× = results.2.images_vs_plain_cold_ratio",
            "1.05× = results.2.images_vs_plain_steady_ratio",
            "1.06×",
            "0.84×",
            "0.89 s = results.2.cold_seconds_per_tick",
            "0.170 s = results.2.steady_seconds_per_tick",
            "1.08 s",
            "0.15 s",
            "0.93 s",
            "0.15 s",
            "5.2 s",
            "17 % = {results.2.images_cold_placements_on_a_node_with_the_image} * 100",
        ),
        "earlier runs' figures, said to be, and one cold tick measured one by one",
    ),
    Shown(
        BENCHMARKS,
        "**Gangs.** The same workload with 10 % of the bids",
        "clearing_gangs.json",
        (
            "10 % = {results.1.gangs_share_of_bids} * 100",
            "1.4 = {results.1.gangs_member_bids} / 1000000",
            "0.53 s = results.1.gangs_cold_seconds_per_tick",
            "1.2× = results.1.gangs_vs_plain_cold_ratio",
            "0.43 s = results.1.cold_seconds_per_tick",
            "0.109 s = results.1.gangs_steady_seconds_per_tick",
            "1.4× = results.1.gangs_vs_plain_steady_ratio",
            "0.079 s = results.1.steady_seconds_per_tick",
            "0.975 = welfare_vs_optimum_with_gangs.mean",
            "86 % = {welfare_vs_optimum_with_gangs.optimal_share} * 100",
            "0.099",
            "0.112 s",
            "0.073 s = results.0.gangs_cold_seconds_per_tick",
            "0.027 s = results.0.gangs_steady_seconds_per_tick",
            "7 s = results.1.gangs_cold_load_seconds",
            "1.4 = {results.1.gangs_member_bids} / 1000000",
        ),
        "the range of a day's runs",
    ),
    Shown(
        BENCHMARKS,
        "| 10⁴ | 0.013 s |",
        "clearing_runners.json",
        (
            "0.013 s = results.0.cold_seconds_per_tick",
            "0.057 s = results.0.runners_cold_seconds_per_tick",
            "4.3× = results.0.runners_vs_plain_cold_ratio",
            "0.006 s = results.0.steady_seconds_per_tick",
            "0.009 s = results.0.runners_steady_seconds_per_tick",
            "1.6× = results.0.runners_vs_plain_steady_ratio",
            "0 = results.0.runners_placements_on_a_node_that_does_not_serve_it",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 10⁵ | 0.048 s |",
        "clearing_runners.json",
        (
            "0.048 s = results.1.cold_seconds_per_tick",
            "0.344 s = results.1.runners_cold_seconds_per_tick",
            "7.2× = results.1.runners_vs_plain_cold_ratio",
            "0.011 s = results.1.steady_seconds_per_tick",
            "0.017 s = results.1.runners_steady_seconds_per_tick",
            "1.5× = results.1.runners_vs_plain_steady_ratio",
            "0 = results.1.runners_placements_on_a_node_that_does_not_serve_it",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 10⁶ | 0.576 s |",
        "clearing_runners.json",
        (
            "0.576 s = results.2.cold_seconds_per_tick",
            "3.70 s = results.2.runners_cold_seconds_per_tick",
            "6.4× = results.2.runners_vs_plain_cold_ratio",
            "0.089 s = results.2.steady_seconds_per_tick",
            "0.111 s = results.2.runners_steady_seconds_per_tick",
            "1.3× = results.2.runners_vs_plain_steady_ratio",
            "0 = results.2.runners_placements_on_a_node_that_does_not_serve_it",
        ),
    ),
    Shown(
        BENCHMARKS,
        "(The test suite ran on the other core meanwhile",
        "clearing_runners.json",
        ("4.6×", "6.5×", "6.4×", "1.7×", "1.5×", "1.7×"),
        EARLIER,
    ),
)
FIGURES += (
    Shown(
        BENCHMARKS,
        "No placement ever lands on a node that does not serve",
        "clearing_runners.json",
        (
            "3.2",
            "3.7 s = results.2.runners_cold_seconds_per_tick",
            "1 s",
            "0.11 = results.2.runners_steady_seconds_per_tick",
            "0.12 s",
            "0.1 s",
        ),
        "targets, and the other end of a range of runs",
    ),
    # ------------------------------------------------------------------ hostile tenants
    Shown(
        BENCHMARKS,
        "`benchmarks/fairness.py` floods the real service",
        "fairness.json",
        ("2 ×",),
        TARGET,
    ),
    Shown(
        BENCHMARKS,
        "| none (idle) |",
        "fairness.json",
        ("3.19 ms = idle.victim_p50_ms", "3.53 ms = idle.victim_p90_ms", "1"),
        "the idle p90 against itself",
    ),
    Shown(
        BENCHMARKS,
        "| 300 long-polls of one tenant |",
        "fairness.json",
        (
            "3.57 ms = floods.long_polls.victim_p50_ms",
            "4.28 ms = floods.long_polls.victim_p90_ms",
            "1.21 = floods.long_polls.p90_ratio_to_idle",
            "723 = floods.long_polls.refused_429_whole_flood",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 200 anonymous `/stream`s |",
        "fairness.json",
        (
            "3.58 ms = floods.streams.victim_p50_ms",
            "4.28 ms = floods.streams.victim_p90_ms",
            "1.21 = floods.streams.p90_ratio_to_idle",
            "576 = floods.streams.refused_429_whole_flood",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 40 anonymous `region: any` estimates at once |",
        "fairness.json",
        (
            "3.37 ms = floods.estimates.victim_p50_ms",
            "3.84 ms = floods.estimates.victim_p90_ms",
            "1.09 = floods.estimates.p90_ratio_to_idle",
            "118 = floods.estimates.refused_429_whole_flood",
        ),
    ),
    Shown(
        BENCHMARKS,
        "Before the caps, the watcher and the forecast cache",
        "fairness.json",
        ("291 ms", "40 ×", "30 s"),
        "the previous commit's run, said to be",
    ),
    Shown(
        BENCHMARKS,
        "`benchmarks/attacks.py` replays the other attacks",
        "attacks.json",
        (
            "39.3 s = seconds",
            "0.01",
            "40 × = sqlite.overspend.credit_0.01.codes.402",
            "0.01 = sqlite.overspend.credit_0.01.balance_after",
            "2 × = sqlite.overspend.credit_for_two.codes.201",
            "38 × = sqlite.overspend.credit_for_two.codes.402",
            "0.3258 = sqlite.overspend.credit_for_two.lowest_balance_seen",
            "0.15264 = postgresql.overspend.credit_for_two.lowest_balance_seen",
            "1.27 s = sqlite.silent_reclaimed_node.ended_after_silence_s",
            "1.5 s = sqlite.silent_reclaimed_node.heartbeat_timeout_s",
            "300 s = sqlite.silent_reclaimed_node.notice_deadline_s",
            "2 MB",
        ),
        WORKLOAD,
    ),
)
FIGURES += (
    # ------------------------------------------------------------------ the service over HTTP
    Shown(
        BENCHMARKS,
        "| bids created / s (8 clients, keep-alive) |",
        "api.json",
        ("229 = create.sqlite.bids_per_second", "149 = create.postgresql.bids_per_second"),
    ),
    Shown(
        BENCHMARKS,
        "| … each with a sealed 2 KB job environment (as the worker",
        "api.json",
        (
            "189 = create.sqlite_with_sealed_job.bids_per_second",
            "0.83× = create.sqlite_with_sealed_job.vs_plain",
            "149 = create.postgresql_with_sealed_job.bids_per_second",
            "1.00× = create.postgresql_with_sealed_job.vs_plain",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| create latency p50 / p99 |",
        "api.json",
        (
            "12 ms = create.sqlite.p50_ms",
            "340 ms = create.sqlite.p99_ms",
            "50 ms = create.postgresql.p50_ms",
            "91 ms = create.postgresql.p99_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| steady tick, 10,000 open bids (1,000 nodes) |",
        "api.json",
        (
            "3 ms = {tick.sqlite.0.steady_tick_seconds_median} * 1000",
            "4 ms = {tick.postgresql.0.steady_tick_seconds_median} * 1000",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| steady tick, 100,000 open bids (10,000 nodes) |",
        "api.json",
        (
            "12 ms = {tick.sqlite.1.steady_tick_seconds_median} * 1000",
            "13 ms = {tick.postgresql.1.steady_tick_seconds_median} * 1000",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| … the same book in the pure market, no database |",
        "api.json",
        ("1.8 ms = {market_only_tick_seconds.100000} * 1000",),
    ),
    Shown(
        BENCHMARKS,
        "| start to first tick (load + place everything)",
        "api.json",
        (
            "3.8 s = tick.sqlite.1.startup_to_first_tick_seconds",
            "5.6 s = tick.postgresql.1.startup_to_first_tick_seconds",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The trust model's price, measured side by side",
        "api.json",
        ("5 s", "0.8×", "246", "252 bids/s", "0.9", "1.1×", "2 KB"),
        "a side-by-side run against the commit before the trust model, said to be",
    ),
    Shown(
        BENCHMARKS,
        "Where the time goes (cProfile, in the JSON)",
        "api.json",
        ("3 ms", "0.25 s", "0.7 s", "2 ms = {market_only_tick_seconds.100000} * 1000"),
        "read off the profile and the service's logs, not the results' figures",
    ),
    Shown(BENCHMARKS, "**Bids in batches**", "api_bulk.json", ("20 ms",), WORKLOAD),
    Shown(
        BENCHMARKS,
        "| single bids / s (8 clients) |",
        "api_bulk.json",
        ("141 = sqlite.single_bids.bids_per_second", "96 = postgresql.single_bids.bids_per_second"),
    ),
    Shown(
        BENCHMARKS,
        "| batched bids / s, flat out (target ≥ 1,000) |",
        "api_bulk.json",
        (
            "2,189 = sqlite.batches.bids_per_second",
            "15.5× = sqlite.bulk_vs_single",
            "1,445 = postgresql.batches.bids_per_second",
            "15.0× = postgresql.bulk_vs_single",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| … each with a sealed 2 KB job environment | 1,417",
        "api_bulk.json",
        (
            "1,417 = sqlite.batches_with_sealed_job.bids_per_second",
            "1,018 = postgresql.batches_with_sealed_job.bids_per_second",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| a single bid beside batches at 1,000 bids/s",
        "api_bulk.json",
        (
            "19 = sqlite.batches_at_1000_per_second.single_bid_during_bulk_p50_ms",
            "121 ms = sqlite.batches_at_1000_per_second.single_bid_during_bulk_p99_ms",
            "30 = postgresql.batches_at_1000_per_second.single_bid_during_bulk_p50_ms",
            "100 ms = postgresql.batches_at_1000_per_second.single_bid_during_bulk_p99_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| a single bid, idle: p99 |",
        "api_bulk.json",
        (
            "21 ms = sqlite.batches_at_1000_per_second.single_bid_idle_p99_ms",
            "30 ms = postgresql.batches_at_1000_per_second.single_bid_idle_p99_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| the leader's longest tick meanwhile |",
        "api_bulk.json",
        (
            "0.09 s = sqlite.batches_at_1000_per_second.tick_seconds_max_during_bulk",
            "0.14 s = postgresql.batches_at_1000_per_second.tick_seconds_max_during_bulk",
        ),
    ),
)
FIGURES += (
    Shown(
        BENCHMARKS,
        "The p99 target is not met here",
        "api_bulk.json",
        ("0.3 ms", "0.13 s", "0.67 s"),
        "a profile's reading, and a tick measured before and after a change",
    ),
)
FIGURES += (
    # ------------------------------------------------------------------ fan-out
    Shown(
        BENCHMARKS,
        "`benchmarks/fanout.py --repeats 5`",
        "fanout.json",
        ("0.3 s = config.pace_seconds", "0.6 s"),
        WORKLOAD,
    ),
    Shown(
        BENCHMARKS,
        "| render, 96 frames (ideal 1.8 s) |",
        "fanout.json",
        (
            "40 s = render.one_run.makespan_seconds",
            "32 s = render.fan_out.makespan_seconds",
            "1.40 = render.makespan_vs_fan_out_each.0",
            "1.33 = render.makespan_vs_fan_out_each.1",
            "1.08 = render.makespan_vs_fan_out_each.2",
            "1.84 = render.makespan_vs_fan_out_each.3",
            "2.97 = render.makespan_vs_fan_out_each.4",
            "1.40 = render.makespan_vs_fan_out_median",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| clean, 40 shards (ideal 1.5 s) |",
        "fanout.json",
        (
            "34 s = clean.one_run.makespan_seconds",
            "32 s = clean.fan_out.makespan_seconds",
            "1.81 = clean.makespan_vs_fan_out_each.0",
            "1.60 = clean.makespan_vs_fan_out_each.1",
            "1.28 = clean.makespan_vs_fan_out_each.2",
            "1.74 = clean.makespan_vs_fan_out_each.3",
            "1.67 = clean.makespan_vs_fan_out_each.4",
            "1.67 = clean.makespan_vs_fan_out_median",
            "0 = clean.redone_units_max",
        ),
    ),
    Shown(
        BENCHMARKS,
        "Redone work stays under one shard per reclaim (the target)",
        "fanout.json",
        (
            "1.3×",
            "7.6 s",
            "10.3 s",
            "50 s",
            "3.6 s",
            "30 %",
            "32 s = render.fan_out.makespan_seconds",
            "10 %",
        ),
        "targets, and start-ups read from the agents' logs and Prefect's states",
    ),
    Shown(
        BENCHMARKS,
        "`benchmarks/fanout.py --sections wide`",
        "fanout.json",
        ("0.2 s", "2 s"),
        WORKLOAD,
    ),
    Shown(
        BENCHMARKS,
        "| 100 × 0.2 s, calm |",
        "fanout.json",
        (
            "222 s = wide.2.makespan_seconds",
            "11.3 = wide.2.children_created_per_second",
            "16 = wide.2.most_children_holding_gpus",
            "0.63 = wide.2.gpu_occupancy",
            "0 = wide.2.shards_redone",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 100 × 0.2 s, trouble |",
        "fanout.json",
        (
            "241 s = wide.3.makespan_seconds",
            "1.08 = wide.3.makespan_vs_calm",
            "12.7 = wide.3.children_created_per_second",
            "16 = wide.3.most_children_holding_gpus",
            "0.66 = wide.3.gpu_occupancy",
            "1 = wide.3.shards_redone",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 256 × 0.2 s, calm |",
        "fanout.json",
        (
            "536 s = wide.0.makespan_seconds",
            "14.0 = wide.0.children_created_per_second",
            "16 = wide.0.most_children_holding_gpus",
            "0.69 = wide.0.gpu_occupancy",
            "0 = wide.0.shards_redone",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 256 × 0.2 s, trouble |",
        "fanout.json",
        (
            "567 s = wide.1.makespan_seconds",
            "1.06 = wide.1.makespan_vs_calm",
            "5.4 = wide.1.children_created_per_second",
            "16 = wide.1.most_children_holding_gpus",
            "0.61 = wide.1.gpu_occupancy",
            "0 = wide.1.shards_redone",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 100 × 2 s, calm |",
        "fanout.json",
        (
            "240 s = wide.4.makespan_seconds",
            "9.5 = wide.4.children_created_per_second",
            "16 = wide.4.most_children_holding_gpus",
            "0.64 = wide.4.gpu_occupancy",
            "0 = wide.4.shards_redone",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 100 × 2 s, trouble |",
        "fanout.json",
        (
            "253 s = wide.5.makespan_seconds",
            "1.06 = wide.5.makespan_vs_calm",
            "2.2 = wide.5.children_created_per_second",
            "16 = wide.5.most_children_holding_gpus",
            "0.55 = wide.5.gpu_occupancy",
            "0 = wide.5.shards_redone",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The children fill every GPU (before:",
        "fanout.json",
        (
            "2.2 = wide.5.children_created_per_second",
            "12.7 = wide.3.children_created_per_second",
            "33 s = wide.0.per_shard_overhead_seconds",
            "0.2 s",
            "0.2 s",
            "2.2 s",
        ),
        "shards' sizes, and an estimate from the makespans",
    ),
    Shown(
        BENCHMARKS,
        "`benchmarks/fanout_dask.py` (`benchmarks/results/fanout_dask.json`)",
        "fanout_dask.json",
        ("0.2 s = config.shard_seconds", "125 s = config.ideal_seconds"),
    ),
    Shown(
        BENCHMARKS,
        "| calm | 149.6 s |",
        "fanout_dask.json",
        (
            "149.6 s = calm.makespan_seconds",
            "1.20 = calm.makespan_vs_ideal",
            "0.84 = calm.busy_share",
            "39 ms = calm.per_shard_overhead_ms",
            "0 = calm.redone_shards",
            "10,000 = calm.outputs_stored",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 3 reclaims + SIGKILL | 138.9 s |",
        "fanout_dask.json",
        (
            "138.9 s = troubled.makespan_seconds",
            "1.11 = troubled.makespan_vs_ideal",
            "0.90 = troubled.busy_share",
            "22 ms = troubled.per_shard_overhead_ms",
            "4 = troubled.redone_shards",
            "10,000 = troubled.outputs_stored",
        ),
    ),
    Shown(
        BENCHMARKS,
        "Targets met: ≤ 1.25 × ideal",
        "fanout_dask.json",
        (
            "1.25 ×",
            "10 %",
            "6.4 s = workers.seconds_to_join",
            "57 % = {calm.cost_so_far.saving} * 100",
            "130.5 s",
            "1.04 ×",
        ),
        "targets, and a quieter earlier run, said to be",
    ),
    Shown(
        BENCHMARKS,
        "| 100 × 0.2 s | 1.25 s |",
        "fanout_dask.json",
        (
            "1.25 s = cells.0.config.ideal_seconds",
            "1.6 s = cells.0.calm.makespan_seconds",
            "1.29 = cells.0.calm.makespan_vs_ideal",
            "1.8 s = cells.0.troubled.makespan_seconds",
            "1.13 = cells.0.troubled_vs_calm",
            "0 = cells.0.troubled.redone_shards",
            "57 ms = cells.0.calm.per_shard_overhead_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 100 × 2 s | 12.5 s |",
        "fanout_dask.json",
        (
            "12.5 s = cells.1.config.ideal_seconds",
            "14.1 s = cells.1.calm.makespan_seconds",
            "1.13 = cells.1.calm.makespan_vs_ideal",
            "16.2 s = cells.1.troubled.makespan_seconds",
            "1.15 = cells.1.troubled_vs_calm",
            "0 = cells.1.troubled.redone_shards",
            "253 ms = cells.1.calm.per_shard_overhead_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 1,000 × 0.2 s | 12.5 s |",
        "fanout_dask.json",
        (
            "12.5 s = cells.2.config.ideal_seconds",
            "13.5 s = cells.2.calm.makespan_seconds",
            "1.08 = cells.2.calm.makespan_vs_ideal",
            "20.1 s = cells.2.troubled.makespan_seconds",
            "1.49 = cells.2.troubled_vs_calm",
            "0 = cells.2.troubled.redone_shards",
            "16 ms = cells.2.calm.per_shard_overhead_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 1,000 × 2 s | 125 s |",
        "fanout_dask.json",
        (
            "125 s = cells.3.config.ideal_seconds",
            "126.5 s = cells.3.calm.makespan_seconds",
            "1.01 = cells.3.calm.makespan_vs_ideal",
            "130.9 s = cells.3.troubled.makespan_seconds",
            "1.03 = cells.3.troubled_vs_calm",
            "4 = cells.3.troubled.redone_shards",
            "24 ms = cells.3.calm.per_shard_overhead_ms",
        ),
    ),
    Shown(
        BENCHMARKS,
        "In runs of a dozen seconds, a reclaimed worker's replacement",
        "fanout_dask.json",
        ("10,000 ×", "2 s"),
        "a size not run",
    ),
)
FIGURES += (
    # ------------------------------------------------------------------ recovery
    Shown(
        BENCHMARKS,
        "`benchmarks/recovery.py` runs a real Prefect server",
        "recovery.json",
        ("10 s",),
        "Prefect's default poll",
    ),
    Shown(
        BENCHMARKS,
        "| scheduled run → bid placed (target ≤ 2 s) |",
        "recovery.json",
        (
            "0.74 s = ours_1s_poll.pickup_s.median",
            "6.86 s = prefect_default_10s_poll.pickup_s.median",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| job stopped on the reclaimed node → Running on the reserved node",
        "recovery.json",
        (
            "1.65 s = ours_1s_poll.resume_after_stop_s.median",
            "6.70 s = prefect_default_10s_poll.resume_after_stop_s.median",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| owner's reclaim → Running again (notice, final save, stop included) |",
        "recovery.json",
        (
            "1.84 s = ours_1s_poll.reclaim_to_running_s.median",
            "6.82 s = prefect_default_10s_poll.reclaim_to_running_s.median",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The resume is quick because the market reserved the target node",
        "recovery.json",
        ("2.01 s", "3.25 s"),
        EARLIER,
    ),
    Shown(
        BENCHMARKS,
        "**Start-up cost, cold against warm**",
        "recovery.json",
        ("30 s", "10 s = final_save_seconds"),
        WORKLOAD,
    ),
    Shown(
        BENCHMARKS,
        "| 1 s | 12.9 s |",
        "recovery.json",
        (
            "12.9 s = startup_cold_vs_warm.cold.1s.reclaim_to_running_s",
            "12.0 s = startup_cold_vs_warm.warm.1s.reclaim_to_running_s",
            "1.84 s = warm_reclaim_to_running_minus_final_save_s.1s",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 10 s | 21.8 s |",
        "recovery.json",
        (
            "21.8 s = startup_cold_vs_warm.cold.10s.reclaim_to_running_s",
            "12.0 s = startup_cold_vs_warm.warm.10s.reclaim_to_running_s",
            "1.82 s = warm_reclaim_to_running_minus_final_save_s.10s",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 30 s | 41.8 s |",
        "recovery.json",
        (
            "41.8 s = startup_cold_vs_warm.cold.30s.reclaim_to_running_s",
            "31.5 s = startup_cold_vs_warm.warm.30s.reclaim_to_running_s",
            "21.3 s = warm_reclaim_to_running_minus_final_save_s.30s",
        ),
    ),
    Shown(
        BENCHMARKS,
        "A warm resume's timeline (10 s set-up, one trial)",
        "recovery.json",
        (
            "10 s",
            "0.18 s = startup_cold_vs_warm.warm.10s.timelines.1.reserved",
            "11.57 s = startup_cold_vs_warm.warm.10s.timelines.1.warm",
            "10.40 s = startup_cold_vs_warm.warm.10s.timelines.1.durable",
            "11.68 s = startup_cold_vs_warm.warm.10s.timelines.1.running",
            "11.72 s = startup_cold_vs_warm.warm.10s.timelines.1.restored",
            "2 s",
            "20 s",
            "10 s = {startup_cold_vs_warm.cold.30s.reclaim_to_running_s}"
            " - {startup_cold_vs_warm.warm.30s.reclaim_to_running_s}",
        ),
        "the set-up's length, the target, and the set-up left after the final save",
    ),
)
FIGURES += (
    # ------------------------------------------------------------------ the dashboard
    Shown(
        BENCHMARKS,
        "| `/prices` |",
        "dashboard.json",
        (
            "1.1 ms = sqlite.reads.prices.p50_ms",
            "1.3 = sqlite.reads.prices.vs_baseline",
            "1.5 ms = postgresql.reads.prices.p50_ms",
            "1.9 = postgresql.reads.prices.vs_baseline",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| `/market/nodes` (1,000 nodes, 199 KB) |",
        "dashboard.json",
        (
            "34 ms = sqlite.reads.market nodes.p50_ms",
            "40 = sqlite.reads.market nodes.vs_baseline",
            "30 ms = postgresql.reads.market nodes.p50_ms",
            "38 = postgresql.reads.market nodes.vs_baseline",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| `/market/depth/A100-80G/eu-west` (10,000 bids) |",
        "dashboard.json",
        (
            "21 ms = sqlite.reads.order book.p50_ms",
            "25 = sqlite.reads.order book.vs_baseline",
            "19 ms = postgresql.reads.order book.p50_ms",
            "24 = postgresql.reads.order book.vs_baseline",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| `/metrics` (a scrape) |",
        "dashboard.json",
        (
            "3.2 ms = sqlite.reads.metrics scrape.p50_ms",
            "3.8 = sqlite.reads.metrics scrape.vs_baseline",
            "5.3 ms = postgresql.reads.metrics scrape.p50_ms",
            "6.6 = postgresql.reads.metrics scrape.vs_baseline",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The page is 25 KB (HTML 4 KB",
        "dashboard.json",
        (
            "25 KB = ({sqlite.page_bytes.html} + {sqlite.page_bytes.js} + {sqlite.page_bytes.css})"
            " / 1000",
            "4 KB = {sqlite.page_bytes.html} / 1000",
            "16 KB = {sqlite.page_bytes.js} / 1000",
            "6 KB = {sqlite.page_bytes.css} / 1000",
            "0.40 s = sqlite.stream.p50_s",
            "0.98 s = sqlite.stream.max_s",
            "2 s = sqlite.stream.ceiling_s",
        ),
    ),
)
_NO_CACHE, _CACHE, _APART = "one_process_no_cache", "one_process_cache", "leader_apart_cache"
FIGURES += (
    # ------------------------------------------------------------------ readers against the tick
    Shown(
        BENCHMARKS,
        "`benchmarks/reads.py` asks whether a crowd",
        "reads.json",
        ("100 reads/s", "15 s"),
        WORKLOAD,
    ),
    Shown(
        BENCHMARKS,
        "| one process, no public cache (`--public-cache 0`) |",
        "reads.json",
        (
            f"63× = {_NO_CACHE}.sqlite.ratios.tick_p50",
            f"15× = {_NO_CACHE}.sqlite.ratios.tick_p99",
            f"11× = {_NO_CACHE}.postgresql.ratios.tick_p50",
            f"28× = {_NO_CACHE}.postgresql.ratios.tick_p99",
            f"44 = {_NO_CACHE}.sqlite.readers.reads.achieved_reads_per_second",
            f"2.1 = {{{_NO_CACHE}.postgresql.readers.reads.read_p99_ms}} / 1000",
            f"3.5 s = {{{_NO_CACHE}.sqlite.readers.reads.read_p99_ms}} / 1000",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| one process, the public cache (the default) |",
        "reads.json",
        (
            f"1.09× = {_CACHE}.sqlite.ratios.tick_p50",
            f"5.8× = {_CACHE}.sqlite.ratios.tick_p99",
            f"1.09× = {_CACHE}.postgresql.ratios.tick_p50",
            f"2.3× = {_CACHE}.postgresql.ratios.tick_p99",
            f"98 = {_CACHE}.sqlite.readers.reads.achieved_reads_per_second",
            f"0.11 s = {{{_CACHE}.postgresql.readers.reads.read_p99_ms}} / 1000",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| the leader in a process of its own, readers on an API replica",
        "reads.json",
        (
            f"1.08× = {_APART}.sqlite.ratios.tick_p50",
            f"1.51× = {_APART}.sqlite.ratios.tick_p99",
            f"1.00× = {_APART}.postgresql.ratios.tick_p50",
            f"1.56× = {_APART}.postgresql.ratios.tick_p99",
            f"97 = {_APART}.postgresql.readers.reads.achieved_reads_per_second",
            f"0.18 = {{{_APART}.sqlite.readers.reads.read_p99_ms}} / 1000",
            f"0.25 s = {{{_APART}.postgresql.readers.reads.read_p99_ms}} / 1000",
        ),
    ),
    Shown(
        BENCHMARKS,
        "**Reads never wait for the write lock**",
        "reads.json",
        ("1 ms",),
        "a bound on the write lock's growth (0.94 ms in the cached run)",
    ),
    Shown(
        BENCHMARKS,
        "**What the readers cost the tick is CPU and the GIL.**",
        "reads.json",
        (
            f"24 ms = {{{_NO_CACHE}.sqlite.readers.service_cpu_cores}}"
            f" / {{{_NO_CACHE}.sqlite.readers.reads.achieved_reads_per_second}} * 1000",
            f"3 ms = {{{_CACHE}.sqlite.readers.service_cpu_cores}}"
            f" / {{{_CACHE}.sqlite.readers.reads.achieved_reads_per_second}} * 1000",
            f"97 ms = ({{{_CACHE}.sqlite.readers.tick_p99_s}}"
            f" - {{{_CACHE}.sqlite.idle.tick_p99_s}}) * 1000",
            f"70 ms = ({{{_CACHE}.postgresql.readers.tick_p99_s}}"
            f" - {{{_CACHE}.postgresql.idle.tick_p99_s}}) * 1000",
            "1 s",
        ),
        "the tick's interval",
    ),
    Shown(
        BENCHMARKS,
        "**At scale the leader runs apart**",
        "reads.json",
        (f"1.5× = {_APART}.sqlite.ratios.tick_p99",),
    ),
)
_SINGLE, _MULTI = "tables.single_region", "tables.multi_region"
_WORLDS = "mean_saving"
_BENCHMARK_WORLD = f"{_WORLDS}.demand, restarts 0.2 h, migrations 0.5 h (the benchmark)"
FIGURES += (
    # ------------------------------------------------------------------ market economics
    Shown(
        BENCHMARKS,
        "`benchmarks/replay.py` replays the 22 availability traces",
        "replay.json",
        (
            "0.90",
            "70 %",
            "2.10",
            "1.40 = assumptions.job.cap",
            "0.2 = assumptions.restart_overhead_h",
            "0.5 = assumptions.migration_overhead_h",
            "187 s = seconds",
        ),
        "the market's reserve and on-demand prices, set by the benchmark",
    ),
    *(
        Shown(
            BENCHMARKS,
            f"| {label}",
            "replay.json",
            (
                f"{single} = {{{_SINGLE}.{policy}.mean_saving}} * 100",
                f"{multi} = {{{_MULTI}.{policy}.mean_saving}} * 100",
            ),
        )
        for label, policy, single, multi in (
            ("greedy-spot (spot at the cap", "greedy-spot", "25.9 %", "28.9 %"),
            ("uniform-progress (pace-keeping bids) |", "uniform-progress", "26.0 %", "29.5 %"),
            ("deadline-aware (ours:", "deadline-aware", "26.2 %", "29.7 %"),
            ("**lower bound** (no policy", "lower-bound", "31.8 %", "39.7 %"),
            ("physical limit (owners' reserve", "physical-limit", "57.1 %", "57.1 %"),
            ("deadline-aware, restart 0.2 h (above) |", "deadline-aware", "26.2 %", "29.7 %"),
        )
    ),
    Shown(
        BENCHMARKS,
        "**With the restart measured, not assumed**",
        "replay.json",
        (
            "1.84 s = measured_restart.restart_overhead_s",
            "0.2 = assumptions.restart_overhead_h",
            "0.5 = assumptions.migration_overhead_h",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| deadline-aware, restart 1.84 s |",
        "replay.json",
        (
            "32.9 % = {measured_restart.single_region.deadline-aware.mean_saving} * 100",
            "35.3 % = {measured_restart.multi_region.deadline-aware.mean_saving} * 100",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| lower bound, restart 1.84 s |",
        "replay.json",
        (
            "38.4 % = {measured_restart.single_region.lower-bound.mean_saving} * 100",
            "46.8 % = {measured_restart.multi_region.lower-bound.mean_saving} * 100",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The measured overhead adds",
        "replay.json",
        (
            "6.8 = measured_restart.single_region.deadline-aware.points_over_assumed_restart",
            "5.6 points = measured_restart.multi_region.deadline-aware.points_over_assumed_restart",
            "6.6 = measured_restart.single_region.lower-bound.points_over_assumed_restart",
            "7.1 = measured_restart.multi_region.lower-bound.points_over_assumed_restart",
            "0.2 = assumptions.restart_overhead_h",
        ),
    ),
    Shown(
        BENCHMARKS,
        "**The lower bound is one**",
        "replay.json",
        ("34.0 %", "42.6 %"),
        "the bound before a change to repricing, said to be",
    ),
    Shown(
        BENCHMARKS,
        "**The targets set for the multi-region work are not met**",
        "replay.json",
        (
            "0.75 = targets.multi_region_ours_vs_bound.ratio",
            "0.90",
            "0.8 points = targets.multi_region_ours_over_greedy_points.points",
            "4.0 points = targets.multi_zone_dates_multi_over_single_points.points",
        ),
        TARGET,
    ),
    Shown(
        BENCHMARKS,
        "**Where the lead comes from** (`benchmarks/replay_decomposition.py`",
        "replay_decomposition.json",
        ("260 s = seconds",),
    ),
    *(
        Shown(
            BENCHMARKS,
            f"| {label} |",
            "replay_decomposition.json",
            tuple(
                f"{shown} = {{{_WORLDS}.{world}.{key}}}" + (" * 100" if "%" in shown else "")
                for shown, key in zip(
                    figures,
                    ("greedy-spot", "deadline-aware", "lower-bound", "bound_lead_over_ours_points"),
                    strict=True,
                )
            ),
        )
        for label, world, figures in (
            (
                "no competing demand, no overheads",
                "no demand, no overheads",
                ("51.2 %", "51.8 %", "53.0 %", "1.1 points"),
            ),
            (
                "no competing demand, restarts 0.2 h",
                "no demand, restarts 0.2 h",
                ("43.4 %", "43.8 %", "48.1 %", "4.3 points"),
            ),
            (
                "no competing demand, restarts 0.2 h, migrations 0.5 h",
                "no demand, restarts 0.2 h, migrations 0.5 h",
                ("39.0 %", "39.1 %", "47.0 %", "8.0 points"),
            ),
            (
                "competing demand, no overheads",
                "demand, no overheads",
                ("40.6 %", "41.2 %", "50.4 %", "9.2 points"),
            ),
            (
                "competing demand, restarts 0.2 h",
                "demand, restarts 0.2 h",
                ("33.2 %", "33.7 %", "40.8 %", "7.1 points"),
            ),
            (
                "competing demand, restarts 0.2 h, migrations 0.5 h (the benchmark)",
                "demand, restarts 0.2 h, migrations 0.5 h (the benchmark)",
                ("28.9 %", "29.7 %", "39.7 %", "10.0 points"),
            ),
        )
    ),
    Shown(
        BENCHMARKS,
        "With neither, the bound's conditions are close to sufficient",
        "replay_decomposition.json",
        (
            "1.1 points = mean_saving.no demand, no overheads.bound_lead_over_ours_points",
            "7 points = {mean_saving.no demand, restarts 0.2 h, migrations 0.5 h"
            ".bound_lead_over_ours_points}"
            " - {mean_saving.no demand, no overheads.bound_lead_over_ours_points}",
            "1.7 points",
            "38.1 %",
        ),
        "a variant of the bound run by hand",
    ),
    Shown(
        BENCHMARKS,
        "**Foresight used by a policy is worth little here.**",
        "replay.json",
        (
            "30.6 %",
            "28.5 %",
            "17.8 %",
            "15",
            "17 %",
            "28.2 %",
            "29.3 %",
            "27.9 %",
            "25.5",
            "27.5 %",
        ),
        "policies tried by hand on the same jobs and kept out of the registry",
    ),
    Shown(
        BENCHMARKS,
        "So the true optimum lies between about 31 %",
        "replay.json",
        (
            "31 %",
            f"39.7 % = {{{_MULTI}.lower-bound.mean_saving}} * 100",
            "0.75 = targets.multi_region_ours_vs_bound.ratio",
            "0.97",
        ),
        "the best policy tried by hand (30.6 %), and ours against it",
    ),
    *(
        Shown(
            page,
            "**Prices, forecast, estimate.** The service keeps",
            "forecast.json",
            (
                "80 %",
                "0.030 = summary.mae",
                "3.1 % = {summary.mape} * 100",
                "0.033 = summary.naive_mae",
                "0.89 × = summary.mae_vs_naive",
                "80 %",
                "78 % = {summary.band_80_coverage} * 100",
                "0.029 = summary.unweighted_mae",
            ),
            "the band's width",
        )
        for page in (BENCHMARKS, "explanation/economics.md")
    ),
    Shown(
        "explanation/economics.md",
        "On the shared traces, bidding `any` at the cap",
        "replay.json",
        (
            f"26 % = {{{_SINGLE}.deadline-aware.mean_saving}} * 100",
            f"30 % = {{{_MULTI}.deadline-aware.mean_saving}} * 100",
            f"10 points = ({{{_MULTI}.lower-bound.mean_saving}}"
            f" - {{{_MULTI}.deadline-aware.mean_saving}}) * 100",
        ),
    ),
)
_SAVES = "periodic_saves"
_CHECKPOINT_ROWS = (
    ("| raw write + fsync |", "0.95", "raw", "1.00"),
    ("| **ours** (checksums, manifest, fsyncs, atomic rename) |", "0.71", "ours", "1.33"),
    ("| ours, signed (BLAKE3 of every leaf", "0.72", "ours_signed", "1.32"),
    ("| torch.save + fsync |", "0.89", "torch_save", "1.07"),
    ("| safetensors + fsync |", "2.24", "safetensors", "0.42"),
)
FIGURES += (
    # ------------------------------------------------------------------ checkpoints
    Shown(
        BENCHMARKS,
        "`benchmarks/checkpoint.py` (1 GiB of float32 tensors",
        "checkpoint.json",
        ("1 GiB",),
        WORKLOAD,
    ),
    *(
        Shown(
            page,
            where,
            "checkpoint.json",
            (f"{seconds} = seconds.{writer}", f"{ratio} = ratio_to_raw.{writer}"),
        )
        for page in (BENCHMARKS, "users/checkpointing.md")
        for where, seconds, writer, ratio in _CHECKPOINT_ROWS
    ),
    Shown(
        BENCHMARKS,
        "(Ours beats the raw write on this noisy disk",
        "checkpoint.json",
        ("0.68 s", "0.69 s", "0.80×", "1 GiB", "1.04 s = notice_to_durable_seconds"),
        "earlier runs and formats, said to be; the state's size",
    ),
    Shown(
        BENCHMARKS,
        "| 1 GiB | 0.09 s |",
        "checkpoint.json",
        (
            f"0.09 s = {_SAVES}.1GiB.seconds.copy_floor",
            f"2.53 s = {_SAVES}.1GiB.seconds.sync_blocking",
            f"0.08 s = {_SAVES}.1GiB.seconds.async_blocking",
            f"0.94 = {_SAVES}.1GiB.async_blocking_over_copy_floor",
            f"0.16 s = {_SAVES}.1GiB.seconds.async_blocking_first",
            f"214 = {_SAVES}.1GiB.steps_per_second.no_save",
        ),
    ),
    Shown(
        BENCHMARKS,
        "| 4 GiB | 0.36 s |",
        "checkpoint.json",
        (
            f"0.36 s = {_SAVES}.4GiB.seconds.copy_floor",
            f"3.60 s = {_SAVES}.4GiB.seconds.sync_blocking",
            f"0.23 s = {_SAVES}.4GiB.seconds.async_blocking",
            f"0.64 = {_SAVES}.4GiB.async_blocking_over_copy_floor",
            f"3.01 s = {_SAVES}.4GiB.seconds.async_blocking_first",
            f"193 = {_SAVES}.4GiB.steps_per_second.no_save",
        ),
    ),
    Shown(
        BENCHMARKS,
        "The training loop waits for a snapshot only",
        "checkpoint.json",
        (
            f"3 = {{{_SAVES}.1GiB.async_blocking_over_sync}} * 100",
            f"6 % = {{{_SAVES}.4GiB.async_blocking_over_sync}} * 100",
            "1.5×",
            f"0.32 s = {_SAVES}.1GiB.seconds.fresh_copy",
            f"1.35 s = {_SAVES}.4GiB.seconds.fresh_copy",
            "4 GiB",
            "24 GiB",
            f"3.0 s = {_SAVES}.4GiB.seconds.async_blocking_first",
            f"1.00× = {_SAVES}.1GiB.staging_bytes_over_state",
            f"1.04× = {_SAVES}.1GiB.peak_rss_added_over_state",
            f"1.01× = {_SAVES}.4GiB.peak_rss_added_over_state",
            "0.9×",
        ),
        "targets, and the state's and the machine's memory",
    ),
    Shown(
        BENCHMARKS,
        "**A sharded FSDP2 state through DCP**",
        "checkpoint_dcp.json",
        ("1 GiB",),
        WORKLOAD,
    ),
    *(
        Shown(
            BENCHMARKS,
            where,
            "checkpoint_dcp.json",
            tuple(
                f"{shown} = ranks.{ranks}.{key}"
                for shown, key in zip(
                    figures,
                    (
                        "seconds.raw",
                        "seconds.ours",
                        "seconds.ours_signed",
                        "seconds.dcp_filesystem",
                        "ours_vs_raw",
                        "ours_signed_vs_raw",
                        "ours_vs_dcp_filesystem",
                        "seconds.dcp_alone",
                        "seconds.copy_floor",
                        "seconds.async_blocking",
                        "async_blocking_vs_copy_floor",
                    ),
                    strict=True,
                )
            ),
        )
        for where, ranks, figures in (
            (
                "| 2 | 0.517 s |",
                2,
                (
                    "0.517 s",
                    "0.563 s",
                    "0.607 s",
                    "0.684 s",
                    "0.92",
                    "0.85",
                    "1.21×",
                    "0.010 s",
                    "0.071 s",
                    "0.100 s",
                    "1.41",
                ),
            ),
            (
                "| 1 | 0.785 s |",
                1,
                (
                    "0.785 s",
                    "0.803 s",
                    "0.666 s",
                    "0.999 s",
                    "0.98",
                    "1.18",
                    "1.24×",
                    "0.005 s",
                    "0.105 s",
                    "0.159 s",
                    "1.51",
                ),
            ),
        )
    ),
    Shown(
        BENCHMARKS,
        "The asynchronous save holds the loop for about one copy",
        "checkpoint_dcp.json",
        (
            "8.5×",
            "0.92× = ranks.2.ours_vs_raw",
            "19 GB/s",
            "4 GB/s",
            "0.81×",
            "4 GB/s",
            "1.8",
            "0.76× = {ranks.2.seconds.raw} / {ranks.2.seconds.dcp_filesystem}",
            "10 ms = {ranks.2.seconds.dcp_alone} * 1000",
            "1.51 = ranks.1.async_blocking_vs_copy_floor",
            "1.12",
        ),
        "hashes' speeds a core, and earlier runs, said to be",
    ),
    # ------------------------------------------------------------------ the node agent
    *(
        Shown(
            page,
            "Measured by `tests/test_agent.py` (two real agents",
            "recovery.json",
            ("0.02", "0.05 s", "1.1", "1.2 s", "2.6", "2.9 s", "3 s"),
            "measured by a test, not a benchmark: no results file holds them",
        )
        for page in (BENCHMARKS, "operators/gpu-hosts.md")
    ),
)
FIGURES += (
    # ------------------------------------------------------------------ the other pages
    Shown(
        "operators/architecture.md",
        "- **Fast.** The writer runs at the storage's raw",
        "checkpoint.json",
        ("1.33 × = ratio_to_raw.ours", "1 GiB", "1.32 × = ratio_to_raw.ours_signed"),
        WORKLOAD,
    ),
    Shown(
        "operators/replicas.md",
        "One `spotgpu server start` serves a large market",
        "api.json",
        ("13 ms = {tick.postgresql.1.steady_tick_seconds_median} * 1000",),
    ),
    Shown(
        "operators/replicas.md",
        "Measured with 100 dashboard readers at 100 reads/s",
        "reads.json",
        (
            "100 reads/s",
            f"5.8× = {_CACHE}.sqlite.ratios.tick_p99",
            f"2.3× = {_CACHE}.postgresql.ratios.tick_p99",
            f"1.6× = {_APART}.postgresql.ratios.tick_p99",
        ),
        WORKLOAD,
    ),
    Shown(
        "users/checkpointing.md",
        "- **One copy of the state, reused.**",
        "checkpoint.json",
        (
            f"1.00× = {_SAVES}.1GiB.staging_bytes_over_state",
            f"1.01 = {_SAVES}.4GiB.peak_rss_added_over_state",
            f"1.04× = {_SAVES}.1GiB.peak_rss_added_over_state",
        ),
    ),
    Shown(
        "users/checkpointing.md",
        "`benchmarks/checkpoint.py` (1 GiB of float32 tensors",
        "checkpoint.json",
        ("1 GiB",),
        WORKLOAD,
    ),
    Shown(
        "users/checkpointing.md",
        "Signed saves, what a run under the worker writes",
        "checkpoint.json",
        ("0.80×", "1 GiB", "1.04 s = notice_to_durable_seconds"),
        "an earlier format's cost, said to be; the state's size",
    ),
    Shown(
        "users/checkpointing.md",
        "Through DCP (`--only dcp`",
        "checkpoint_dcp.json",
        (
            "1 GiB",
            "0.80 s = ranks.1.seconds.ours",
            "0.98× = ranks.1.ours_vs_raw",
            "0.56 s = ranks.2.seconds.ours",
            "0.92× = ranks.2.ours_vs_raw",
            "0.85× = ranks.2.ours_signed_vs_raw",
            "1.21 = ranks.2.ours_vs_dcp_filesystem",
            "1.24× = ranks.1.ours_vs_dcp_filesystem",
            "1.41 = ranks.2.async_blocking_vs_copy_floor",
            "1.51× = ranks.1.async_blocking_vs_copy_floor",
        ),
        WORKLOAD,
    ),
    Shown(
        "users/deploying.md",
        "**How quickly.** Measured by `benchmarks/recovery.py`",
        "recovery.json",
        (
            "0.74 s = ours_1s_poll.pickup_s.median",
            "1.65 s = ours_1s_poll.resume_after_stop_s.median",
            "10 s",
            "6.86 s = prefect_default_10s_poll.pickup_s.median",
            "6.70 s = prefect_default_10s_poll.resume_after_stop_s.median",
        ),
        "Prefect's default poll",
    ),
)
FIGURES += (
    Shown(
        "users/fan-out.md",
        "`benchmarks/fanout.py --repeats 5`",
        "fanout.json",
        ("0.3 s = config.pace_seconds", "0.6 s"),
        WORKLOAD,
    ),
    Shown(
        "users/fan-out.md",
        "| render, 96 frames |",
        "fanout.json",
        (
            "40 s = render.one_run.makespan_seconds",
            "32 s = render.fan_out.makespan_seconds",
            "1.40 = render.makespan_vs_fan_out_median",
        ),
    ),
    Shown(
        "users/fan-out.md",
        "| clean, 40 shards |",
        "fanout.json",
        (
            "34 s = clean.one_run.makespan_seconds",
            "32 s = clean.fan_out.makespan_seconds",
            "1.67 = clean.makespan_vs_fan_out_median",
            "0 = clean.redone_units_max",
        ),
    ),
    Shown(
        "users/fan-out.md",
        "Redone work stays under one shard per reclaim. Each reclaim",
        "fanout.json",
        ("7.6 s", "10.3 s"),
        "start-ups read from the agents' logs and Prefect's states, as the benchmarks page says",
    ),
    Shown(
        "users/decorated-flows.md",
        "Measured on two agents: reclaimed 5.6 s",
        "recovery.json",
        ("5.6 s", "14.8 s"),
        "measured by a test, not a benchmark: no results file holds them",
    ),
    Shown(
        "users/schedules-and-deadlines.md",
        "How the policies compare on real spot traces",
        "replay.json",
        (
            f"26 = {{{_SINGLE}.deadline-aware.mean_saving}} * 100",
            f"30 % = {{{_MULTI}.deadline-aware.mean_saving}} * 100",
        ),
    ),
)
