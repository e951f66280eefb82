"""Who may tick: exactly one replica leads the tick loop.

A PostgreSQL advisory lock (or a file lock beside a SQLite database) elects the leader; the
one ``tick_leader`` row keeps its epoch. A replica that becomes leader bumps the epoch
(:func:`take_over`), and every tick transaction fences on it (:func:`fence`), so a leader that
lost its lock cannot commit a stale tick: the row is written only here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from sqlalchemy import Engine, text, update
from sqlalchemy.orm import Session

from prefect_spotgpu.service.models import TickLeader
from prefect_spotgpu.service.settings import ServiceSettings

ADVISORY_LOCK_KEY = 0x53504F54_47505531 & 0x7FFFFFFFFFFFFFFF  # "SPOTGPU1"


class LostLeadership(Exception):
    pass


class Leadership:
    """Who may tick: an advisory lock on PostgreSQL, a file lock beside a SQLite file."""

    def __init__(self, engine: Engine, settings: ServiceSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._connection = None
        self._file = None

    def try_acquire(self) -> bool:
        if self.engine.dialect.name == "postgresql":
            if self._connection is None:
                self._connection = self.engine.connect()
            got = self._connection.execute(
                text("SELECT pg_try_advisory_lock(:key)"), {"key": ADVISORY_LOCK_KEY}
            ).scalar()
            self._connection.commit()
            return bool(got)
        path = self._lock_path()
        # 0600: another local user who could open it could flock it and stop every replica
        # from leading (a file the service made before 0600 is narrowed: it owns it)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o600)
        self._file = os.fdopen(fd, "a+")  # held for as long as we lead
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            self._file = None
            return False
        return True

    def check(self) -> None:
        """Raise LostLeadership when the lock's connection is gone."""
        if self._connection is not None:
            try:
                self._connection.execute(text("SELECT 1"))
                self._connection.commit()
            except Exception as exc:  # the lock died with its connection
                self.release()
                raise LostLeadership(str(exc)) from exc

    def release(self) -> None:
        """Let go of the lock. On PostgreSQL the lock belongs to the database session, which
        a pooled connection's ``close`` would keep alive (the lock with it, and no replica could
        lead until this process exits): the connection is discarded instead."""
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.invalidate()
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None
        if self._file is not None:
            with contextlib.suppress(Exception):
                fcntl.flock(self._file, fcntl.LOCK_UN)
                self._file.close()
            self._file = None

    def _lock_path(self) -> str:
        database = self.engine.url.database
        if database and database != ":memory:":
            return database + ".leader"
        self.settings.home.mkdir(parents=True, exist_ok=True)
        return str(self.settings.home / "memory.leader")


def take_over(*, session: Session, holder: str, now: float) -> int:
    """Make ``holder`` the tick leader (under the row's lock); returns its new epoch."""
    row = session.get(TickLeader, 1, with_for_update=True)
    if row is None:
        row = TickLeader(id=1, epoch=0, holder="", heartbeat_at=0.0)
        session.add(row)
    row.epoch += 1
    row.holder = holder
    row.heartbeat_at = now
    session.flush()
    return row.epoch


def fence(*, session: Session, epoch: int, now: float) -> None:
    """Heartbeat the leader's row in this transaction, or raise LostLeadership when another
    replica took over since ``epoch`` (the transaction then commits nothing)."""
    result = session.execute(
        update(TickLeader)
        .where(TickLeader.id == 1, TickLeader.epoch == epoch)
        .values(heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        raise LostLeadership("another replica took over the tick loop")
