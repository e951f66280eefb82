"""The tick leader's lock, let go: another replica (another Leadership on its own connection)
can take it at once, on SQLite (a file lock) and on PostgreSQL (a session's advisory lock,
which a pooled connection would keep after ``close``)."""

from __future__ import annotations

import sqlalchemy as sa

from prefect_spotgpu.service.leader import Leadership
from prefect_spotgpu.service.settings import ServiceSettings


def test_a_released_lock_is_taken_by_the_next_replica_at_once(db_url, tmp_path):
    engine = sa.create_engine(db_url)
    settings = ServiceSettings(home=tmp_path / "home")
    first, second = Leadership(engine, settings), Leadership(engine, settings)
    try:
        assert first.try_acquire()
        assert not second.try_acquire()  # one leader
        first.release()
        assert second.try_acquire(), "the released lock is still held"
    finally:
        first.release()
        second.release()
        engine.dispose()
