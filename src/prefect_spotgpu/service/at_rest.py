"""Files at rest: only the service's own user reaches what it keeps on disk.

Its home (``ServiceSettings.home``) is a directory of mode 0700; its key files (``admin_key``,
``secret_key``) and its SQLite database, with the ``-wal`` and ``-shm`` files beside it, are
0600. The service creates each of them only through this module: :func:`private_dir` makes the
home (``settings``; the CLI's local stack makes its home so too), :func:`create_once` writes a
key file, and :func:`create_private_file` makes an empty database file before SQLite first
opens it (``db.make_engine``; SQLite gives ``-wal`` and ``-shm`` the mode of their database).

At start, :func:`check_private_files` refuses a home that other users can list or write, and a
key file or database file that they can read or write, naming each path and its ``chmod``. It
refuses rather than warns, for the database too: the database holds every tenant's bids,
ledger and webhook URL, and write access to it is control of the market; a warning in a log
would leave every home an older version created (0755, with a 0644 database) open to the jobs
running beside the market, and the fix is one command. Execute (traverse) permission on the
home is allowed: an agent that shares ``SPOTGPU_HOME`` and runs jobs as other users needs it,
and the files inside are 0600.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import stat
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import URL, make_url

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
KEY_FILES = ("admin_key", "secret_key")
SQLITE_COMPANIONS = ("-wal", "-shm")

DIR_EXPOSED = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH  # listing, writing
FILE_EXPOSED = stat.S_IRWXG | stat.S_IRWXO


class FilesExposed(RuntimeError):
    """Files of the market that other local users can reach; the message names each one and
    the command that closes it."""


def private_dir(path: Path) -> Path:
    """``path``, created with mode 0700 when it is missing (missing parents get the usual
    mode). An existing directory keeps its mode: :func:`check_private_files` judges it."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    return path


def create_private_file(path: Path) -> None:
    """An empty ``path`` with mode 0600, unless it exists or its directory does not (then the
    caller's own error says so)."""
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))


def create_once(path: Path, value: Callable[[], str]) -> str:
    """What ``path`` holds (stripped); when it is missing, first written with ``value()``,
    mode 0600, atomically and exclusively: a replica starting beside us never reads half a
    key, nor keeps a key of its own."""
    if not path.exists():
        private_dir(path.parent)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(value() + "\n")
            with contextlib.suppress(FileExistsError):  # another replica's came first
                os.link(tmp, path)
        finally:
            tmp.unlink()
    return path.read_text().strip()


def replace_private_file(path: Path, text: str) -> None:
    """``path`` holding ``text``, mode 0600, replaced in one step (never half written)."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sqlite_file(url: str | URL) -> Path | None:
    """The database file of a SQLite URL; None for PostgreSQL, an in-memory database or a
    ``file:`` URI."""
    url = make_url(url)
    database = url.database
    if url.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    return None if database.startswith("file:") else Path(database)


def exposed_files(*, home: Path, database: Path | None) -> dict[Path, str]:
    """Each file or directory of the market that other users can reach, with a line saying so
    and its fix (empty: none)."""
    found = {}

    def judge(path: Path, bits: int, fix: str) -> None:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            return
        if mode & bits:
            command = f"{fix} {shlex.quote(str(path))}"
            found[path] = f"{path} is mode {mode:04o}, open to other users: `{command}`"

    judge(home, DIR_EXPOSED, "chmod 700")
    for name in KEY_FILES:
        judge(home / name, FILE_EXPOSED, "chmod 600")
    if database is not None:
        for suffix in ("", *SQLITE_COMPANIONS):
            judge(database.with_name(database.name + suffix), FILE_EXPOSED, "chmod 600")
    return found


def check_private_files(*, home: Path, database: Path | None) -> None:
    """Raise :class:`FilesExposed` naming every file of the market that other users can reach
    (the home, its key files, the SQLite database and its ``-wal`` and ``-shm``). Call it
    before connecting: SQLite gives a new ``-wal`` or ``-shm`` the database's mode."""
    if found := exposed_files(home=home, database=database):
        keys = any(home / name in found for name in KEY_FILES)
        raise FilesExposed(
            "refusing to start: other users of this host can reach the market's files: "
            + "; ".join(found.values())
            + (" (a key that others could read may have been read: replace it)" if keys else "")
        )
