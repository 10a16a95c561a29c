"""A producer while the broker is down, and the broker back: real producer processes, real
`celery worker` processes, a private ``redis-server`` the tests start and kill, PostgreSQL.

- A short-lived script starts 20 runs with Redis down: each ``start()`` returns in milliseconds,
  the script exits within about a second (its runs flagged for the relay), and once Redis and a
  worker are up every run completes within seconds, with ``relay_after`` left at 120 s.
- A script stopped by SIGTERM while it exits, with a broker that takes connections and never
  answers: no run is left marked sent, so they too complete within seconds.
- Redis killed and restarted under a running worker (it loses every queued message): the
  worker's reconnect has the relay re-send at once what the queue cannot hold, instead of
  after ``relay_after``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from celery import Celery

from durable_celery import Durable
from tests.e2e.test_broker_restart import RedisServer

ROOT = Path(__file__).resolve().parents[2]
RUNS = 20
LOOSE_START = 0.5  # seconds a start may take with the broker down (it takes about a millisecond)
LOOSE_EXIT = 2.0  # seconds from a producer's last line to its exit
SOON = 30.0  # runs complete this soon after the broker is back: far below relay_after (120 s)

APP = textwrap.dedent(
    """
    import os, time
    from celery import Celery
    from durable_celery import Durable

    app = Celery("downapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(app, os.environ["DB"], poll_interval=0.5)  # relay_after: the default, 120 s

    ship = durable.workflow("ship")

    @ship.step
    def pack(order, pause=0.0):
        time.sleep(pause)
        return order
    """
)

PRODUCER = textwrap.dedent(
    """
    import json, sys, time
    from downapp import durable

    took, ids = [], []
    for n in range(int(sys.argv[1])):
        began = time.monotonic()
        ids.append(durable.start("ship", {"order": n}))
        took.append(time.monotonic() - began)
    print(json.dumps({"ids": ids, "took": took}), flush=True)
    print(time.time(), flush=True)  # the last line: the exit comes next
    """
)


def _until(check: Callable[[], object], seconds: float, what: Callable[[], str] | str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(what() if callable(what) else what)
        time.sleep(0.05)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server, not started: its port refuses connections until ``start()``."""
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(folder)
    yield server
    server.kill()


@pytest.fixture
def env(pg_url: str, broker: RedisServer, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "downapp.py").write_text(APP)
    (tmp_path / "producer.py").write_text(PRODUCER)
    keep = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **keep,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": broker.url,
        "QUEUE": f"q-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
    }


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    """A Durable on the same database that only reads (no worker, no upkeep)."""
    durable = Durable(Celery("downapp", broker="memory://"), env["DB"], upkeep=False)
    durable.workflow("ship").step(lambda order, pause=0.0: order, name="pack")
    yield durable
    durable.db.dispose()


@contextmanager
def worker(env: dict[str, str], tmp_path: Path, pool: str) -> Iterator[subprocess.Popen]:
    log_path = tmp_path / f"worker-{pool}.log"
    cmd = [sys.executable, "-m", "celery", "-A", "downapp", "worker", "-P", pool, "-c", "1"]
    cmd += ["-n", f"{pool}-{uuid.uuid4().hex[:6]}@%h", "-Q", env["QUEUE"], "--loglevel", "INFO"]
    cmd += ["--without-mingle", "--without-gossip"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=log_path.parent, env=env, stdout=log, stderr=log)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _completed(client: Durable, run_ids: list[str]) -> int:
    done = {run.id for run in client.list_runs(workflow="ship", status="completed", limit=10 * RUNS)}
    return len(done.intersection(run_ids))


def _log(tmp_path: Path, pool: str) -> str:
    return (tmp_path / f"worker-{pool}.log").read_text(errors="replace")


