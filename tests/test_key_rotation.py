"""``spotgpu server rotate-key``: a market's sealed job environments and webhook secrets,
re-sealed under a new key, on SQLite and PostgreSQL. A real service seals them and serves
them again after the rotation; the CLI runs as a real process (killed between batches once);
an interruption at the rotation's one seam (``after_batch``) is finished by running it again;
each refusal changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from conftest import one_database, start_service
from prefect_spotgpu.cli.app import app
from prefect_spotgpu.service.db import make_engine, migrate
from prefect_spotgpu.service.models import BidRow, Tenant
from prefect_spotgpu.service.resealing import rotate_key
from prefect_spotgpu.service.sealing import (
    SEALED,
    Sealer,
    SealError,
    check_sealing_key,
    new_key,
    open_secret,
    seal_job,
    seal_secret,
)
from prefect_spotgpu.service.settings import ServiceSettings
from prefect_spotgpu.service.webhooks import verify
from test_security import SECRET, job, node_jobs
from test_service_api import bid, wait_event
from test_service_webhooks import Receiver

WEBHOOK_SECRET = "a-webhook-secret-of-some-length"


def key_file(path: Path, key: str, mode: int = 0o600) -> Path:
    path.write_text(key + "\n")
    path.chmod(mode)
    return path


def cli_env(db_url: str, home: Path, **extra: str) -> dict[str, str]:
    """An operator's shell: the market's database and home, nothing else of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    return {
        **env,
        "SPOTGPU_DB_URL": db_url,
        "SPOTGPU_HOME": str(home),
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",
        **extra,
    }


def rotate_command(new: Path, *more: str) -> list[str]:
    cli = [sys.executable, "-m", "prefect_spotgpu.cli", "server", "rotate-key"]
    return [*cli, "--new-key-file", str(new), *more]


