"""The servers and worker processes of one chaos scenario, all started here so they can be
killed: a private PostgreSQL server (``tests.pgserver.PgServer``), a private ``redis-server``
(``tests.conftest.PrivateRedis``) and ``celery -A tests.chaos.app worker`` processes.

Each worker runs in a process group of its own (its prefork pool processes with it), so a
whole node can be killed or stopped at once, and a watchdog ends the group if this process dies
without cleaning up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from durable_celery import Durable
from tests.chaos.workflows import LEDGER_DDL, SETTINGS, make_producer
from tests.conftest import PrivateRedis, _spare_port
from tests.pgserver import PgServer, _as_owner, bin_dir

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "chaos_template"
READY_WITHIN = 60.0  # seconds a worker may take to start on a busy 2-core machine


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies left out)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


def rss_kb(pid: int) -> int:
    """The resident memory of ``pid`` in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def watchdog(command: str) -> subprocess.Popen[bytes]:
    """A shell that runs ``command`` once its stdin closes: when we close it, or when this
    process dies however it dies. It has a session of its own and ignores TERM, HUP and INT, so
    a signal to our process group (``timeout``, Ctrl-C) reaches us, not it."""
    script = f"trap '' TERM HUP INT; read -r _; {{ {command}; }} >/dev/null 2>&1"
    return subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, start_new_session=True)


class ChaosServer(PgServer):
    """A ``PgServer`` with room for the racers' connections (four racer processes, the workers'
    pools and ledgers and the producers' pool pass the 50 ``PgServer`` allows), stopped by a
    watchdog if this process dies without stopping it."""

    def __init__(self) -> None:
        super().__init__()
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write("max_connections = 200\n")
        pg_ctl = " ".join(_as_owner([str(bin_dir() / "pg_ctl"), "-D", str(self.data), "-m", "immediate"]))
        self._watchdog = watchdog(f"{pg_ctl} stop; rm -rf {self.folder}")

    def close(self) -> None:
        super().close()
        assert self._watchdog.stdin is not None
        self._watchdog.stdin.close()
        self._watchdog.wait(30)


def chaos_server() -> ChaosServer:
    """The suite's private PostgreSQL server (not started)."""
    return ChaosServer()


def prepare_template(pg: PgServer) -> None:
    """A migrated database with the ledger table on ``pg``, cloned by every scenario."""
    with psycopg.connect(pg.url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (TEMPLATE,)).fetchone():
            return
        conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
    url = pg.url_of(TEMPLATE)
    migrator = Durable(Celery("chaos-migrate", broker="memory://"), url, upkeep=False)
    migrator.migrate()
    migrator.db.dispose()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LEDGER_DDL)


class Broker:
    """The scenario's Redis: a ``PrivateRedis`` on a fixed port, killed and started again there."""

    def __init__(self) -> None:
        self.port = _spare_port()
        self.server: PrivateRedis | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.server = PrivateRedis(self.port).__enter__()

    def kill(self) -> None:
        """SIGKILL: every connection breaks and every message it held is gone."""
        server, self.server = self.server, None
        if server is not None and server.proc is not None:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            server.__exit__()

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.__exit__()


