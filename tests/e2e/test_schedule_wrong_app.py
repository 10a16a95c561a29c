"""A schedule fire taken by the wrong app: two Celery apps share one Redis db and the default
queue, each with its own database. App A's beat fires a schedule of A's workflow; app B's real
prefork worker takes the fire. B does not define the workflow and no node of B's database has
it, so the fire is refused like Celery's unregistered task (an error naming the workflow and the
app, the task failed) and nothing is written in B's database. A's own worker, once up in B's
stead, runs the fires as before.

PostgreSQL and the suite's private Redis; fails (never skips) without them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from durable_celery import Durable
from tests.conftest import PG_HOST, REDIS_URL
from tests.e2e.support import until

ROOT = Path(__file__).resolve().parents[2]

APP_A = textwrap.dedent(
    """
    import os
    from celery import Celery
    from durable_celery import Durable

    app = Celery("app_a", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.beat_max_loop_interval = 0.5
    durable = Durable(app, os.environ["DB_A"], poll_interval=0.2)

    nightly = durable.workflow("nightly_report")
    nightly.step(lambda n=0: n, name="build")
    app.conf.beat_schedule = {"nightly": durable.beat_entry("nightly_report", 1, key="r")}
    """
)

APP_B = textwrap.dedent(
    """
    import os
    from celery import Celery
    from durable_celery import Durable

    app = Celery("app_b", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    durable = Durable(app, os.environ["DB_B"], poll_interval=0.2)

    invoice = durable.workflow("invoice")
    invoice.step(lambda: "sent", name="send")
    """
)


@pytest.fixture
def db_b(pg_template: str) -> Iterator[str]:
    """A second database of this test's (app B's), dropped at the end."""
    name = f"durable_b_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield f"{PG_HOST}/{name}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def rows_in(url: str) -> dict[str, int]:
    """How many rows each durable table of a database holds."""
    tables = ("durable_runs", "durable_schedules", "durable_activity", "durable_keys", "durable_steps")
    with psycopg.connect(url) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}  # type: ignore[index]


@pytest.mark.timeout(180)
def test_a_fire_taken_by_a_worker_of_another_app_is_refused_and_writes_nothing(
    pg_url: str, db_b: str, tmp_path: Path, redis_client: Any
) -> None:
    (tmp_path / "app_a.py").write_text(APP_A)
    (tmp_path / "app_b.py").write_text(APP_B)
    queue = f"shared-{uuid.uuid4().hex[:8]}"
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    env = {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": queue,
        "DB_A": pg_url,
        "DB_B": db_b,
    }
    procs: list[subprocess.Popen[Any]] = []

    def start(name: str, app: str, *args: str) -> None:
        command = [sys.executable, "-m", "celery", "-A", app, *args, "-l", "info"]
        with (tmp_path / f"{name}.log").open("w") as log:
            procs.append(
                subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            )

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    logs = lambda: "\n".join(f"--- {n}\n{log(n)[-3000:]}" for n in ("beat", "worker_b"))  # noqa: E731
    before = rows_in(db_b)
    app_a = Celery("app_a", broker=REDIS_URL)
    app_a.conf.task_default_queue = queue
    durable_a = Durable(app_a, pg_url, upkeep=False)
    durable_a.workflow("nightly_report").step(lambda n=0: n, name="build")
    try:
        start("worker_b", "app_b", "worker", "-P", "prefork", "-c", "2", "-n", f"b-{queue}@%h")
        start("beat", "app_a", "beat", "-s", str(tmp_path / "beat-schedule"))

        def fires_handled() -> int:
            ended = ("] succeeded in", "] raised unexpected")
            lines = log("worker_b").splitlines()
            return sum("durable.fire_schedule[" in line and any(e in line for e in ended) for line in lines)

        until(lambda: fires_handled() >= 2, 60, "worker B handling two fires", logs)
        assert rows_in(db_b) == before  # nothing written in B's database, not even the schedule
        text = log("worker_b")
        assert "refused a fire of schedule 'nightly_report:r'" in text
        assert "workflow 'nightly_report' is not defined in app 'app_b'" in text
        assert "raised unexpected: UnknownWorkflow" in text  # the fire task failed, as Celery says
        assert durable_a.list_runs(workflow="nightly_report") == []  # B never wrote to A's either

        # B stopped (its worker would also drop A's step messages, as unregistered tasks), A's
        # own worker runs A's fires.
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(30) == 0
        start("worker_a", "app_a", "worker", "-P", "threads", "-c", "2", "-n", f"a-{queue}@%h")
        until(
            lambda: durable_a.list_runs(workflow="nightly_report", status="completed"),
            60,
            "a fire run by app A's worker",
            lambda: logs() + log("worker_a")[-3000:],
        )
        assert durable_a.get_schedule("nightly_report:r").failures == 0
        assert rows_in(db_b) == before
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        durable_a.db.dispose()
