"""A schedule created while a real `celery beat -S redbeat.RedBeatScheduler` idles fires within
seconds: ``Durable`` fills in ``beat_max_loop_interval`` (RedBeat's own default sleeps up to 300 s
when nothing is due). The app here sets no loop interval, unlike tests/e2e/beat_app.py.

The processes run this module as their app (``celery -A tests.e2e.test_beat_idle``): with
IDLE_APP_BROKER set it defines ``app`` from the environment and nothing else.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.store.db import utcnow
from tests.conftest import PG_HOST, REDIS_URL
from tests.e2e.support import until
from tests.e2e.test_beat_flower import ROOT, Processes, env_for


def define(durable: Durable) -> None:
    wf = durable.workflow("idle_job")

    @wf.step
    def work(n: int = 0) -> int:
        return n


if os.environ.get("IDLE_APP_BROKER"):  # in `celery beat` and `celery worker` started below
    app = Celery("idle_app", broker=os.environ["IDLE_APP_BROKER"])
    app.conf.task_default_queue = os.environ["IDLE_APP_QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.redbeat_redis_url = os.environ["IDLE_APP_BROKER"]
    app.conf.redbeat_key_prefix = os.environ["IDLE_APP_PREFIX"]
    durable = Durable(app, poll_interval=0.2, heartbeat_interval=0.5)
    define(durable)


class IdleProcesses(Processes):
    """Processes of this module's app."""

    def start(self, name: str, *args: str) -> Any:
        with (self.logs / f"{name}.log").open("w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.e2e.test_beat_idle", *args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.started.append(process)
        return process


@pytest.fixture
def idle_stack(pg_template: str, redis_client: Any, tmp_path: Any) -> Iterator[tuple[Durable, IdleProcesses]]:
    database = f"durable_idle_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database} TEMPLATE {pg_template}")
    url, prefix, queue = (
        f"{PG_HOST}/{database}",
        f"idle-{uuid.uuid4().hex[:8]}:",
        f"idle-{uuid.uuid4().hex[:8]}",
    )
    env = env_for(
        DURABLE_DATABASE_URL=url, IDLE_APP_BROKER=REDIS_URL, IDLE_APP_PREFIX=prefix, IDLE_APP_QUEUE=queue
    )
    processes = IdleProcesses(env, tmp_path)
    app = Celery("idle_app", broker=REDIS_URL)
    app.conf.update(task_default_queue=queue, redbeat_redis_url=REDIS_URL, redbeat_key_prefix=prefix)
    durable = Durable(app, url, upkeep=False)
    define(durable)
    try:
        yield durable, processes
    finally:
        processes.stop()
        durable.db.dispose()
        with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


@pytest.mark.timeout(90)
def test_a_schedule_made_while_beat_idles_fires_within_seconds(idle_stack: Any) -> None:
    durable, processes = idle_stack
    logs = lambda: "\n".join(f"--- {n}\n{processes.log(n)[-3000:]}" for n in ("beat", "worker"))  # noqa: E731
    processes.start("worker", "worker", "-P", "threads", "-c", "2", "-l", "info")
    processes.start("beat", "beat", "-S", "redbeat.RedBeatScheduler", "-l", "debug")

    def idling() -> list[float]:  # beat found nothing due and went to sleep: for how long
        found = re.findall(r"beat: Waking up in ([\d.]+) (second|minute)", processes.log("beat"))
        return [float(n) * (60 if unit == "minute" else 1) for n, unit in found]

    sleeps = until(idling, 30, "beat to idle", logs)
    assert max(sleeps) <= 5.0  # Durable's default, not RedBeat's 300 s
    made_at = utcnow()
    durable.schedule("idle_job", 2, key="k", input={"n": 7}, name="every-2s")

    def started() -> Any:
        return [r for r in durable.list_runs(workflow="idle_job") if r.started_at is not None]

    (run, *_) = until(started, 20, "a run of the new schedule", logs)
    assert run.key == "k"
    assert (run.created_at - made_at).total_seconds() < 15