def stored(db_url: str) -> dict[tuple[str, int], str]:
    """Every sealed value at rest: (table, row id) -> what the column holds."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            bids = connection.execute(
                sa.text("SELECT id, job_env_sealed FROM bids WHERE job_env_sealed IS NOT NULL")
            )
            found = {("bids", i): v for i, v in bids}
            tenants = connection.execute(
                sa.text("SELECT id, webhook_secret FROM tenants WHERE webhook_secret IS NOT NULL")
            )
            found.update({("tenants", i): v for i, v in tenants})
        return found
    finally:
        engine.dispose()


def opens(value: str, sealer: Sealer) -> bool:
    try:
        open_secret(value, sealer) if value.startswith(SEALED) else sealer.open(value)
    except SealError:
        return False
    return True


def a_sealed_market(db_url: str, sealer: Sealer, *, bids: int, tenants: int = 3) -> None:
    """A market's rows at this version's schema: ``tenants`` with sealed webhook secrets
    and ``bids`` with sealed job environments (as the service writes them: sealing.py)."""
    engine = make_engine(db_url)
    now = datetime.now(UTC)
    try:
        migrate(engine)
        with Session(engine) as session, session.begin():
            for i in range(tenants):
                session.add(
                    Tenant(
                        name=f"t{i}",
                        credits_micros=0,
                        spent_micros=0,
                        webhook_secret=seal_secret(f"{WEBHOOK_SECRET}-{i}", sealer),
                        created_at=now,
                    )
                )
            session.flush()
            for i in range(bids):
                spec, sealed = seal_job(job(TOKEN=f"{SECRET}-{i}"), sealer)
                session.add(
                    BidRow(
                        tenant_id=1 + i % tenants,
                        gpu_model="A100-80G",
                        region="eu-west",
                        gpu_count=1,
                        max_price=1.0,
                        status="open",
                        job=spec,
                        job_env_sealed=sealed,
                        created_at=now,
                        updated_at=now,
                    )
                )
    finally:
        engine.dispose()


def test_a_rotated_market_serves_the_same_job_env_and_signs_with_the_same_secret(db_url, tmp_path):
    home = tmp_path / "home"  # the key is the one the service generates there
    receiver = Receiver(failures=0)
    service = start_service(db_url, home)
    try:
        alice, provider = service.tenant(), service.tenant()
        hook = {"url": receiver.url, "secret": WEBHOOK_SECRET}
        assert alice.put("/webhook", json=hook).status_code == 200
        node, agent = service.node(provider, gpus=8)
        running = bid(alice, gpu_count=8, max_price=1.0, job=job(AWS_SECRET_ACCESS_KEY=SECRET))
        for i in range(4):  # waiting bids, sealed too: several batches
            bid(alice, gpu_count=8, max_price=1.0, job=job(TOKEN=f"{SECRET}-{i}"))
        wait_event(alice, f"/bids/{running['id']}/events", "allocated")
        served = node_jobs(agent, node["id"])[running["id"]]
        assert served["env"] == {"AWS_SECRET_ACCESS_KEY": SECRET}
        service.wait_for(lambda: receiver.received, timeout=15)
    finally:
        service.stop()
    old = Sealer(old_key := (home / "secret_key").read_text().strip())
    before = stored(db_url)
    assert len(before) == 5 + 1 and all(opens(v, old) for v in before.values())

    new_file = tmp_path / "new-secret-key"  # made as the rotation page makes it
    spotgpu = Path(sys.executable).parent / "spotgpu"
    make = f"umask 077; {spotgpu} admin new-secret-key > {new_file}"
    subprocess.run(["sh", "-c", make], check=True, timeout=60)
    fresh = new_file.read_text().strip()
    assert new_file.stat().st_mode & 0o777 == 0o600
    out = subprocess.run(
        rotate_command(new_file, "--batch-size", "2"),
        env=cli_env(db_url, home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "re-sealed 5 job environment(s), 1 webhook secret(s) under the new key" in out.stdout
    assert (home / "secret_key").read_text().strip() == fresh
    assert (home / "secret_key.old").read_text().strip() == old_key
    assert (home / "secret_key").stat().st_mode & 0o777 == 0o600
    assert (home / "secret_key.old").stat().st_mode & 0o777 == 0o600

    after, new = stored(db_url), Sealer(fresh)
    assert after.keys() == before.keys()
    assert all(opens(v, new) and not opens(v, old) for v in after.values())
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:  # no plaintext in any column of either table
            for table in ("bids", "tenants"):
                rows = str(connection.execute(sa.text(f"SELECT * FROM {table}")).all())
                assert SECRET not in rows and WEBHOOK_SECRET not in rows
    finally:
        engine.dispose()

    service = start_service(db_url, home)  # the new key, from the home
    try:
        agent = service.client(node["token"])
        assert node_jobs(agent, node["id"])[running["id"]] == served
        signed = len(receiver.received)
        owner = service.client(provider.headers["Authorization"].removeprefix("Bearer "))
        owner.tenant_id = provider.tenant_id
        service.node(owner, name="second", gpus=8)  # a waiting bid runs: a new event
        service.wait_for(lambda: len(receiver.received) > signed, timeout=15)
        for delivery in receiver.received:  # before and after: the same secret signs
            assert verify(WEBHOOK_SECRET, delivery["headers"], delivery["body"])
    finally:
        service.stop()
        receiver.close()


def test_an_interrupted_rotation_starts_no_replica_and_is_finished_by_running_it_again(
    db_url, tmp_path
):
    old, new = Sealer(new_key()), Sealer(new_key())
    a_sealed_market(db_url, old, bids=5, tenants=3)
    settings = ServiceSettings(db_url=db_url, home=tmp_path / "home")
    engine = make_engine(db_url)
    batches = []

    def interrupt(batch) -> None:
        batches.append(batch)
        if len(batches) == 2:  # the database lost between two batches
            raise ConnectionError("server closed the connection unexpectedly")

    try:
        with pytest.raises(ConnectionError):
            rotate_key(
                engine=engine, settings=settings, old=old, new=new, rows=2, after_batch=interrupt
            )
        half = stored(db_url)
        assert sum(opens(v, new) for v in half.values()) == 4  # two committed batches of bids
        assert sum(opens(v, old) for v in half.values()) == 4
        for key in (old, new):  # neither key opens both ends: a replica refuses to start
            with Session(engine) as session, pytest.raises(SealError):
                check_sealing_key(session=session, sealer=key)

        done = rotate_key(engine=engine, settings=settings, old=old, new=new, rows=2)
        assert done.resealed == {"job environment": 1, "webhook secret": 3}
        assert done.current == {"job environment": 4, "webhook secret": 0}
        assert all(opens(v, new) and not opens(v, old) for v in stored(db_url).values())
        with Session(engine) as session:
            check_sealing_key(session=session, sealer=new)
            envs = {b.id: new.open(b.job_env_sealed) for b in session.scalars(sa.select(BidRow))}
        assert envs == {i + 1: {"TOKEN": f"{SECRET}-{i}"} for i in range(5)}

        again = rotate_key(engine=engine, settings=settings, old=old, new=new, rows=2)
        assert again.resealed == {"job environment": 0, "webhook secret": 0}
        assert sum(again.current.values()) == 8
    finally:
        engine.dispose()


def test_a_rotation_killed_between_batches_finishes_when_run_again(db_url, tmp_path):
    """The keys in the environment, as replicas have them: the command re-seals and says
    what to set; killed mid-way (SIGKILL), the same command finishes it."""
    old_key, fresh = new_key(), new_key()
    a_sealed_market(db_url, Sealer(old_key), bids=300, tenants=2)
    home = tmp_path / "home"
    new_file = key_file(tmp_path / "new-secret-key", fresh)
    env = cli_env(db_url, home, SPOTGPU_SECRET_KEY=old_key)
    command = rotate_command(new_file, "--batch-size", "1")
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "re-sealed 1 job environment(s) up to bid 1" in line, line
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
        process.stdout.close()
    half = stored(db_url)
    assert 0 < sum(opens(v, Sealer(fresh)) for v in half.values()) < len(half)

    again = rotate_command(new_file)  # (its batches' size is no matter)
    out = subprocess.run(again, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "already were" in out.stdout
    assert "set it to the key in" in out.stdout and "SPOTGPU_SECRET_KEY" in out.stdout
    assert not (home / "secret_key").exists()  # the environment's key is the operator's to set
    assert all(opens(v, Sealer(fresh)) for v in stored(db_url).values())

    # the environment now says the new key: the same command is refused, changing nothing
    env["SPOTGPU_SECRET_KEY"] = fresh
    out = subprocess.run(again, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds the key the values are sealed under now" in out.stdout


def invoke(db_url: str, home: Path, *args: str, **extra: str):
    """The command in this process (its refusals), in an operator's environment."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SPOTGPU_")}
    env.update(cli_env(db_url, home, **extra))
    return CliRunner().invoke(app, ["server", "rotate-key", *args], env=env)


