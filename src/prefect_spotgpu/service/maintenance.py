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

from sqlalchemy import Engine, text

from prefect_spotgpu.service.leader import ADVISORY_LOCK_KEY, Leadership
from prefect_spotgpu.service.settings import ServiceSettings


class ReplicaRunning(RuntimeError):
    """A replica of the market leads the tick loop: the operation did not begin."""


@contextlib.contextmanager
def maintenance_lock(engine: Engine, settings: ServiceSettings) -> Iterator[None]:
    """The tick leader's lock, held meanwhile; :class:`ReplicaRunning` when a replica holds
    it. On PostgreSQL it is unlocked at the end, not only given back to the pool with its
    connection (a pooled session would go on holding it)."""
    refused = ReplicaRunning(
        "a replica of this market is running (it holds the tick loop's lock): stop every "
        "replica, then run this again"
    )
    if engine.dialect.name != "postgresql":
        leadership = Leadership(engine, settings)
        if not leadership.try_acquire():
            raise refused
        try:
            yield
        finally:
            leadership.release()
        return
    key = {"key": ADVISORY_LOCK_KEY}
    with engine.connect() as connection:
        got = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), key).scalar()
        connection.commit()
        if not got:
            raise refused
        try:
            yield
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), key)
            connection.commit()
