"""Schema migrations: create_all equals the migrated schema; migrate twice is a no-op; --check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from celery import Celery

from durable_celery import Durable
from durable_celery.store.migrate import VERSION_TABLE
from durable_celery.store.schema import compare_filter, metadata
from tests.conftest import PG_HOST

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["postgres", "sqlite"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/m.sqlite3"
        return
    name = f"durable_m_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"{PG_HOST}/{name}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_migrated_schema_equals_create_all_and_second_migrate_is_noop(empty_url):
    durable = Durable(Celery("m", broker="memory://"), empty_url, upkeep=False)
    assert durable.pending_migrations() != []
    lines = []
    applied = durable.migrate(progress=lines.append)
    assert applied and lines[-1].startswith("applied")
    assert durable.pending_migrations() == []
    with durable.db.engine.connect() as conn:
        opts = {"version_table": VERSION_TABLE, "include_object": compare_filter(conn.dialect.name)}
        context = MigrationContext.configure(conn, opts=opts)
        diff = compare_metadata(context, metadata)
    assert diff == []
    assert durable.migrate(progress=lines.append) == []
    assert lines[-1] == "database is up to date"
    durable.db.dispose()


def test_cli_migrate_check_fails_when_behind_and_passes_after_migrate(empty_url, tmp_path):
    module = tmp_path / "cliapp.py"
    module.write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            from durable_celery import Durable
            app = Celery("cliapp", broker="memory://")
            durable = Durable(app, {empty_url!r})
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def celery(*args):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "cliapp", "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    behind = celery("migrate", "--check")
    assert behind.returncode == 1, behind.stderr
    assert "behind" in behind.stdout
    done = celery("migrate")
    assert done.returncode == 0, done.stderr
    assert "applying 0001" in done.stdout
    current = celery("migrate", "--check")
    assert current.returncode == 0 and "up to date" in current.stdout
    assert celery("--help").returncode == 0
    listing = celery("runs")
    assert listing.returncode == 0 and listing.stdout.startswith("id")


def test_a_worker_on_a_schema_behind_its_code_refuses_to_start(empty_url, caplog):
    from alembic import command
    from celery.exceptions import WorkerShutdown

    from durable_celery.store.migrate import alembic_config
    from durable_celery.worker.upkeep import refuse_old_schema

    durable = Durable(Celery("behind", broker="memory://"), empty_url, upkeep=False)
    command.upgrade(alembic_config(durable.db), "0003")  # the schema of the previous release
    with caplog.at_level("ERROR", logger="durable_celery"), pytest.raises(WorkerShutdown) as stopped:
        refuse_old_schema(durable.runtime)  # what each worker runs as it starts
    assert stopped.value.code == 1
    assert "pending revisions: 0004" in caplog.text and "durable migrate" in caplog.text
    durable.migrate()
    caplog.clear()
    refuse_old_schema(durable.runtime)
    assert caplog.text == ""
    durable.db.dispose()


@pytest.mark.parametrize("behind", [None, "0001"], ids=["never_migrated", "behind"])
def test_the_python_api_on_an_unmigrated_database_says_so_in_one_line(empty_url, behind):
    """A start, a read and a key listing on a database without the schema (or with an older
    one) raise SchemaOutdated with the fix, not the driver's error and its SQL."""
    from alembic import command

    from durable_celery.errors import SchemaOutdated
    from durable_celery.store.migrate import alembic_config

    durable = Durable(Celery("unmigrated", broker="memory://"), empty_url, upkeep=False)
    if behind:
        command.upgrade(alembic_config(durable.db), behind)
    wf = durable.workflow("job")

    @wf.step
    def only(n=0):
        return n

    calls = [
        lambda: durable.start(wf, {"n": 1}),
        lambda: durable.start(wf, {"n": 1}, key="k"),
        lambda: durable.list_runs(),
        lambda: durable.list_keys(),
    ]
    refusals = []
    for call in calls:
        try:
            call()
        except SchemaOutdated as refused:  # any other error fails the test
            refusals.append(str(refused))
    # Never migrated: every call; behind: those that reach a table or column it lacks.
    assert len(refusals) == len(calls) if behind is None else len(refusals) >= 2
    for message in refusals:
        assert "\n" not in message and "SELECT" not in message and "INSERT" not in message
        assert "has no durable schema, or one older than this code" in message
        assert "durable migrate" in message and durable.db.masked_url in message
    durable.migrate()
    assert durable.list_runs() == []
    durable.db.dispose()


@pytest.mark.parametrize("empty_url", ["postgres"], indirect=True)  # an invalid index is PostgreSQL's
def test_a_flow_control_migration_cut_off_part_way_can_be_run_again(empty_url):
    """0006 commits its columns, then builds its indexes CONCURRENTLY outside a transaction: a
    build cut off (lock_timeout, docs/production.md) leaves the columns and an invalid index
    behind, and the database at 0005. Migrating again finishes the job."""
    from alembic import command
    from sqlalchemy import text

    from durable_celery.store.migrate import alembic_config, pending_revisions

    durable = Durable(Celery("cut", broker="memory://"), empty_url, upkeep=False)
    command.upgrade(alembic_config(durable.db), "0005")
    with durable.db.begin() as conn:  # what the failed try left: its columns, one invalid index
        for name in ("slot_key", "throttle_key", "rate_key"):
            conn.execute(text(f"ALTER TABLE durable_runs ADD COLUMN {name} varchar(255)"))
        conn.execute(text("ALTER TABLE durable_runs ADD COLUMN flow_wait varchar(16)"))
        conn.execute(text("CREATE INDEX ix_durable_runs_rate ON durable_runs (workflow, rate_key)"))
        conn.execute(
            text("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'ix_durable_runs_rate'::regclass")
        )
    assert pending_revisions(durable.db)[0] == "0006"
    durable.migrate()
    assert pending_revisions(durable.db) == []
    with durable.db.engine.connect() as conn:
        valid, where = conn.execute(
            text(
                "SELECT i.indisvalid, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i "
                "JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'ix_durable_runs_rate'"
            )
        ).one()
    assert valid and "rate_key IS NOT NULL" in where  # built anew, as the revision writes it
    durable.db.dispose()
