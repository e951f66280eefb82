"""Re-sealing under a new secret key (``spotgpu server rotate-key``): every bid's sealed job
environment (``bids.job_env_sealed``) and every tenant's sealed webhook secret
(``tenants.webhook_secret``) is opened with the old key and sealed again with the new one, one
batch of rows per transaction; what an older version left in the clear is sealed with the new
key last (``sealing.seal_plaintext_jobs``, ``seal_plaintext_webhook_secrets``).

What stays true:

- **Nothing is written unless everything opens.** A first pass opens every sealed value with
  the new key or the old one; a value neither opens (a wrong old key, another market's rows, a
  tampered row) stops the rotation before its first write (:class:`Unopenable` names each row).
- **Resumable and idempotent.** A value the new key already opens is left as it is. A Fernet
  token is authenticated, so which key opens it is known without a key id in the value (and
  values sealed before rotation existed read as they always did): a rotation that stopped
  half-way (killed between batches, a lost connection) is finished by running it again with
  the same two keys, and running it once more changes nothing.
- **A half-done rotation starts no replica.** Rows are re-sealed in id order, so until a
  rotation finishes, the oldest and the newest value of a column are under different keys and
  ``sealing.check_sealing_key`` (which opens both) refuses either key at start.
- **One writer.** It runs with every replica stopped and holds the tick leader's lock for its
  whole run (``maintenance.maintenance_lock``): it refuses to begin while a replica leads, and
  no replica can lead meanwhile. A replica that serves the API without ticking is not seen; a
  value it seals under the old key during the rotation is found by a later pass (a rotation
  ends with a pass that re-seals nothing, :class:`StillChanging` after a few).

Example::

    >>> from prefect_spotgpu.service.sealing import new_key
    >>> old, new = Sealer(new_key()), Sealer(new_key())
    >>> verdict(old.seal_text("s3cr3t"), old=old, new=new)
    <Verdict.RESEAL: 'reseal'>
    >>> verdict(new.seal_text("s3cr3t"), old=old, new=new)
    <Verdict.CURRENT: 'current'>
    >>> verdict(Sealer(new_key()).seal_text("s3cr3t"), old=old, new=new)
    <Verdict.UNOPENABLE: 'unopenable'>
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from sqlalchemy import Engine, bindparam, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from prefect_spotgpu.service.at_rest import private_dir, replace_private_file
from prefect_spotgpu.service.db import make_sessionmaker
from prefect_spotgpu.service.maintenance import maintenance_lock
from prefect_spotgpu.service.models import BidRow, Tenant
from prefect_spotgpu.service.sealing import (
    SEALED,
    Sealer,
    SealError,
    seal_plaintext_jobs,
    seal_plaintext_webhook_secrets,
)
from prefect_spotgpu.service.settings import ServiceSettings

BATCH_ROWS = 500
"""Rows re-sealed per transaction by default: transactions of a few milliseconds."""
MAX_PASSES = 3
"""Passes over every column before values still appearing under the old key are an error."""


class Verdict(StrEnum):
    """What a rotation does with one sealed value."""

    CURRENT = "current"  # the new key opens it: left as it is (an earlier run re-sealed it)
    RESEAL = "reseal"  # the old key opens it: sealed again under the new one
    UNOPENABLE = "unopenable"  # neither key opens it: the rotation stops, nothing written


def verdict(token: str, *, old: Sealer, new: Sealer) -> Verdict:
    """Which key opens ``token`` (a Fernet token, without any prefix)."""
    for sealer, answer in ((new, Verdict.CURRENT), (old, Verdict.RESEAL)):
        try:
            sealer.open_text(token)
        except SealError:
            continue
        return answer
    return Verdict.UNOPENABLE


@dataclass(frozen=True)
class SealedColumn:
    """A column that holds sealed values: its rows' id, and the prefix its values carry."""

    name: str  # what a value is, for messages: "job environment"
    owner: str  # what a row is: "bid"
    row_id: InstrumentedAttribute
    value: InstrumentedAttribute
    prefix: str = ""  # before the Fernet token ("sealed:"); a value without it is plaintext

    def sealed_rows(self):
        """SQL: the rows whose value is sealed (a case-sensitive prefix test)."""
        query = select(self.row_id, self.value).where(self.value.is_not(None))
        if self.prefix:
            query = query.where(func.substr(self.value, 1, len(self.prefix)) == self.prefix)
        return query.order_by(self.row_id)


SEALED_COLUMNS = (
    SealedColumn("job environment", "bid", BidRow.id, BidRow.job_env_sealed),
    SealedColumn("webhook secret", "tenant", Tenant.id, Tenant.webhook_secret, prefix=SEALED),
)
"""Everything the market seals under its secret key (``service/sealing.py``)."""


class Unopenable(RuntimeError):
    """Sealed values that neither key opens; nothing was written. ``rows``: each one named."""

    def __init__(self, rows: list[str]) -> None:
        shown = ", ".join(rows[:10]) + (f" and {len(rows) - 10} more" if len(rows) > 10 else "")
        super().__init__(f"{shown} open(s) with neither the old key nor the new one")
        self.rows = rows


class StillChanging(RuntimeError):
    """Values kept appearing under the old key: a replica still serves the API."""


@dataclass(frozen=True)
class Batch:
    """One committed batch of a column: its last row id and what it did."""

    column: SealedColumn
    last_id: int
    resealed: int
    current: int


