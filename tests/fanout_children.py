"""Child flows the fan-out tests decorate with ``@spot_gpu`` (a module of their own: the
bundle pickles the flow's module by value, and a test module's is not meant to travel)."""

import time

from prefect import flow


@flow(name="one-follower")
def square(index: int) -> int:
    time.sleep(1.0)
    return index * index


@flow(name="slow-or-failing")
def slow_or_failing(index: int, fail: bool) -> int:
    if fail:
        raise ValueError(f"shard {index} is broken")
    time.sleep(60.0)
    return index
