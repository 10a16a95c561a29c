"""RabbitMQ, the broker, killed under load and started again: two real `celery worker`
processes (a threads pool and a prefork pool) stay up, reconnect, and every run completes.

The node is a private one the test starts and kills itself (its own node name, ports and data
folder; the machine's node is never touched). Celery's queues are durable and its messages
persistent, and a message counts as sent only once the broker confirmed it, so the restarted
node still holds every message it took; unacknowledged deliveries go back to their queue, and
what a producer could not get confirmed is flagged for the relay, which sends it once the broker
is back. ``relay_after`` is its default (120 s, longer than the test): a run whose message the
kill still lost (seen now and then for a message published within ~0.1 s of the SIGKILL) is sent
again by the passes a worker makes when it reconnects (at once and 5 s later). After the restart
the prefork worker answers a ping again; the threads worker, though it stays up and goes on
taking messages, at times answers none within 30 s (about one run in three here): a known gap,
in docs/production.md ("Choosing a broker"). PostgreSQL and RabbitMQ's ``rabbitmq-server``;
fails (never skips) without them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import amqp
import pytest
from celery import Celery

from durable_celery import Durable
from tests.e2e.support import free_port, until

ROOT = Path(__file__).resolve().parents[2]
RUNS = 80
POOLS = ("threads", "prefork")
# The server itself: the packaged wrapper switches to the rabbitmq user, whose files the private
# node's data folder is not.
SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"

APP = textwrap.dedent(
    """
    import os, time
    from celery import Celery
    from durable_celery import Durable

    app = Celery("rabbitrestart", broker=os.environ["BROKER"])
    app.conf.task_default_queue = os.environ["QUEUE"]
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 8
    relay_after = float(os.environ.get("RELAY_AFTER", "120"))
    durable = Durable(app, os.environ["DB"], poll_interval=0.2, relay_after=relay_after, sweep_interval=1)

    chain = durable.workflow("chain")
    chain.step(lambda n: time.sleep(0.03), name="fetch")
    chain.step(lambda n: time.sleep(0.03), name="transform")

    @chain.step
    def store(n):
        time.sleep(0.03)
        return n
    """
)


class RabbitNode:
    """A private RabbitMQ node: ``start()`` (again on the same ports and data), ``kill()``, ``url``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port, self.dist_port = free_port(), free_port()
        self.name = f"durable_test_{uuid.uuid4().hex[:8]}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        (folder / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n")
        (folder / "rabbitmq-env.conf").write_text("")  # not the machine's (its node name)
        (folder / "enabled_plugins").write_text("[].\n")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> None:
        """Start the node and wait until it takes AMQP connections."""
        server = SERVER if os.path.exists(SERVER) else shutil.which("rabbitmq-server")
        if server is None:
            pytest.fail("no rabbitmq-server: install RabbitMQ", pytrace=False)
        f = self.folder
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_BASE": str(f),
            "RABBITMQ_MNESIA_BASE": str(f / "mnesia"),
            "RABBITMQ_LOG_BASE": str(f / "log"),
            "RABBITMQ_PID_FILE": str(f / "node.pid"),
            "RABBITMQ_CONFIG_FILE": str(f / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(f / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(f / "enabled_plugins"),
        }
        with open(f / "server.log", "a") as log:
            self.proc = subprocess.Popen(
                [server], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        # Kills the node's process group should this process die without stopping it.
        stop = f"read -r _; kill -9 -{self.proc.pid} 2>/dev/null"
        self.watchdog = subprocess.Popen(["sh", "-c", stop], stdin=subprocess.PIPE)
        until(self._answers, 60, f"the private RabbitMQ node on port {self.port}", self._log)

    def kill(self) -> None:
        """SIGKILL the whole node: every connection breaks at once."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
        if self.watchdog is not None:
            assert self.watchdog.stdin is not None
            self.watchdog.stdin.close()
            self.watchdog.wait(10)
            self.watchdog = None

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"the private RabbitMQ node exited {self.proc.returncode}: {self._log()}")
        connection = amqp.Connection(f"127.0.0.1:{self.port}", connect_timeout=0.5)
        try:
            connection.connect()
        except (OSError, amqp.AMQPError):
            return False
        connection.close()
        return True

    def _log(self) -> str:
        return (self.folder / "server.log").read_text(errors="replace")[-2000:]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RabbitNode]:
    folder = tmp_path / "rabbit"
    folder.mkdir()
    server = RabbitNode(folder)
    started = time.monotonic()
    server.start()
    print(f"\nprivate RabbitMQ node up in {time.monotonic() - started:.1f}s")
    yield server
    server.kill()


@pytest.fixture
def env(pg_url: str, node: RabbitNode, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "rabbitrestart.py").write_text(APP)
    base = {name: os.environ[name] for name in ("PATH", "HOME", "RELAY_AFTER") if name in os.environ}
    return {
        **base,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
        "PYTHONUNBUFFERED": "1",
        "BROKER": node.url,
        "QUEUE": f"q-{uuid.uuid4().hex[:8]}",
        "DB": pg_url,
    }


@pytest.fixture
def fleet(env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for pool in POOLS:
            with open(tmp_path / f"{pool}.log", "w") as log:
                cmd = [sys.executable, "-m", "celery", "-A", "rabbitrestart", "worker", "-P", pool, "-c", "2"]
                cmd += ["-n", f"{pool}@%h", "-Q", env["QUEUE"], "--loglevel", "INFO", "--without-mingle"]
                procs[pool] = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=log)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in procs.values():
            proc.wait(10)


@pytest.fixture
def client(env: dict[str, str]) -> Iterator[Durable]:
    app = Celery("rabbitrestart", broker=env["BROKER"])
    app.conf.task_default_queue = env["QUEUE"]
    durable = Durable(app, env["DB"], upkeep=False)
    chain = durable.workflow("chain")
    for name in ("fetch", "transform", "store"):
        chain.step(lambda n: None, name=name)
    yield durable
    durable.db.dispose()


def _completed(client: Durable, run_ids: list[str]) -> int:
    done = {run.id for run in client.list_runs(workflow="chain", status="completed", limit=2 * RUNS)}
    return len(done.intersection(run_ids))


def _answering(client: Durable) -> set[str]:
    try:
        replies = client.app.control.ping(timeout=0.5)
    except Exception:  # the broker is away
        return set()
    return {name.split("@", 1)[0] for reply in replies for name in reply}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_workers_survive_a_rabbitmq_restart_under_load_and_every_run_completes(
    node: RabbitNode, fleet: dict[str, subprocess.Popen[bytes]], client: Durable, tmp_path: Path
) -> None:
    def report() -> str:
        lines = [f"{_completed(client, run_ids)}/{RUNS} runs completed"]
        for pool, proc in fleet.items():
            tail = (tmp_path / f"{pool}.log").read_text(errors="replace")[-1500:]
            lines.append(f"--- {pool}: exit code {proc.poll()}\n{tail}")
        return "\n".join(lines)

    run_ids: list[str] = []
    until(lambda: _answering(client) == set(POOLS), 60, "both workers to answer a ping", report)
    run_ids = [client.start("chain", {"n": n}) for n in range(RUNS)]
    until(lambda: _completed(client, run_ids) >= 5, 30, "a first run to complete", report)

    node.kill()
    assert _completed(client, run_ids) < RUNS, "every run completed before RabbitMQ was killed: no load"

    def noticed() -> bool:
        logs = [(tmp_path / f"{pool}.log").read_text(errors="replace") for pool in POOLS]
        return all("Connection to broker lost" in log for log in logs)

    until(noticed, 20, "both workers to notice the lost broker", report)
    node.start()
    back_at = time.monotonic()
    until(lambda: _completed(client, run_ids) == RUNS, 60, "every run to complete", report)
    took = time.monotonic() - back_at
    assert all(proc.poll() is None for proc in fleet.values()), report()
    until(lambda: "prefork" in _answering(client), 30, "the prefork worker to answer again", report)
    assert [client.get_run(run_id).output for run_id in run_ids] == list(range(RUNS))
    print(f"every run completed {took:.1f}s after RabbitMQ was back")
