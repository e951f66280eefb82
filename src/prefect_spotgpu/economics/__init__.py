"""Pure time-and-money logic shared by the worker, the CLI and the benchmarks: the deadline
bidding policies (``deadline``), the cheap night/weekend window (``schedules``) and the
replay of spot availability traces through the real market (``replay``). No Prefect, no HTTP.
"""
