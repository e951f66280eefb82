"""``spotgpu server rotate-key``: every job environment and webhook secret the market keeps
sealed, re-sealed under a new secret key, with every replica stopped; then the new key where
the service reads it (``<home>/secret_key``), or the one line the operator must change
(``SPOTGPU_SECRET_KEY`` in the replicas' environment, which no command can edit).

The re-sealing itself is ``service/resealing.py``; this module reads the keys, refuses what
must not run (a key file other users can read, a malformed key, the same key twice, a database
behind the code, a replica still leading) and says what happened
(docs/operators/backup-and-upgrade.md#rotating-the-secret-key).
"""

from __future__ import annotations

from pathlib import Path

import typer

from prefect_spotgpu.cli.common import console
from prefect_spotgpu.cli.service_cmds import (
    DB,
    DB_URL_FILE,
    database_url,
    market_at_head,
    service_settings,
    shown,
)

NEW_KEY_FILE = typer.Option(
    ...,
    "--new-key-file",
    help="A file holding the new key, not readable by other users: `(umask 077; spotgpu "
    "admin new-secret-key > FILE)`.",
    exists=True,
    dir_okay=False,
    readable=True,
)
OLD_KEY_FILE = typer.Option(
    None,
    "--old-key-file",
    help="A file holding the key the values are sealed under now (default: the market's, "
    "SPOTGPU_SECRET_KEY or SPOTGPU_HOME/secret_key).",
    exists=True,
    dir_okay=False,
    readable=True,
)
BATCH_SIZE = typer.Option(
    500, "--batch-size", min=1, max=100_000, help="Rows re-sealed per transaction."
)


def rotate_key(
    new_key_file: Path = NEW_KEY_FILE,
    old_key_file: Path = OLD_KEY_FILE,
    db: str = DB,
    db_url_file: Path = DB_URL_FILE,
    batch_size: int = BATCH_SIZE,
) -> None:
    """Re-seal every job environment and webhook secret under a new secret key.

    Run it with every replica stopped, once, from one host (as `spotgpu server migrate`).
    Nothing is written unless every sealed value opens with the old key or the new one. Safe
    to run again: a value already under the new key is left as it is, so an interrupted
    rotation is finished by running the same command. Then the new key replaces
    SPOTGPU_HOME/secret_key (the old one is kept beside it as secret_key.old), or, when the
    key comes from SPOTGPU_SECRET_KEY, the command says to set it in every replica's
    environment before they start.
    """
    from prefect_spotgpu.service.db import DatabaseUnavailable
    from prefect_spotgpu.service.maintenance import ReplicaRunning
    from prefect_spotgpu.service.resealing import StillChanging, Unopenable, install_key
    from prefect_spotgpu.service.resealing import rotate_key as reseal

    new = _key_from(new_key_file)
    settings = service_settings(db_url=database_url(db, db_url_file))
    from_environment = settings.secret_key is not None
    old = _key_from(old_key_file) if old_key_file is not None else _market_key(settings)
    if old.key == new.key:
        source = old_key_file or ("SPOTGPU_SECRET_KEY" if from_environment else old.source)
        _refuse(f"{new_key_file} holds the key the values are sealed under now ({source})")
    where = shown(settings.database_url())
    engine = market_at_head(settings, "re-seal")
    try:
        rotation = reseal(
            engine=engine,
            settings=settings,
            old=old.sealer,
            new=new.sealer,
            rows=batch_size,
            after_batch=lambda batch: console.print(
                f"  re-sealed {batch.resealed} {batch.column.name}(s) up to "
                f"{batch.column.owner} {batch.last_id}",
                markup=False,
            ),
        )
    except DatabaseUnavailable as exc:
        _refuse(str(exc), code=1)
    except Unopenable as exc:
        _refuse(
            f"{exc}: nothing was changed. Is the old key the one the market seals with "
            "(SPOTGPU_SECRET_KEY, SPOTGPU_HOME/secret_key, or --old-key-file)?",
            code=1,
        )
    except (ReplicaRunning, StillChanging) as exc:
        _refuse(str(exc), code=1)
    finally:
        engine.dispose()
    done = ", ".join(f"{n} {name}(s)" for name, n in rotation.resealed.items()) or "nothing"
    already = sum(rotation.current.values())
    console.print(
        f"{where}: re-sealed {done} under the new key"
        + (f" ({already} already were)" if already else "")
        + (f"; sealed {rotation.plaintext} found in the clear" if rotation.plaintext else ""),
        markup=False,
        soft_wrap=True,
    )
    if from_environment:
        console.print(
            "The replicas read their key from SPOTGPU_SECRET_KEY: set it to the key in "
            f"{new_key_file} in every replica's environment (the environment file), then "
            "start them. Until then they refuse to start: their key opens nothing sealed.",
            style="yellow",
            markup=False,
            soft_wrap=True,
        )
        return
    kept = install_key(home=settings.home, key=new.key)
    console.print(f"the new key is in {settings.home / 'secret_key'}", markup=False)
    if kept is not None:
        console.print(
            f"the old key is in {kept}: database backups taken before now open only with it; "
            "keep it apart from them for as long as you keep them, then delete it",
            markup=False,
            soft_wrap=True,
        )


class _Key:
    """A key read for the rotation, with where it came from."""

    def __init__(self, key: str, source: Path | str) -> None:
        from prefect_spotgpu.service.sealing import Sealer

        self.key, self.source = key, source
        try:
            self.sealer = Sealer(key)
        except ValueError:
            _refuse(
                f"{source} does not hold a secret key (a Fernet key: 32 url-safe "
                "base64-encoded bytes, as `spotgpu admin new-secret-key` prints)"
            )


def _key_from(path: Path) -> _Key:
    """The key in ``path``; a file other users can read or write is refused, as a database
    URL file is (``server start --db-url-file``)."""
    if path.stat().st_mode & 0o006:
        _refuse(f"{path} is open to every user of this host: chmod o-rw {path} (a secret key)")
    return _Key(path.read_text().strip(), path)


def _market_key(settings) -> _Key:
    """The key the market's replicas seal with: ``SPOTGPU_SECRET_KEY``, else the home's key
    file (never a new one: a new key opens nothing)."""
    if settings.secret_key is not None:
        return _Key(settings.secret_key.get_secret_value(), "SPOTGPU_SECRET_KEY")
    path = settings.home / "secret_key"
    if not path.exists():
        _refuse(
            f"no secret key: SPOTGPU_SECRET_KEY is not set and {path} does not exist; give the "
            "key the market's values are sealed under with --old-key-file"
        )
    return _Key(path.read_text().strip(), path)


def _refuse(message: str, code: int = 2):
    console.print(message, style="red", markup=False, soft_wrap=True)
    raise typer.Exit(code)
