"""Two attempts of one run never commit to one checkpoint key (checkpoint/fencing.py): two
writers of one key, each an attempt of the run (its allocation id, as a node sets it), on
local storage and on S3 (moto's server). Once the later attempt has claimed the key (its
restore), the earlier one's saves are refused — periodic, direct and final — and nothing of it
is committed or deleted; the later attempt's checkpoints are what a third attempt resumes."""

from __future__ import annotations

import logging

import pytest

from prefect_spotgpu.checkpoint import Checkpointer, LocalStorage, StaleAttempt
from prefect_spotgpu.protocol import JOB_ENV
from test_checkpoint_s3 import bucket  # noqa: F401 (a fixture)
from test_checkpoint_s3 import storage as s3_storage

KEY = "flow-run-fenced"


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "ckpt")
    endpoint = request.getfixturevalue("s3_endpoint")
    name, _ = request.getfixturevalue("bucket")
    return s3_storage(endpoint, name)


def attempt(monkeypatch, store, allocation_id: int | None, **options) -> Checkpointer:
    """A checkpointer as the job of ``allocation_id`` builds it (None: off the market)."""
    if allocation_id is None:
        monkeypatch.delenv(JOB_ENV.ALLOCATION_ID, raising=False)
        monkeypatch.delenv(JOB_ENV.GANG_LEAD_ALLOCATION, raising=False)
    else:
        monkeypatch.setenv(JOB_ENV.ALLOCATION_ID, str(allocation_id))
    monkeypatch.delenv(JOB_ENV.CHECKPOINT_SIGNING_KEY, raising=False)
    return Checkpointer(store, KEY, every=1e-6, background=False, keep=1, **options)


def test_a_stale_attempt_commits_nothing_once_a_later_one_claimed_the_key(
    monkeypatch, store, caplog
):
    old = attempt(monkeypatch, store, 7)
    assert old.restore() is None
    old.save({"by": 7}, 10)
    new = attempt(monkeypatch, store, 9)  # the run resumed elsewhere; the old copy lives on
    assert new.restore().state == {"by": 7}
    with pytest.raises(StaleAttempt, match="allocation 9; this is allocation 7"):
        old.save({"by": 7}, 11)  # a direct save
    with caplog.at_level(logging.WARNING, logger="prefect_spotgpu.checkpoint"):
        assert old.maybe_save({"by": 7}, 12) is None  # a periodic one: refused, logged
    assert "later attempt" in caplog.text
    assert store.steps(KEY) == [10]  # nothing of the stale attempt committed
    new.save({"by": 9}, 11)
    old.save = None  # (never again: it could only delete)
    assert store.steps(KEY) == [11]  # the later attempt's retention, not the stale one's
    third = attempt(monkeypatch, store, 12)
    assert third.restore().state == {"by": 9}


def test_the_stale_attempts_final_save_is_refused_and_said(monkeypatch, store, tmp_path):
    ack = tmp_path / "notice.json.ack"
    monkeypatch.setenv(JOB_ENV.ACK_FILE, str(ack))
    notice = tmp_path / "notice.json"
    notice.write_text('{"deadline": 9999999999}')
    monkeypatch.setenv(JOB_ENV.NOTICE_FILE, str(notice))
    old = attempt(monkeypatch, store, 3)
    old.restore()
    attempt(monkeypatch, store, 4).restore()
    with pytest.raises(StaleAttempt):
        old.maybe_save({"by": 3}, 5)
    assert '"failed": true' in ack.read_text()
    assert store.steps(KEY) == []


def test_the_ranks_of_one_gang_attempt_share_rank_0s_allocation_as_their_attempt(
    monkeypatch, store
):
    """Rank 1's allocation id is above rank 0's (the market numbers members in rank order):
    fenced by its own, it would refuse rank 0's saves to a key both write (a DCP checkpoint).
    Every rank fences with the gang's lead allocation; the next attempt's lead is higher."""
    monkeypatch.setenv(JOB_ENV.GANG_LEAD_ALLOCATION, "20")
    rank0 = attempt(monkeypatch, store, 20)
    rank1 = attempt(monkeypatch, store, 21)
    assert rank1.restore() is None and rank0.restore() is None
    rank0.save({"by": 0}, 1)  # not refused: rank 1 claimed the key for the same attempt
    monkeypatch.setenv(JOB_ENV.GANG_LEAD_ALLOCATION, "23")  # the gang resumed: 23, 24
    attempt(monkeypatch, store, 24).restore()
    with pytest.raises(StaleAttempt, match="allocation 23; this is allocation 20"):
        rank0.save({"by": 0}, 2)


def test_off_the_market_nothing_is_fenced(monkeypatch, store):
    first, second = attempt(monkeypatch, store, None), attempt(monkeypatch, store, None)
    first.save({"n": 1}, 1)
    second.restore()
    first.save({"n": 2}, 2)  # a user's own two checkpointers: as before
    assert store.steps(KEY) == [2]
    assert store.latest_claim(KEY) is None


def test_directories_are_shared_only_under_a_tenants_setgid_directory(tmp_path, monkeypatch):
    """Under a node's tenant directory (setgid, 2770) a key's directories are writable by the
    tenant's group whatever the umask (each attempt is another job user); elsewhere they keep
    the mode the umask gives (a user's own checkpoints are not opened to their group)."""
    import os
    import stat

    old = os.umask(0o022)  # a container's
    try:
        tenant = tmp_path / "tenant-2"
        tenant.mkdir()
        tenant.chmod(0o2770)
        own = tmp_path / "own"
        for root in (tenant, own):
            attempt(monkeypatch, LocalStorage(root), 5).save({"n": 1}, 1)
    finally:
        os.umask(old)
    for made in (tenant / KEY, tenant / KEY / ".attempts"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o2770, made
    for made in (own / KEY, own / KEY / ".attempts"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o755, made