class Worker:
    """One ``celery worker`` node; ``start()`` again after it was killed or stopped."""

    def __init__(self, cluster: Cluster, name: str, pool: str, concurrency: int = 2) -> None:
        self.cluster, self.name, self.pool, self.concurrency = cluster, name, pool, concurrency
        self.proc: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        self.generation = 0
        self.started_at = 0.0
        self.ready_at: float | None = None

    @property
    def log_path(self) -> Path:
        return self.cluster.folder / f"{self.name}-{self.generation}.log"

    def start(self) -> None:
        self.generation += 1
        cmd = [sys.executable, "-m", "celery", "-A", "tests.chaos.app", "worker", "-P", self.pool]
        cmd += ["-c", str(self.concurrency), "-n", f"{self.name}@%h", "-Q", self.cluster.queue]
        cmd += ["--loglevel", "INFO", "--without-mingle", "--without-gossip"]
        env = {**self.cluster.worker_env(), "CHAOS_WORKER": self.name}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.watchdog = watchdog(f"kill -KILL -{self.proc.pid}")
        self.started_at = time.time()
        self.ready_at = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """The node's processes: the worker and its pool processes."""
        return group_pids(self.pid) if self.proc is not None else []

    def children(self) -> list[int]:
        return [pid for pid in self.pids() if pid != self.pid]

    def ready(self) -> bool:
        if self.ready_at is None and self.alive() and " ready." in self.log_path.read_text(errors="replace"):
            self.ready_at = time.time()
        return self.ready_at is not None and self.alive()

    def settled(self, seconds: float = 2.0) -> bool:
        """Ready for ``seconds``: Celery exits ("Could not start worker processes") when a pool
        process dies while the pool is still starting, so a pool kill waits for this."""
        return self.ready() and time.time() - (self.ready_at or 0.0) >= seconds

    def wait_ready(self, seconds: float = READY_WITHIN) -> None:
        deadline = time.monotonic() + seconds
        while not self.ready():
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name} did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole node, the pool processes with it, and reap it."""
        self.signal_group(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait(30)
        if self.watchdog is not None:
            assert self.watchdog.stdin is not None
            self.watchdog.stdin.close()  # the group's leftovers (none, normally) go with it
            self.watchdog.wait(10)
            self.watchdog = None

    def close(self) -> None:
        if self.proc is not None:
            self.signal_group(signal.SIGCONT)  # a stopped group cannot die
            self.kill()

    def rss(self) -> dict[int, int]:
        """KiB resident per process of the node."""
        return {pid: rss_kb(pid) for pid in self.pids()}

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.log_path.name} (exit {self.proc.poll() if self.proc else None})\n{text[-chars:]}"


class Cluster:
    """A database cloned from the template on ``pg``, a fresh Redis, workers, and a producer-side
    ``Durable`` (``client``) on them."""

    def __init__(
        self,
        pg: PgServer,
        folder: Path,
        name: str,
        workers: tuple[tuple[str, str], ...] = (("a", "prefork"), ("b", "threads")),
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.pg, self.folder, self.name = pg, folder, name
        self.settings = {**SETTINGS, **(settings or {})}
        self.database = f"chaos_{name}_{uuid.uuid4().hex[:6]}"
        self.queue = f"chaos-{name}"
        self.broker = Broker()
        self.workers = {wname: Worker(self, wname, pool) for wname, pool in workers}
        self.client: Durable | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.pg.url_of(self.database)

    def worker_env(self) -> dict[str, str]:
        env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
        return {
            **env,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "CHAOS_BROKER": self.broker.url,
            "CHAOS_DB": self.url,
            "CHAOS_QUEUE": self.queue,
            "CHAOS_SETTINGS": json.dumps(self.settings),
        }

    def start(self) -> None:
        """``launch()``, then wait until every worker is ready."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """The database, Redis, the workers (not waiting for them) and the client."""
        prepare_template(self.pg)
        with psycopg.connect(self.pg.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}" TEMPLATE "{TEMPLATE}"')
        self.broker.start()
        for worker in self.workers.values():
            worker.start()
        self.client = self.make_client()

    def wait_ready(self) -> None:
        for worker in self.workers.values():
            worker.wait_ready()

    def make_client(self) -> Durable:
        """A producer-side ``Durable`` (no upkeep, no worker) on this cluster."""
        return make_producer(self.broker.url, self.url, self.queue, self.settings, f"chaos-{self.name}")

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=3)

    def logs(self) -> str:
        return "\n".join(worker.log_tail() for worker in self.workers.values())

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.broker.close()
        if self.client is not None:
            self.client.db.dispose()
            self.client = None
