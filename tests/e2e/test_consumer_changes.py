"""An operator's consumer changes on a real prefork worker: `celery control cancel_consumer` and
`add_consumer` show in the node's queues (`durable nodes`, what `doctor` reads) within a relay
pass, and `doctor` reports `no_consumer`, with its fix, for ready runs on a queue nobody
consumes any more. Durable's own pause and resume still work on an operator-added queue.

PostgreSQL and the suite's private Redis; a `celery worker` subprocess with the default
settings (poll_interval 1 s, heartbeat_interval 10 s); fails (never skips) without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from durable_celery import Durable
from durable_celery.testing import wait_for
from tests.conftest import REDIS_URL
from tests.e2e.support import until

ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    import os
    from celery import Celery
    from durable_celery import Durable

    app = Celery("consumerapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    durable = Durable(app, os.environ["DB"])  # the default poll and heartbeat intervals

    report = durable.workflow("report")
    report.step(lambda: "built", name="build", queue=os.environ["SLOW"])
    ping = durable.workflow("ping")
    ping.step(lambda: "pong", name="pong", queue=os.environ["FAST"])
    """
)


@pytest.fixture
def env(pg_url: str, tmp_path: Path, redis_client: Any) -> dict[str, str]:
    (tmp_path / "consumerapp.py").write_text(APP)
    tag = uuid.uuid4().hex[:8]
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": REDIS_URL,
        "QUEUE": f"default-{tag}",
        "SLOW": f"slow-{tag}",
        "FAST": f"fast-{tag}",
        "DB": pg_url,
    }


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    """A producer-side Durable on the same database and queues (no worker of its own)."""
    app = Celery("consumerapp", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    durable = Durable(app, env["DB"], upkeep=False)
    durable.workflow("report").step(lambda: None, name="build", queue=env["SLOW"])
    durable.workflow("ping").step(lambda: None, name="pong", queue=env["FAST"])
    yield durable
    durable.db.dispose()


def celery(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "celery", "-A", "consumerapp", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def node_queues(durable: Durable, name: str) -> list[str] | None:
    found = [n for n in durable.list_nodes() if n["name"] == name]
    return sorted(found[0]["queues"]) if found else None


def no_consumer(durable: Durable, queue: str) -> list[Any]:
    return [f for f in durable.doctor() if f.kind == "no_consumer" and f.details["queue"] == queue]


@pytest.mark.timeout(180)
def test_cancel_and_add_consumer_show_in_the_node_and_in_doctor(
    env: dict[str, str], client: Durable, tmp_path: Path
) -> None:
    default, slow, fast = env["QUEUE"], env["SLOW"], env["FAST"]
    name = f"ops-{default}@test"
    log_path = tmp_path / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "consumerapp", "worker", "-P", "prefork", "-c", "2"]
    command += ["-n", name, "-Q", f"{default},{slow}", "--loglevel", "INFO", "--without-mingle"]
    with log_path.open("w") as log:
        worker = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    logs = lambda: log_path.read_text()[-4000:]  # noqa: E731
    try:
        until(lambda: node_queues(client, name) == sorted([default, slow]), 60, "the node row", logs)

        # The operator stops the only consumer of the slow queue, with Celery's own command.
        cancelled_at = time.monotonic()
        done = celery(env, tmp_path, "control", "cancel_consumer", slow, "-d", name)
        assert done.returncode == 0 and "no longer consuming" in done.stdout, done.stdout + done.stderr
        until(lambda: node_queues(client, name) == [default], 30, "the node dropping the queue", logs)
        node_seconds = time.monotonic() - cancelled_at
        run_id = client.start("report")
        (finding,) = until(lambda: no_consumer(client, slow), 30, "a no_consumer finding", logs)
        shown_seconds = time.monotonic() - cancelled_at
        assert finding.details["ready"] == 1
        assert f"start a worker with -Q {slow}" in finding.message
        nodes = celery(env, tmp_path, "durable", "nodes", "--json")
        (row,) = [json.loads(line) for line in nodes.stdout.splitlines() if name in line]
        assert row["queues"] == [default]
        report = celery(env, tmp_path, "durable", "doctor")
        assert report.returncode == 1 and f"start a worker with -Q {slow}" in report.stdout
        status = celery(env, tmp_path, "durable", "status")
        assert f"no consumer: queue {slow} has 1 ready run(s)" in status.stdout
        assert client.get_run(run_id).status == "pending"

        # add_consumer of a queue the worker did not start with: the node announces it.
        added_at = time.monotonic()
        client.app.control.add_consumer(fast, destination=[name], reply=True, timeout=10)
        until(lambda: node_queues(client, name) == sorted([default, fast]), 30, "the added queue", logs)
        added_seconds = time.monotonic() - added_at
        assert wait_for(client, client.start("ping"), timeout=30).output == "pong"

        # Durable's pause stops the operator-added queue's consumer; its resume brings it back.
        client.pause_queue(fast)
        until(lambda: node_queues(client, name) == [default], 30, "the paused queue dropped", logs)
        client.resume_queue(fast)
        until(lambda: node_queues(client, name) == sorted([default, fast]), 30, "the queue resumed", logs)
        # Pausing and resuming the queue the operator cancelled does not consume it again.
        client.pause_queue(slow)
        client.resume_queue(slow)
        time.sleep(3)  # three relay passes: a wrongly re-added consumer would claim the run
        assert node_queues(client, name) == sorted([default, fast])
        assert client.get_run(run_id).status == "pending"

        # The operator gives the slow queue its consumer back: the run completes, no finding.
        client.app.control.add_consumer(slow, destination=[name], reply=True, timeout=10)
        assert wait_for(client, run_id, timeout=30).output == "built"
        assert no_consumer(client, slow) == []
        print(
            f"\nnode row without the cancelled queue after {node_seconds:.1f}s, no_consumer shown "
            f"{shown_seconds:.1f}s after cancel_consumer; added queue listed after {added_seconds:.1f}s"
        )
        assert node_seconds < 5 and added_seconds < 5  # a relay pass (1 s), not a heartbeat (10 s)
    finally:
        if worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