@dataclass
class Rotation:
    """What a rotation did, per column name."""

    resealed: dict[str, int] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=dict)  # already under the new key
    plaintext: int = 0  # values found in the clear (an older version's), sealed under the new

    def count(self, batch: Batch, *, first_pass: bool) -> None:
        name = batch.column.name
        self.resealed[name] = self.resealed.get(name, 0) + batch.resealed
        if first_pass:  # (a later pass finds what the first re-sealed: current again)
            self.current[name] = self.current.get(name, 0) + batch.current


def unopenable_rows(*, session: Session, old: Sealer, new: Sealer) -> list[str]:
    """Each sealed value that neither key opens, as ``bid 17's job environment``."""
    found = []
    for column in SEALED_COLUMNS:
        rows = session.execute(column.sealed_rows().execution_options(yield_per=1000))
        for row_id, stored in rows:
            token = stored.removeprefix(column.prefix)
            if verdict(token, old=old, new=new) is Verdict.UNOPENABLE:
                found.append(f"{column.owner} {row_id}'s {column.name}")
    return found


def reseal_batch(
    *, session: Session, column: SealedColumn, old: Sealer, new: Sealer, after_id: int, rows: int
) -> Batch | None:
    """Re-seal the next ``rows`` sealed values of ``column`` after ``after_id`` under the new
    key (locked, each written only if it is still what was read); None: no rows are left."""
    found = session.execute(
        column.sealed_rows().where(column.row_id > after_id).limit(rows).with_for_update()
    ).all()
    if not found:
        return None
    writes, current = [], 0
    for row_id, stored in found:
        token = stored.removeprefix(column.prefix)
        match verdict(token, old=old, new=new):
            case Verdict.CURRENT:
                current += 1
            case Verdict.RESEAL:
                resealed = column.prefix + new.seal_text(old.open_text(token))
                writes.append({"row": row_id, "was": stored, "now": resealed})
            case Verdict.UNOPENABLE:  # written since the first pass, by another key's replica
                raise Unopenable([f"{column.owner} {row_id}'s {column.name}"])
    if writes:
        table = column.value.class_.__table__
        id_name, value_name = column.row_id.key, column.value.key
        session.connection().execute(
            table.update()
            .where(table.c[id_name] == bindparam("row"), table.c[value_name] == bindparam("was"))
            .values({value_name: bindparam("now")}),
            writes,
        )
    return Batch(column, found[-1][0], resealed=len(writes), current=current)


def rotate_key(
    *,
    engine: Engine,
    settings: ServiceSettings,
    old: Sealer,
    new: Sealer,
    rows: int = BATCH_ROWS,
    after_batch: Callable[[Batch], None] | None = None,
) -> Rotation:
    """Re-seal everything sealed under ``old`` under ``new``, a transaction per batch of
    ``rows``; ``after_batch`` is called after each batch commits (the CLI's progress).

    Raises ``maintenance.ReplicaRunning`` (a replica leads: nothing done), :class:`Unopenable`
    (nothing written) and :class:`StillChanging`."""
    sessions = make_sessionmaker(engine)
    rotation = Rotation()
    with maintenance_lock(engine, settings):
        with sessions() as session:
            if unopenable := unopenable_rows(session=session, old=old, new=new):
                raise Unopenable(unopenable)
        for attempt in range(MAX_PASSES):
            resealed = 0
            for column in SEALED_COLUMNS:
                for batch in _batches(sessions, column, old=old, new=new, rows=rows):
                    resealed += batch.resealed
                    rotation.count(batch, first_pass=attempt == 0)
                    if after_batch is not None:
                        after_batch(batch)
            if resealed == 0:
                break
        else:
            raise StillChanging(
                f"values sealed under the old key still appeared after {MAX_PASSES} passes: "
                "a replica still serves the API; stop it, then run this again"
            )
        with sessions.begin() as session:
            rotation.plaintext = seal_plaintext_jobs(session=session, sealer=new)
            rotation.plaintext += seal_plaintext_webhook_secrets(session=session, sealer=new)
        return rotation


def _batches(
    sessions: sessionmaker[Session], column: SealedColumn, *, old: Sealer, new: Sealer, rows: int
) -> Iterator[Batch]:
    """One pass over ``column``: each batch, committed in a transaction of its own."""
    after_id = 0
    while True:
        with sessions.begin() as session:
            batch = reseal_batch(
                session=session, column=column, old=old, new=new, after_id=after_id, rows=rows
            )
        if batch is None:
            return
        yield batch
        after_id = batch.last_id


def install_key(*, home: Path, key: str) -> Path | None:
    """Make ``key`` the one in ``<home>/secret_key`` (where the service reads it when
    ``SPOTGPU_SECRET_KEY`` is not set), atomically, mode 0600; the key it replaces is kept
    in ``secret_key.old`` (the backups taken before the rotation open only with it; a key an
    earlier rotation kept there moves to ``secret_key.old.1``, ``.2``, ..., never lost), whose
    path is returned (None: there was none)."""
    private_dir(home)
    path, kept = home / "secret_key", home / "secret_key.old"
    previous = path.read_text().strip() if path.exists() else None
    if previous == key:
        return None
    if previous and kept.exists() and kept.read_text().strip() != previous:
        n = 1
        while (home / f"secret_key.old.{n}").exists():
            n += 1
        replace_private_file(home / f"secret_key.old.{n}", kept.read_text().strip())
    if previous:
        replace_private_file(kept, previous)
    replace_private_file(path, key)
    return kept if previous else None
