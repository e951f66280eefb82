"""The lock an offline operation on the market's database holds: ``spotgpu server rotate-key``
(``resealing.py``) and a schema rollback run by the ``alembic`` command (``migrations/env.py``).

Such an operation needs every replica stopped. It cannot see every replica, but it can see the
one that leads the tick loop: it takes the tick leader's lock (``leader.py``: an advisory lock
on PostgreSQL, a file lock beside a SQLite database) for its whole run, refusing to begin while
a replica holds it, and no replica can lead meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import Engine

from prefect_spotgpu.service.leader import Leadership
from prefect_spotgpu.service.settings import ServiceSettings


class ReplicaRunning(RuntimeError):
    """A replica of the market leads the tick loop: the operation did not begin."""


@contextlib.contextmanager
def maintenance_lock(engine: Engine, settings: ServiceSettings) -> Iterator[None]:
    """The tick leader's lock, held meanwhile (``Leadership``, which lets go of it at the end
    on either database); :class:`ReplicaRunning` when a replica holds it."""
    leadership = Leadership(engine, settings)
    if not leadership.try_acquire():
        raise ReplicaRunning(
            "a replica of this market is running (it holds the tick loop's lock): stop every "
            "replica, then run this again"
        )
    try:
        yield
    finally:
        leadership.release()
