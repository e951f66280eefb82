"""Files at rest, as the attacker: a job running under another user on the market's
host. It finds no file of the market it can read (mode bits: the home 0700, the SQLite
database, its -wal and -shm and the key files 0600, whatever the umask the service started
under); a key file that others can read stops the service from starting, with a message naming
it; and the webhook signing secret in the database is sealed, never the plaintext, while
deliveries are still signed with the original secret — a plaintext secret an older version
stored included, which the service seals when it starts."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from standardwebhooks.webhooks import Webhook

from conftest import ADMIN_KEY, start_service
from prefect_spotgpu.cli.stack import LocalStack, free_port
from prefect_spotgpu.service.api import create_app
from prefect_spotgpu.service.at_rest import FilesExposed
from prefect_spotgpu.service.sealing import SEALED, new_key, seal_plaintext_webhook_secrets
from prefect_spotgpu.service.settings import ServiceSettings
from prefect_spotgpu.service.webhooks import standard_secret, verify
from test_service_webhooks import SECRET, Receiver

OTHERS = stat.S_IRWXG | stat.S_IRWXO


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    """The process's umask for a while (the service must not rely on the operator's)."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def sqlite_files(db_url: str) -> list[Path]:
    database = Path(sa.make_url(db_url).database)
    return [database.with_name(database.name + s) for s in ("", "-wal", "-shm")]


