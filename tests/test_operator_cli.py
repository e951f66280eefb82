"""The operator's commands, run as an operator would, against real databases and a real service:
``spotgpu admin credit``, ``spotgpu server migrate`` (replicas do not migrate as they start),
``spotgpu admin`` without an admin key, and the database URL kept out of argv."""

from __future__ import annotations

import os

import pytest
from alembic import command
from alembic.script import ScriptDirectory

from conftest import ADMIN_KEY, one_database
from prefect_spotgpu.service.api import create_app
from prefect_spotgpu.service.db import (
    SchemaBehind,
    _config,
    make_engine,
    schema_status,
)
from prefect_spotgpu.service.settings import ServiceSettings
from test_cli import spotgpu

HEAD = ScriptDirectory.from_config(_config()).get_current_head()  # this version's


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGPU_")}
    return {**env, "COLUMNS": "200", **extra}


@one_database("the CLI's rendering of the API's replies")
def test_admin_credit_adds_a_ledger_entry_the_tenant_reads_with_its_reason(service):
    tenant = service.tenant("dora", credit=1.0)
    env = _env(SPOTGPU_MARKET_URL=service.base_url, SPOTGPU_ADMIN_KEY=ADMIN_KEY)
    out = spotgpu("admin", "credit", "dora", "2.5", "--reason", "outage 2026-12-04", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "credited dora 2.500000" in out.stdout and "balance 3.5000" in out.stdout
    assert tenant.get("/me").json()["balance"] == pytest.approx(3.5)
    credits = [e for e in tenant.get("/ledger").json()["entries"] if e["kind"] == "credit"]
    assert [(e["amount"], e["reason"]) for e in credits] == [(2.5, "outage 2026-12-04")]

    # bad input names the field and writes nothing; no reason is a usage error
    out = spotgpu("admin", "credit", "dora", "0", "--reason", "x", env=env)
    assert out.returncode == 1 and "amount" in out.stdout, out.stdout
    out = spotgpu("admin", "credit", "dora", "1", env=env)
    assert out.returncode == 2 and "--reason" in out.stderr
    out = spotgpu("admin", "credit", "nobody", "1", "--reason", "x", env=env)
    assert out.returncode == 1 and "no tenant named 'nobody'" in out.stdout
    assert tenant.get("/me").json()["balance"] == pytest.approx(3.5)

    # a tenant's own key is not the operator's: the route refuses it
    hostile = _env(SPOTGPU_MARKET_URL=service.base_url, SPOTGPU_ADMIN_KEY=tenant_key(tenant))
    out = spotgpu("admin", "credit", "dora", "1000", "--reason", "free money", env=hostile)
    assert out.returncode == 1 and "error 40" in out.stdout
    assert tenant.get("/me").json()["balance"] == pytest.approx(3.5)

    # the market's refusal quotes what was sent: printed as text, markup and all
    out = spotgpu("admin", "create-tenant", "[/x] [bold]", env=env)
    assert out.returncode == 1 and not out.stderr, out.stdout + out.stderr
    assert "error 422" in out.stdout and "[/x] [bold]" in out.stdout, out.stdout
    tenants = spotgpu("admin", "tenants", env=env)
    assert tenants.returncode == 0 and "[/x]" not in tenants.stdout and "dora" in tenants.stdout


def tenant_key(client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


def test_admin_without_a_key_refuses_naming_where_one_goes_and_makes_none(tmp_path):
    home = tmp_path / "home"
    env = _env(SPOTGPU_HOME=str(home), SPOTGPU_MARKET_URL="http://127.0.0.1:9")
    for args in (("tenants",), ("credit", "x", "1", "--reason", "r"), ("grant-provider", "x")):
        out = spotgpu("admin", *args, env=env)
        assert out.returncode == 2, out.stdout + out.stderr
        text = " ".join(out.stdout.split())
        assert "SPOTGPU_ADMIN_KEY" in text and str(home / "admin_key") in text, text
    assert not (home / "admin_key").exists()  # no new key: the market would refuse it


def test_a_password_in_db_on_the_command_line_is_refused(tmp_path):
    url = "postgresql+psycopg://spot:hunter2@127.0.0.1:5432/test"
    for command_ in (("server", "start"), ("server", "migrate")):
        out = spotgpu(*command_, "--db", url, env=_env(SPOTGPU_HOME=str(tmp_path)))
        assert out.returncode == 2
        text = " ".join(out.stdout.split())
        assert "SPOTGPU_DB_URL" in text and "--db-url-file" in text and "hunter2" not in text


def test_migrate_dry_run_lists_the_steps_then_migrate_applies_them_once(db_url, tmp_path):
    home = str(tmp_path / "home")
    url_file = tmp_path / "db-url"
    url_file.write_text(db_url + "\n")
    url_file.chmod(0o600)
    env = _env(SPOTGPU_HOME=home)
    engine = make_engine(db_url)
    try:
        _alembic(engine, command.upgrade, "0007")  # a market of an older version
        assert schema_status(engine).current == "0007"

        out = spotgpu("server", "migrate", "--db-url-file", str(url_file), "--dry-run", env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "revision 0007" in out.stdout and "0008" in out.stdout and HEAD in out.stdout
        assert f"{int(HEAD) - 7} migration(s) would be applied" in out.stdout
        assert schema_status(engine).current == "0007"  # a dry run writes nothing

        # a replica starting now refuses, naming the command; it does not migrate
        settings = ServiceSettings(home=home, db_url=db_url, run_ticker=False)
        with pytest.raises(SchemaBehind, match="spotgpu server migrate"):
            create_app(settings)
        assert schema_status(engine).current == "0007"

        out = spotgpu("server", "migrate", "--db-url-file", str(url_file), env=env)
        assert out.returncode == 0 and f"migrated to {HEAD}" in out.stdout, out.stdout
        out = spotgpu("server", "migrate", env={**env, "SPOTGPU_DB_URL": db_url})
        assert out.returncode == 0 and "nothing to migrate" in out.stdout
        create_app(settings)  # now it starts
    finally:
        engine.dispose()


def test_an_empty_database_gets_its_schema_at_start_and_migrate_at_start_upgrades(db_url, tmp_path):
    engine = make_engine(db_url)
    try:
        settings = ServiceSettings(home=tmp_path / "home", db_url=db_url, run_ticker=False)
        create_app(settings)  # a new market: nothing to lose, the schema is created
        assert schema_status(engine).pending == []
        _alembic(engine, command.downgrade, "0008")
        create_app(settings.model_copy(update={"migrate_at_start": True}))  # one host
        assert schema_status(engine).current == HEAD
    finally:
        engine.dispose()


def _alembic(engine, verb, revision: str) -> None:
    """Alembic's ``verb`` (upgrade, downgrade) to ``revision``, as ``db.migrate`` runs it."""
    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        verb(config, revision)


def test_a_database_url_never_shows_its_password(tmp_path):
    env = _env(SPOTGPU_HOME=str(tmp_path / "home"))
    hidden = "postgresql+psycopg://spot@127.0.0.1:5432/test?password=hunter2"
    out = spotgpu("server", "migrate", "--db", hidden, env=env)
    assert out.returncode == 2 and "hunter2" not in out.stdout + out.stderr
    assert "carries a password" in " ".join(out.stdout.split())
    # a systemd-style line in the file is a bad URL: named, its password never printed
    url_file = tmp_path / "db-url"
    url_file.write_text("SPOTGPU_DB_URL=postgresql+psycopg://spot:hunter2@db/market\n")
    url_file.chmod(0o600)
    out = spotgpu("server", "migrate", "--db-url-file", str(url_file), env=env)
    assert out.returncode == 2 and "db_url" in out.stdout, out.stdout
    assert "hunter2" not in out.stdout + out.stderr
    url_file.chmod(0o644)  # every user of the host could read it
    out = spotgpu("server", "migrate", "--db-url-file", str(url_file), env=env)
    assert out.returncode == 2 and "chmod o-r" in out.stdout


def test_an_admin_key_file_open_to_others_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "admin_key").write_text("sgadm_x\n")
    (home / "admin_key").chmod(0o644)
    out = spotgpu("admin", "tenants", env=_env(SPOTGPU_HOME=str(home)))
    assert out.returncode == 2 and "chmod 600" in " ".join(out.stdout.split()), out.stdout


def test_replicas_migrating_an_empty_database_at_once_both_succeed(db_url, tmp_path):
    import subprocess
    import sys

    url_file = tmp_path / "db-url"
    url_file.write_text(db_url + "\n")
    url_file.chmod(0o600)
    env = _env(SPOTGPU_HOME=str(tmp_path / "home"))
    command_ = [sys.executable, "-m", "prefect_spotgpu.cli", "server", "migrate"]
    both = [
        subprocess.Popen(
            [*command_, "--db-url-file", str(url_file)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    engine = make_engine(db_url)
    try:
        assert schema_status(engine).current == HEAD
    finally:
        engine.dispose()


def test_a_database_a_newer_version_migrated_is_refused_naming_why(db_url, tmp_path):
    from sqlalchemy import text

    engine = make_engine(db_url)
    try:
        _alembic(engine, command.upgrade, "head")
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
        settings = ServiceSettings(home=tmp_path / "home", db_url=db_url, run_ticker=False)
        with pytest.raises(SchemaBehind, match="9999, which this version"):
            create_app(settings)
    finally:
        engine.dispose()
