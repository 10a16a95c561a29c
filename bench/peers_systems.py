"""The four systems of ``bench.peers``: how each is set up, its workers started, and driven.

Each system runs as separate processes, as it would in production: its workers (two processes
each: ``celery worker -P prefork -c 2`` for plain Celery and durable, two ``bench.peers_worker``
processes for DBOS and for procrastinate) and one producer process (``bench.peers_producer``)
that starts runs when the bench tells it to. Every worker and producer logs to a file in the
bench's scratch folder (shown when one fails).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg
import redis

from bench.common import say

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "peers-producer "


@dataclass(frozen=True)
class Spec:
    """A system: its name, label, the package it needs, and whether Redis is its broker."""

    name: str
    label: str
    package: str | None
    broker: bool
    keyed_cleanup: tuple[str, ...] = ()


SPECS = (
    Spec("plain", "plain Celery chain", None, True),
    Spec(
        "durable",
        "durable_celery",
        None,
        True,
        ("DELETE FROM durable_runs WHERE workflow = 'peers_keyed'",),
    ),
    Spec(
        "dbos", "DBOS", "dbos", False, ("DELETE FROM dbos.workflow_status WHERE queue_name = 'peers_keyed'",)
    ),
    Spec(
        "procrastinate",
        "procrastinate",
        "procrastinate",
        False,
        ("DELETE FROM procrastinate_jobs WHERE queue_name = 'peers_keyed'",),
    ),
)


def available(spec: Spec) -> bool:
    """Whether the system's package is installed."""
    return spec.package is None or importlib.util.find_spec(spec.package) is not None


@dataclass
class Env:
    """What every process of the bench is given: the database, the broker, the scratch folder."""

    database_url: str
    broker: str
    folder: Path
    concurrency: int
    peer_concurrency: int
    dbos_poll: float

    def vars(self) -> dict[str, str]:
        """The environment of a worker or producer process."""
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "BENCH_PEERS_DB": self.database_url,
            "BENCH_PEERS_REDIS": self.broker,
            "BENCH_PEERS_DIR": str(self.folder),
            "BENCH_PEERS_DBOS_POLL": str(self.dbos_poll),
        }


@dataclass
class Running:
    """A started system: its worker processes, its producer and the logs they write."""

    spec: Spec
    env: Env
    workers: list[subprocess.Popen[Any]] = field(default_factory=list)
    producer: subprocess.Popen[str] | None = None
    logs: list[Path] = field(default_factory=list)
    files: list[IO[str]] = field(default_factory=list)

    def _popen(self, cmd: list[str], tag: str, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process of this system, its stderr (and stdout unless piped) to a log file."""
        path = self.env.folder / f"{self.spec.name}-{tag}.log"
        log = open(path, "w")  # noqa: SIM115 - closed in stop()
        self.files.append(log)
        self.logs.append(path)
        kwargs.setdefault("stdout", log)
        return subprocess.Popen(cmd, cwd=ROOT, env=self.env.vars(), stderr=log, **kwargs)

    def start_workers(self, client: redis.Redis) -> None:
        """Start the worker processes and wait until each said it is up."""
        name = self.spec.name
        if name in ("plain", "durable"):
            cmd = [sys.executable, "-m", "celery", "-A", f"bench.peers_{name}_app", "worker", "-P", "prefork"]
            cmd += ["-c", str(self.env.concurrency), "-Q", f"peers_{name}", "-n", f"peers_{name}@%h"]
            cmd += ["--loglevel", "WARNING", "--without-mingle", "--without-gossip", "--without-heartbeat"]
            self.workers.append(self._popen(cmd, "worker"))
            self._wait_ready(client, 1)
            return
        for index in range(1, self.env.concurrency + 1):
            cmd = [
                sys.executable,
                "-m",
                "bench.peers_worker",
                name,
                str(index),
                str(self.env.peer_concurrency),
            ]
            self.workers.append(self._popen(cmd, f"worker{index}"))
            # The first DBOS worker creates DBOS's schema: the others start once it is up.
            self._wait_ready(client, index)

    def _wait_ready(self, client: redis.Redis, count: int, timeout: float = 120.0) -> None:
        """Wait until ``count`` workers of this system said they are up."""
        deadline = time.monotonic() + timeout
        while int(client.get(f"peers:ready:{self.spec.name}") or 0) < count:
            if any(w.poll() is not None for w in self.workers) or time.monotonic() > deadline:
                self.show_logs()
                raise RuntimeError(f"a worker of {self.spec.label} did not start")
            time.sleep(0.1)

    def start_producer(self) -> None:
        """Start the producer process and wait for its first line."""
        cmd = [sys.executable, "-m", "bench.peers_producer", self.spec.name]
        self.producer = self._popen(cmd, "producer", stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        self._answer()

    def command(self, **command: Any) -> dict[str, Any]:
        """Send the producer one command; returns its answer."""
        assert self.producer is not None and self.producer.stdin is not None
        self.producer.stdin.write(json.dumps(command) + "\n")
        self.producer.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        """The producer's next answer (lines not its own are passed over)."""
        assert self.producer is not None and self.producer.stdout is not None
        for line in self.producer.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        self.show_logs()
        raise RuntimeError(f"the producer of {self.spec.label} exited")

    def show_logs(self, lines: int = 15) -> None:
        """Print the end of every log of this system."""
        for path in self.logs:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            say(f"--- {path.name}: " + ("(empty)" if not tail else ""))
            for line in tail:
                say(f"    {line}")

    def stop(self) -> None:
        """Stop the producer, then the workers (SIGTERM, then SIGKILL after 30 s)."""
        if self.producer is not None and self.producer.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.producer.stdin is not None
                self.producer.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.producer.stdin.close()
            _end(self.producer)
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in self.workers:
            _end(worker)
        for log in self.files:
            log.close()


def _end(proc: subprocess.Popen[Any]) -> None:
    """Wait for a process to exit, killing it after 30 s."""
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def prepare_schemas(database_url: str, names: list[str], broker: str) -> None:
    """Create what each system needs in the database: durable's tables (migrated),
    procrastinate's schema (once). DBOS's first worker creates its own schema at launch."""
    if "durable" in names:
        from celery import Celery

        from durable_celery import Durable

        setup = Durable(
            Celery("peers_setup", broker=broker, set_as_current=False), database_url, upkeep=False
        )
        setup.migrate()
        setup.db.dispose()
    if "procrastinate" in names:
        with psycopg.connect(database_url, autocommit=True) as conn:
            present = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()
        if present is None or present[0] is None:
            import procrastinate

            app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=database_url))
            with app.open():
                app.schema_manager.apply_schema()