def _all_complete_soon(client: Durable, run_ids: list[str], tmp_path: Path, pool: str) -> float:
    """Seconds until every run completed (fails after SOON)."""
    began = time.monotonic()
    _until(
        lambda: _completed(client, run_ids) == len(run_ids),
        SOON,
        lambda: (
            f"{_completed(client, run_ids)}/{len(run_ids)} runs completed\n{_log(tmp_path, pool)[-3000:]}"
        ),
    )
    return time.monotonic() - began


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_producer_with_redis_down_starts_and_exits_at_once_and_its_runs_complete_when_it_is_back(
    broker: RedisServer, env: dict[str, str], client: Durable, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "producer.py", str(RUNS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    exited = time.time()
    assert done.returncode == 0, done.stderr
    first, last_line = done.stdout.splitlines()[:2]
    started = json.loads(first)
    took, run_ids = started["took"], started["ids"]
    exit_seconds = exited - float(last_line)
    assert max(took) < LOOSE_START, took
    assert exit_seconds < LOOSE_EXIT, done.stderr

    broker.start()
    with worker(env, tmp_path, "threads"):
        complete = _all_complete_soon(client, run_ids, tmp_path, "threads")
    print(
        f"\nRedis down: start() max {max(took) * 1000:.1f} ms (first {took[0] * 1000:.1f} ms), "
        f"exit {exit_seconds:.2f} s after the last start; all {RUNS} runs completed "
        f"{complete:.1f} s after Redis and a worker were started"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_producer_stopped_while_it_exits_leaves_no_run_marked_sent(
    broker: RedisServer, env: dict[str, str], client: Durable, tmp_path: Path
) -> None:
    # The broker's port takes connections and never answers: the producer cannot send, and
    # learns it only from a timeout that never comes. It is stopped by SIGTERM during its exit.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", broker.port))
        silent.listen(64)
        producer = subprocess.Popen(
            [sys.executable, "producer.py", str(RUNS)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert producer.stdout is not None
            first = producer.stdout.readline()
            last_line = producer.stdout.readline()
            assert last_line, f"the producer ended early: {producer.communicate(timeout=10)}"
            time.sleep(0.3)  # into its exit
            producer.send_signal(signal.SIGTERM)
            stopped_at = time.time()
            producer.wait(10)
        finally:
            if producer.poll() is None:
                producer.kill()
                producer.wait(10)
    started = json.loads(first)
    run_ids = started["ids"]
    assert max(started["took"]) < LOOSE_START, started["took"]
    print(
        f"\nsilent broker: producer stopped {stopped_at - float(last_line):.2f} s after its last line, "
        f"exit code {producer.returncode}"
    )

    broker.start()
    with worker(env, tmp_path, "threads"):
        complete = _all_complete_soon(client, run_ids, tmp_path, "threads")
    print(f"all {RUNS} runs completed {complete:.1f} s after Redis and a worker were started")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_runs_whose_messages_a_restarted_redis_lost_are_sent_again_at_once(
    broker: RedisServer, env: dict[str, str], client: Durable, tmp_path: Path
) -> None:
    broker.start()
    app = Celery("downapp", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    producer = Durable(app, env["DB"], upkeep=False)
    producer.workflow("ship").step(lambda order, pause=0.0: order, name="pack")
    with worker(env, tmp_path, "prefork"):
        run_ids = [producer.start("ship", {"order": n, "pause": 0.3}) for n in range(RUNS)]
        assert producer.flush(timeout=10)
        _until(lambda: _completed(client, run_ids) >= 1, 60, lambda: _log(tmp_path, "prefork")[-3000:])
        broker.kill()  # every message still queued is lost with it
        assert _completed(client, run_ids) < RUNS - 5, "most runs completed before Redis died: no load"
        _until(
            lambda: "Connection to broker lost" in _log(tmp_path, "prefork"), 20, "no lost connection noticed"
        )
        broker.start()
        complete = _all_complete_soon(client, run_ids, tmp_path, "prefork")
        assert "the relay sent" in _log(tmp_path, "prefork")
    print(
        f"\nRedis restarted under a prefork worker: all {RUNS} runs completed {complete:.1f} s "
        "after it was back"
    )
    producer.db.dispose()
