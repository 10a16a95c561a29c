"""A read replica (issue 42): ``read_database_url`` serves what operators read (the dashboard, the
admin, reports, metrics); starts, claims, ``result`` and anything followed by a write use the
primary. A real streaming replica: a private PostgreSQL server and its standby made with
``pg_basebackup -R``, both this module's own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.errors import InvalidDefinition
from durable_celery.testing import worker
from tests.conftest import REDIS_URL
from tests.pgserver import PgServer

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def servers() -> Iterator[tuple[PgServer, PgServer]]:
    """A primary and its streaming standby, running."""
    primary = PgServer()
    standby: PgServer | None = None
    try:
        primary.start()
        standby = primary.standby()
        standby.start()
        yield primary, standby
    finally:
        if standby is not None:
            standby.close()
        primary.close()


@pytest.fixture
def durable(servers: tuple[PgServer, PgServer], redis_client: Any) -> Iterator[Durable]:
    """A Durable on a database of the primary, reading the standby's copy of it."""
    primary, standby = servers
    name = f"replica_{uuid.uuid4().hex[:8]}"
    url = primary.create_database(name)
    app = Celery("replica", broker=REDIS_URL, set_as_current=False)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    made = Durable(app, url, read_database_url=standby.url_of(name), poll_interval=0.1, upkeep=False)
    made.migrate()
    try:
        yield made
    finally:
        made.db.dispose()
        made.reads.dispose()
        redis_client.delete(app.conf.task_default_queue)


def _replayed(durable: Durable, run_id: str) -> None:
    """Wait until the standby has the run (replication is asynchronous)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with durable.reads.engine.connect() as conn:
            if conn.exec_driver_sql("SELECT 1 FROM durable_runs WHERE id = %(id)s", {"id": run_id}).first():
                return
        time.sleep(0.05)
    pytest.fail(f"the standby never replayed run {run_id}")


def test_the_replica_is_read_by_operators_and_the_primary_by_starts_and_results(durable: Durable) -> None:
    wf = durable.workflow("replicated")
    wf.step(lambda n: n * 2, name="double")
    with worker(durable):
        run_id = durable.start(wf, {"n": 21})
        assert durable.result(run_id, timeout=30) == 42  # read on the primary: no lag to wait out
    _replayed(durable, run_id)
    lag = durable.replication_lag()
    assert lag is not None and 0 <= lag < 30
    assert durable.read_runtime.db is durable.reads and durable.runtime.db is durable.db
    plain_url = durable.reads.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with (
        psycopg.connect(plain_url, autocommit=True) as standby,
        pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
    ):
        standby.execute("DELETE FROM durable_runs")  # a standby: writes can only go to the primary


def test_with_the_primary_down_the_dashboard_reports_and_metrics_still_read_the_replica(
    durable: Durable, servers: tuple[PgServer, PgServer], tmp_path: Any
) -> None:
    """The operators' reads go to the replica: with the primary stopped, the dashboard's pages
    and JSON API, the CLI's reports and the metrics' gauges still answer; the API's reads, for
    callers whose next step may be a write, need the primary."""
    from prometheus_client import generate_latest
    from starlette.testclient import TestClient

    from durable_celery.errors import DatabaseUnavailable
    from durable_celery.web import create_app

    wf = durable.workflow("replicated")
    wf.step(lambda n: n * 2, name="double")
    with worker(durable):
        run_id = durable.start(wf, {"n": 1})
        assert durable.result(run_id, timeout=30) == 2
    _replayed(durable, run_id)
    waiting = durable.start(wf, {"n": 2})  # pending, never run
    _replayed(durable, waiting)
    (tmp_path / "replicaapp.py").write_text(
        "from celery import Celery\n"
        "from durable_celery import Durable\n"
        f"app = Celery('replicaapp', broker={REDIS_URL!r})\n"
        f"durable = Durable(app, {durable.db.url!r}, read_database_url={durable.reads.url!r}, upkeep=False)\n"
    )
    servers[0].stop("fast")
    client = TestClient(create_app(durable))
    page = client.get("/")
    assert page.status_code == 200 and "pages read the replica" in page.text, page.text
    assert run_id in client.get("/runs").text
    found = client.get("/api/runs").json()
    assert {run_id, waiting} <= {r["id"] for r in found["runs"]}, found
    assert client.get(f"/api/runs/{run_id}").json()["run"]["output"] == 2
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "replicaapp", "durable", "runs"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        timeout=60,
    )
    assert done.returncode == 0 and run_id in done.stdout and waiting in done.stdout, done.stderr
    scraped = generate_latest(durable.metrics.registry).decode()
    assert "durable_database_up 1.0" in scraped, scraped
    assert 'durable_runs{status="pending",workflow="replicated"} 1.0' in scraped, scraped
    with pytest.raises(DatabaseUnavailable):
        durable.get_run(run_id)  # the API reads the primary


def test_a_durable_without_a_replica_reads_its_database(make_durable: Any) -> None:
    made = make_durable()
    assert made.reads is made.db and made.read_runtime is made.runtime
    assert made.replication_lag() is None


@pytest.mark.parametrize(
    ("url", "read_url", "says"),
    [
        ("sqlite:///x.sqlite3", "postgresql://h/db", "needs a PostgreSQL database_url"),
        ("postgresql://h/db", "sqlite:///y.sqlite3", "must be a PostgreSQL URL"),
        ("postgresql://h/db", "mysql://u:secret@h/db", "must be a PostgreSQL URL"),
    ],
)
def test_a_read_database_url_that_cannot_be_a_replica_is_refused(url: str, read_url: str, says: str) -> None:
    with pytest.raises(InvalidDefinition) as refused:
        Durable(Celery("bad", broker="memory://", set_as_current=False), url, read_database_url=read_url)
    assert says in str(refused.value) and "secret" not in str(refused.value)