def stored_secret(db_url: str, tenant_id: int) -> str | None:
    """The tenant's row as someone holding the database reads it: no key, plain SQL."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as connection:
            return connection.execute(
                sa.text("SELECT webhook_secret FROM tenants WHERE id = :id"), {"id": tenant_id}
            ).scalar_one()
    finally:
        engine.dispose()


def key_of(client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


def signed_delivery(svc, key: str, receiver: Receiver, secret: str) -> None:
    """A bid of the tenant of ``key``, whose webhook is ``receiver``: its event arrives signed
    with ``secret``."""
    buyer = svc.client(key)
    svc.node(svc.tenant())
    buyer.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
    svc.wait_for(lambda: receiver.events("allocated"), timeout=15)
    delivery = receiver.events("allocated")[0]
    assert verify(secret, delivery["headers"], delivery["body"])
    Webhook(standard_secret(secret)).verify(delivery["body"], delivery["headers"])


# ---------------------------------------------------------------- modes


def test_another_user_reads_none_of_the_markets_files(db_url, tmp_path):
    """Started under umask 000 (every file the service made with the default mode would be
    0666): the home, the key file and, on SQLite, the database, -wal and -shm are private."""
    home = tmp_path / "home"
    with umask(0):
        svc = start_service(db_url, home)
    try:
        svc.tenant()  # a write: the WAL holds it
        files = [home / "secret_key"]
        if db_url.startswith("sqlite"):
            # the leader's lock file too: a user who could open it could flock it, and no
            # replica would ever lead
            files += [*sqlite_files(db_url), Path(sa.make_url(db_url).database + ".leader")]
        for path in files:
            assert path.exists(), path
            assert mode(path) == 0o600, f"{path}: {mode(path):o}"
    finally:
        svc.stop()
    assert mode(home) == 0o700


def test_the_default_home_its_database_and_the_admin_key_are_private(tmp_path):
    home = tmp_path / "a" / ".spotgpu"
    with umask(0):
        settings = ServiceSettings(home=home, admin_key=None, secret_key=None)
        key = settings.resolved_admin_key()
        app = create_app(settings, background=False)
        try:
            with app.state.sessions.begin() as session:
                session.execute(sa.text("SELECT 1 FROM tenants"))
            database = home / "market.db"
            assert settings.database_url() == f"sqlite:///{database}"
            for path in (home / "admin_key", home / "secret_key", database):
                assert mode(path) == 0o600, f"{path}: {mode(path):o}"
        finally:
            app.state.engine.dispose()
        stack = LocalStack(tmp_path / "stack")  # the CLI's local stack makes its home too
    assert key.startswith("sgadm_") and (home / "admin_key").read_text().strip() == key
    assert mode(home) == 0o700 and mode(stack.home) == 0o700


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", ["secret_key", "admin_key"])
def test_a_key_file_others_can_read_stops_the_start(tmp_path, name):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    key = home / name
    key.write_text((new_key() if name == "secret_key" else "sgadm_" + "x" * 32) + "\n")
    key.chmod(0o644)
    settings = ServiceSettings(db_url=f"sqlite:///{tmp_path / 'm.db'}", home=home)
    with pytest.raises(FilesExposed) as refused:
        create_app(settings, background=False)
    assert f"{key} is mode 0644" in str(refused.value)
    assert f"chmod 600 {key}" in str(refused.value)
    key.chmod(0o600)  # the fix it names
    app = create_app(settings, background=False)
    app.state.engine.dispose()


def test_a_home_or_database_others_can_reach_stops_the_start_too(tmp_path):
    home = tmp_path / "home"
    settings = ServiceSettings(home=home, admin_key=ADMIN_KEY)
    create_app(settings, background=False).state.engine.dispose()
    database = home / "market.db"
    home.chmod(0o755)  # as older versions made it, with a 0644 database
    database.chmod(0o644)
    with pytest.raises(FilesExposed) as refused:
        create_app(settings, background=False)
    message = str(refused.value)
    assert f"{home} is mode 0755" in message and f"chmod 700 {home}" in message
    assert f"{database} is mode 0644" in message and f"chmod 600 {database}" in message
    database.chmod(0o600)
    home.chmod(0o711)  # traversal alone is allowed (an agent's job users sharing the home)
    create_app(settings, background=False).state.engine.dispose()


def test_the_server_command_refuses_in_one_line_naming_the_file(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    key = home / "secret_key"
    key.write_text(new_key() + "\n")
    key.chmod(0o604)
    env = {**os.environ, "SPOTGPU_HOME": str(home), "SPOTGPU_ADMIN_KEY": ADMIN_KEY}
    env.pop("SPOTGPU_SECRET_KEY", None)
    command = [sys.executable, "-m", "prefect_spotgpu.cli", "server", "start"]
    command += ["--db", f"sqlite:///{tmp_path / 'm.db'}", "--port", str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"chmod 600 {key}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# ---------------------------------------------------------------- webhook secrets


@pytest.fixture
def receiver():
    r = Receiver(failures=0)
    yield r
    r.close()


def test_the_stored_webhook_secret_is_sealed_and_deliveries_sign_with_the_original(
    service, db_url, receiver
):
    alice = service.tenant()
    put = alice.put("/webhook", json={"url": receiver.url, "secret": SECRET})
    assert put.status_code == 200 and put.json() == {"url": receiver.url, "has_secret": True}
    stored = stored_secret(db_url, alice.tenant_id)
    assert stored.startswith(SEALED) and SECRET not in stored
    assert service.app.state.sealer.open_text(stored.removeprefix(SEALED)) == SECRET
    if db_url.startswith("sqlite"):  # the attacker's view: the bytes on disk
        for path in sqlite_files(db_url):
            assert SECRET.encode() not in (path.read_bytes() if path.exists() else b"")
    for response in (
        put,
        alice.get("/webhook"),
        alice.get("/me"),
        service.admin.get("/tenants"),
        alice.get("/webhook/deliveries"),
    ):
        assert response.status_code == 200, response.text
        assert SECRET not in response.text and stored not in response.text
    signed_delivery(service, key_of(alice), receiver, SECRET)
    # setting only the URL keeps the sealed secret
    assert alice.put("/webhook", json={"url": receiver.url}).json()["has_secret"] is True
    assert stored_secret(db_url, alice.tenant_id) == stored


def test_a_plaintext_secret_of_an_older_version_is_sealed_at_start_and_still_signs(
    db_url, tmp_path, receiver
):
    home = tmp_path / "home"
    svc = start_service(db_url, home)
    try:
        alice = svc.tenant()
        alice.put("/webhook", json={"url": receiver.url, "secret": SECRET})
    finally:
        svc.stop()
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as connection:  # as a version before sealing stored it
            connection.execute(
                sa.text("UPDATE tenants SET webhook_secret = :s WHERE id = :id"),
                {"s": SECRET, "id": alice.tenant_id},
            )
        svc = start_service(db_url, home)  # the same home: the same secret key
        try:
            stored = stored_secret(db_url, alice.tenant_id)
            assert stored.startswith(SEALED) and SECRET not in stored
            sealer = svc.app.state.sealer
            with svc.app.state.sessions.begin() as session:  # sealing again changes nothing
                assert seal_plaintext_webhook_secrets(session=session, sealer=sealer) == 0
            assert stored_secret(db_url, alice.tenant_id) == stored
            signed_delivery(svc, key_of(alice), receiver, SECRET)
        finally:
            svc.stop()
    finally:
        engine.dispose()
    if db_url.startswith("sqlite"):
        for path in sqlite_files(db_url):
            assert not path.exists() or mode(path) & OTHERS == 0
