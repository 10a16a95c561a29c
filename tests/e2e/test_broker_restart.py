"""Redis, the broker, killed under load and started again on the same port: two real `celery
worker` processes (a threads pool and a prefork pool) stay up, reconnect, and every run completes.

The messages Redis held are lost with it (no persistence, as after a crash of a cache-only
Redis); the relay inside the workers sends again every run left unclaimed for ``relay_after``
seconds. With Celery 5.7.0's own consumer this test fails every time: a worker that holds
unacknowledged messages when the connection is lost closes it again after ``collect()`` and
exits with ``AttributeError("'NoneType' object has no attribute 'hostname'")`` (see
durable_celery/broker_reconnect.py). PostgreSQL and a private ``redis-server`` on a free port;
fails (never skips) without them.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from durable_celery import Durable

ROOT = Path(__file__).resolve().parents[2]
RUNS = 80
POOLS = ("threads", "prefork")

APP = textwrap.dedent(
    """
    import os, time
    from celery import Celery
    from durable_celery import Durable

    app = Celery("restartapp", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    # Room for every message of the batch: a worker keeps reading the queue (a BRPOP in flight)
    # while it holds unacknowledged messages, which is when a lost connection is hardest on it.
    app.conf.worker_prefetch_multiplier = 32
    durable = Durable(app, os.environ["DB"], poll_interval=0.2, relay_after=3, sweep_interval=1)

    chain = durable.workflow("chain")

    @chain.step
    def fetch(n):
        time.sleep(0.03)

    @chain.step
    def transform(n):
        time.sleep(0.03)

    @chain.step
    def store(n):
        time.sleep(0.03)
        return n
    """
)


def _until(check: Callable[[], object], seconds: float, what: Callable[[], str] | str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(what() if callable(what) else what)
        time.sleep(0.05)


def _free_port() -> int:
    """A port in 20000-29999 (below the ephemeral range, so no client socket takes it while
    the server is down) that nothing listens on right now."""
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


class RedisServer:
    """A private ``redis-server`` without persistence: ``start()``, ``kill()``, ``url``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server on its port and wait until it answers PING."""
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.folder)]
        with open(self.folder / "redis.log", "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _until(self._answers, 15, lambda: f"redis-server on {self.port} did not answer: {self._log()}")

    def kill(self) -> None:
        """SIGKILL the server: every connection breaks and every message it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"redis-server on {self.port} exited {self.proc.returncode}: {self._log()}")
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False
        finally:
            client.close()

    def _log(self) -> str:
        return (self.folder / "redis.log").read_text(errors="replace")[-1000:]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(folder)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def restart_env(pg_url: str, broker: RedisServer, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "restartapp.py").write_text(APP)
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {
        **env,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": broker.url,
        "QUEUE": f"q-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
    }


@pytest.fixture
def fleet(restart_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, subprocess.Popen]]:
    """A threads worker and a prefork worker (``-c 2`` each) on the private broker."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        for pool in POOLS:
            with open(tmp_path / f"{pool}.log", "w") as log:
                cmd = [sys.executable, "-m", "celery", "-A", "restartapp", "worker", "-P", pool, "-c", "2"]
                cmd += ["-n", f"{pool}@%h", "-Q", restart_env["QUEUE"], "--loglevel", "INFO"]
                cmd += ["--without-mingle"]
                procs[pool] = subprocess.Popen(cmd, cwd=tmp_path, env=restart_env, stdout=log, stderr=log)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in procs.values():
            proc.wait(10)


@pytest.fixture
def client(restart_env: dict[str, str]) -> Iterator[Durable]:
    """A producer-side Durable on the same database, broker and queue (no worker of its own)."""
    app = Celery("restartapp", broker=restart_env["BROKER"])
    app.conf.task_default_queue = restart_env["QUEUE"]
    durable = Durable(app, restart_env["DB"], upkeep=False)
    chain = durable.workflow("chain")
    for name in ("fetch", "transform", "store"):
        chain.step(lambda n: None, name=name)
    yield durable
    durable.db.dispose()


def _completed(client: Durable, run_ids: list[str]) -> int:
    done = {run.id for run in client.list_runs(workflow="chain", status="completed", limit=2 * RUNS)}
    return len(done.intersection(run_ids))


def _answering(client: Durable) -> set[str]:
    """The pools of the workers that answer a ping through the broker."""
    try:
        replies = client.app.control.ping(timeout=0.5)
    except (OSError, redis.RedisError):
        return set()
    return {name.split("@", 1)[0] for reply in replies for name in reply}


def _report(fleet: dict[str, subprocess.Popen], tmp_path: Path) -> str:
    lines = []
    for pool, proc in fleet.items():
        log = (tmp_path / f"{pool}.log").read_text(errors="replace")
        fatal = [line for line in log.splitlines() if "Unrecoverable error" in line]
        lines.append(f"{pool}: exit code {proc.poll()}; {fatal[-1] if fatal else 'no unrecoverable error'}")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_survive_a_redis_restart_under_load_and_every_run_completes(
    broker: RedisServer, fleet: dict[str, subprocess.Popen], client: Durable, tmp_path: Path
) -> None:
    def status(what: str) -> Callable[[], str]:
        return lambda: f"{what}\n{_report(fleet, tmp_path)}"

    def noticed_the_loss() -> bool:
        logs = [(tmp_path / f"{pool}.log").read_text(errors="replace") for pool in POOLS]
        return all("Connection to broker lost" in log for log in logs)

    _until(lambda: _answering(client) == set(POOLS), 45, status("the workers did not start"))
    run_ids = [client.start("chain", {"n": n}) for n in range(RUNS)]
    _until(lambda: _completed(client, run_ids) >= 5, 30, status("no run completed"))

    broker.kill()
    assert _completed(client, run_ids) < RUNS, "every run completed before Redis was killed: no load"
    _until(noticed_the_loss, 20, status("a worker did not notice that the broker was lost"))
    time.sleep(2)  # the outage itself: the workers retry against a closed port meanwhile
    restarted_at = time.monotonic()
    broker.start()

    def finished() -> bool:
        return _completed(client, run_ids) == RUNS or all(p.poll() is not None for p in fleet.values())

    _until(
        finished,
        60,
        lambda: f"{_completed(client, run_ids)}/{RUNS} runs completed\n{_report(fleet, tmp_path)}",
    )
    assert all(proc.poll() is None for proc in fleet.values()), _report(fleet, tmp_path)
    assert _completed(client, run_ids) == RUNS
    assert time.monotonic() - restarted_at < 30
    _until(lambda: _answering(client) == set(POOLS), 20, status("not both workers answer a ping"))
    assert [client.get_run(run_id).output for run_id in run_ids] == list(range(RUNS))
