"""A database outage longer than ``stale_lock_timeout`` under real workers: no healthy step is
handed back or run twice, whether it finishes after the outage or during it. A private
PostgreSQL server (tests/pgserver.py) is stopped and started; Redis is the broker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.testing import wait_for
from tests.conftest import REDIS_URL
from tests.pgserver import pg_server  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
STALE = 4.0

APP = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from celery import Celery
    from durable_celery import Durable, current_run

    app = Celery("outageapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(
        app,
        os.environ["DB"],
        poll_interval=0.2,
        heartbeat_interval=0.5,
        stale_lock_timeout=float(os.environ["STALE"]),
        sweep_interval=0.5,
        relay_after=2.0,
    )
    marks = Path(os.environ["MARKS"])

    job = durable.workflow("long")

    @job.step
    def work(tag, until):
        with open(marks / tag, "a") as f:  # one line per time this step runs
            f.write(f"{os.getpid()}\\n")
        while not (marks / until).exists():
            time.sleep(0.05)
        return tag
    """
)


@pytest.fixture
def outage_env(pg_server, tmp_path: Path, redis_client) -> dict[str, str]:  # noqa: F811
    url = pg_server.create_database("outage")
    migrator = Durable(Celery("migrate", broker="memory://"), url, upkeep=False)
    migrator.migrate()
    migrator.db.dispose()
    (tmp_path / "outageapp.py").write_text(APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **env,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": f"q-{uuid.uuid4().hex[:8]}",
        "DB": url,
        "MARKS": str(marks),
        "STALE": str(STALE),
    }


@pytest.fixture
def workers(outage_env: dict[str, str], tmp_path: Path) -> Iterator[list[subprocess.Popen]]:
    started = []
    for name in ("a", "b"):
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celery", "-A", "outageapp", "worker", "-P", "threads", "-c", "3"]
        cmd += ["-n", f"{name}@%h", "-Q", outage_env["QUEUE"], "--loglevel", "INFO", "--without-mingle"]
        started.append(subprocess.Popen(cmd, cwd=tmp_path, env=outage_env, stdout=log, stderr=log))
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _until(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_database_outage_longer_than_the_stale_timeout_hands_back_no_healthy_step(
    pg_server,  # noqa: F811
    outage_env,
    workers,
):
    marks = Path(outage_env["MARKS"])
    app = Celery("outageapp", broker=REDIS_URL)
    app.conf.task_default_queue = outage_env["QUEUE"]
    client = Durable(app, outage_env["DB"], upkeep=False)
    client.workflow("long").step(lambda tag, until: None, name="work")
    # Two steps finish after the outage, two during it (their outcome waits for the database).
    runs = {
        f"{when}-{n}": client.start("long", {"tag": f"{when}-{n}", "until": f"go-{when}"})
        for when in ("after", "during")
        for n in range(2)
    }
    _until(lambda: all((marks / tag).exists() for tag in runs), 60, "not every step started")

    pg_server.stop(mode="immediate")
    (marks / "go-during").touch()
    time.sleep(2.5 * STALE)  # the outage: longer than stale_lock_timeout, on purpose
    pg_server.start()
    # Give every sweeper time to judge the locks: its own window after the outage, and more.
    time.sleep(STALE + 3)
    (marks / "go-after").touch()

    for tag, run_id in runs.items():
        run = wait_for(client, run_id, timeout=60)
        assert run.status == "completed" and run.output == tag
        assert [(s.attempt, s.status) for s in client.list_steps(run_id)] == [(1, "completed")]
        assert len((marks / tag).read_text().splitlines()) == 1, f"{tag} ran more than once"
    with client.db.engine.connect() as conn:
        from sqlalchemy import select

        from durable_celery.store.schema import runs as table

        assert set(conn.execute(select(table.c.losses)).scalars()) == {0}  # none was handed back
    assert all(proc.poll() is None for proc in workers)  # both workers lived through it
    client.db.dispose()