def test_a_wrong_old_key_is_refused_naming_the_rows_and_nothing_changes(db_url, tmp_path):
    market_key, other = new_key(), Sealer(new_key())
    a_sealed_market(db_url, Sealer(market_key), bids=4, tenants=2)
    engine = make_engine(db_url)
    try:  # one bid written under another market's key (a replica with a home of its own)
        with engine.begin() as connection:
            connection.execute(
                sa.text("UPDATE bids SET job_env_sealed = :v WHERE id = 3"),
                {"v": other.seal({"TOKEN": "x"})},
            )
    finally:
        engine.dispose()
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    key_file(home / "secret_key", market_key)
    new_file = key_file(tmp_path / "new", new_key())
    before = stored(db_url)
    result = invoke(db_url, home, "--new-key-file", str(new_file))
    assert result.exit_code == 1, result.output
    assert "bid 3's job environment open(s) with neither" in result.output
    assert "nothing was changed" in result.output
    assert stored(db_url) == before
    assert (home / "secret_key").read_text().strip() == market_key  # the key stays too

    # the old key given wrongly: every row named, nothing changed
    wrong = key_file(tmp_path / "wrong", new_key())
    result = invoke(db_url, home, "--new-key-file", str(new_file), "--old-key-file", str(wrong))
    assert result.exit_code == 1
    assert "tenant 1's webhook secret" in result.output and "bid 4's" in result.output
    assert stored(db_url) == before


def test_the_rotation_refuses_while_a_replica_leads(service, tmp_path):
    """The tick leader's lock: an advisory lock on PostgreSQL, a file lock beside SQLite."""
    url = service.app.state.engine.url.render_as_string(hide_password=False)
    home = service.app.state.settings.home
    new_file = key_file(tmp_path / "new", new_key())
    before = stored(url)
    result = invoke(url, home, "--new-key-file", str(new_file))
    assert result.exit_code == 1, result.output
    assert "a replica of this market is running" in result.output
    assert stored(url) == before
    assert service.client().get("/health").json()["leader"]


@one_database("the key files are judged before the database is opened")
def test_a_bad_key_file_is_refused_before_anything_is_read(db_url, tmp_path):
    market_key = new_key()
    a_sealed_market(db_url, Sealer(market_key), bids=1, tenants=1)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    key_file(home / "secret_key", market_key)
    before = stored(db_url)
    cases = {
        "is open to every user of this host: chmod o-rw": key_file(
            tmp_path / "readable", new_key(), mode=0o644
        ),
        "does not hold a secret key (a Fernet key": key_file(tmp_path / "bad", "not-a-key"),
        "holds the key the values are sealed under now": key_file(tmp_path / "same", market_key),
    }
    for why, path in cases.items():
        result = invoke(db_url, home, "--new-key-file", str(path))
        assert result.exit_code == 2 and why in result.output, (why, result.output)
    readable_old = key_file(tmp_path / "old", market_key, mode=0o604)
    result = invoke(
        db_url,
        home,
        "--new-key-file",
        str(tmp_path / "readable"),
        "--old-key-file",
        str(readable_old),
    )
    assert result.exit_code == 2 and "open to every user" in result.output
    result = invoke(db_url, tmp_path / "nowhere", "--new-key-file", str(tmp_path / "bad"))
    assert result.exit_code == 2
    assert stored(db_url) == before and (home / "secret_key").read_text().strip() == market_key
    assert not (tmp_path / "nowhere").exists()


def test_a_second_rotation_keeps_the_first_old_key_too(tmp_path):
    """Backups taken before each rotation open only with the key of their time: a second
    rotation keeps the first one's old key (``secret_key.old.1``), never overwrites it."""
    from prefect_spotgpu.service.resealing import install_key

    first, second, third = new_key(), new_key(), new_key()
    home = tmp_path / "home"
    install_key(home=home, key=first)
    assert install_key(home=home, key=second) == home / "secret_key.old"
    assert install_key(home=home, key=third) == home / "secret_key.old"
    assert (home / "secret_key").read_text().strip() == third
    assert (home / "secret_key.old").read_text().strip() == second
    assert (home / "secret_key.old.1").read_text().strip() == first
    assert (home / "secret_key.old.1").stat().st_mode & 0o777 == 0o600
