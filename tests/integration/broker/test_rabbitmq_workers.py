"""Real `celery worker` processes (prefork) on RabbitMQ: keys, policies and inline continuation,
the dashboard's queues page, `no_consumer`, pause and resume, a killed pool process
(`WorkerLost`) and a graceful shutdown's hand-back. PostgreSQL and the machine's RabbitMQ, in
the session's vhost; fails (never skips) without them."""

from __future__ import annotations

import os
import signal
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
from durable_celery.web.data import queues_data
from durable_celery.worker.relay import broker_depths
from tests.e2e.support import until

ROOT = Path(__file__).resolve().parents[3]

APP = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from celery import Celery
    from durable_celery import Durable, current_run

    app = Celery("rabbitapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(
        app, os.environ["DB"], poll_interval=0.2, heartbeat_interval=0.4, stale_lock_timeout=300,
        sweep_interval=0.5, shutdown_grace_period=2,
    )
    marks = Path(os.environ["MARKS"])

    chain = durable.workflow("chain")
    chain.step(lambda n: n, name="fetch")
    chain.step(lambda n: n, name="transform")
    chain.step(lambda n: n * 10, name="store")

    durable.workflow("report").step(lambda: "built", name="build", queue=os.environ["SLOW"])

    @durable.workflow("crash").step(retry=2)
    def die_here(tag):
        (marks / f"pid-{current_run().attempt}").write_text(str(os.getpid()))
        while not (marks / "go").exists():
            time.sleep(0.05)
        return current_run().attempt

    @durable.workflow("job").step
    def work(mode):
        first = not (marks / "started").exists()
        (marks / "started").touch()
        while first:  # the first worker to run it loops until it is stopped
            time.sleep(0.05)
        return os.getpid()
    """
)


@pytest.fixture
def env(pg_url: str, rabbitmq: str, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "rabbitapp.py").write_text(APP)
    (tmp_path / "marks").mkdir()
    tag = uuid.uuid4().hex[:8]
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": rabbitmq,
        "QUEUE": f"q-{tag}",
        "SLOW": f"slow-{tag}",
        "DB": pg_url,
        "MARKS": str(tmp_path / "marks"),
    }


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    """A producer-side Durable on the same database, vhost and queues (no worker of its own)."""
    app = Celery("rabbitapp", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    durable = Durable(app, env["DB"], upkeep=False)
    chain = durable.workflow("chain")
    for name in ("fetch", "transform", "store"):
        chain.step(lambda n: None, name=name)
    durable.workflow("report").step(lambda: None, name="build", queue=env["SLOW"])
    durable.workflow("crash").step(lambda tag: None, name="die_here")
    durable.workflow("job").step(lambda mode: None, name="work")
    yield durable
    with app.connection_for_write() as conn, conn.channel() as channel:
        for queue in (env["QUEUE"], env["SLOW"]):
            channel.queue_delete(queue)
    durable.db.dispose()


@pytest.fixture
def start_worker(env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "celery", "-A", "rabbitapp", "worker", "-P", "prefork", "-c", "2"]
        cmd += ["-n", f"{name}-{env['QUEUE']}@test", "-Q", env["QUEUE"], "--loglevel", "INFO"]
        cmd += ["--without-mingle"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=log)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def node_queues(durable: Durable, name: str) -> list[str] | None:
    found = [n for n in durable.list_nodes() if n["name"].startswith(f"{name}-")]
    return sorted(found[0]["queues"]) if found else None


def depth(durable: Durable, queue: str) -> int | None:
    return (broker_depths(durable.app, [queue]) or {}).get(queue)


def wait_file(path: Path, seconds: float) -> str:
    return str(until(lambda: path.exists() and path.read_text(), seconds, f"{path.name} to appear"))


@pytest.mark.timeout(120)
def test_keys_policies_inline_steps_queues_and_pause_on_a_prefork_worker(env, client, start_worker, tmp_path):
    queue, slow = env["QUEUE"], env["SLOW"]
    start_worker("main")
    logs = lambda: (tmp_path / "main.log").read_text()[-3000:]  # noqa: E731
    until(lambda: node_queues(client, "main") == [queue], 60, "the worker's node row", logs)

    held = client.start("chain", {"n": 1}, key="order-1")
    assert client.start("chain", {"n": 1}, key="order-1") == held  # use_existing: the holder answers
    assert wait_for(client, held, timeout=30).output == 10
    again = client.start("chain", {"n": 2}, key="order-1", on_duplicate="run_again")
    assert again != held
    plain = [client.start("chain", {"n": n}) for n in range(3, 13)]
    for run_id, n in [(held, 1), (again, 2), *zip(plain, range(3, 13), strict=True)]:
        run = wait_for(client, run_id, timeout=30)
        assert (run.status, run.output) == ("completed", n * 10), logs()
        steps = client.list_steps(run_id)
        assert [s.name for s in steps] == ["fetch", "transform", "store"]
        assert len({s.worker for s in steps}) == 1  # one message, the next steps run inline
    assert client.doctor() == []
    (shown,) = [q for q in queues_data(client)["queues"] if q["name"] == queue]
    assert shown["consumers"] and not shown["no_consumer"]

    # A queue no worker consumes: doctor says so, and the dashboard flags it.
    waiting = client.start("report")
    (finding,) = until(lambda: [f for f in client.doctor() if f.kind == "no_consumer"], 30, "no_consumer")
    assert finding.details["queue"] == slow and f"start a worker with -Q {slow}" in finding.message
    assert [q["no_consumer"] for q in queues_data(client)["queues"] if q["name"] == slow] == [True]
    assert client.get_run(waiting).status == "pending" and depth(client, slow) == 1

    # Paused: the worker stops consuming, the message waits in RabbitMQ; resumed, the run completes.
    client.pause_queue(queue)
    until(lambda: node_queues(client, "main") == [], 30, "the paused queue dropped", logs)
    paused = client.start("chain", {"n": 99})
    assert client.flush(timeout=30)
    until(lambda: depth(client, queue) == 1, 30, "the message queued in RabbitMQ", logs)
    assert client.get_run(paused).status == "pending"
    client.resume_queue(queue)
    assert wait_for(client, paused, timeout=30).output == 990


@pytest.mark.timeout(150)
def test_a_killed_pool_process_and_a_graceful_shutdown_hand_back_on_rabbitmq(
    env, client, start_worker, tmp_path
):
    marks = Path(env["MARKS"])
    first = start_worker("first")
    crashed = client.start("crash", {"tag": "oom"})
    pid = int(wait_file(marks / "pid-1", 60))
    os.kill(pid, signal.SIGKILL)  # what the OOM killer does to a pool process
    killed_at = time.monotonic()
    assert int(wait_file(marks / "pid-2", 20)) != pid  # within seconds, not the 300 s stale timeout
    assert time.monotonic() - killed_at < 20
    (marks / "go").touch()
    run = wait_for(client, crashed, timeout=30)
    assert (run.status, run.output) == ("completed", 2)
    steps = client.list_steps(crashed)
    assert [(s.attempt, s.status) for s in steps] == [(1, "failed"), (2, "completed")]
    assert steps[0].error["type"] == "WorkerLost" and "signal 9" in steps[0].error["message"]

    handed = client.start("job", {"mode": "stubborn"})
    until(lambda: (marks / "started").exists(), 30, "the step to start")
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0  # the 2 s grace period, then the step was handed back
    assert len(client.activity(kinds=["handed_back"], run_id=handed)) == 1
    second = start_worker("second")
    run = wait_for(client, handed, timeout=60)
    assert run.status == "completed" and run.output != first.pid
    assert [(s.attempt, s.status) for s in client.list_steps(handed)] == [(1, "completed")]
    assert second.poll() is None
