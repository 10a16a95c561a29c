"""A private PostgreSQL server for outage tests, on a free port in a folder of its own.

```python
from tests.pgserver import PgServer, pg_server  # noqa: F401  (the fixture, for conftest or a module)

with PgServer() as server:            # started; stopped and removed on exit
    durable = Durable(app, server.url)
    server.stop(mode="immediate")     # gone, as if the machine lost power: connections break
    server.start()                    # the same data on the same port, after crash recovery
```

Binaries come from ``$DURABLE_TEST_PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``, else
``pg_ctl`` on the PATH; without them the test fails, it does not skip. As root the server runs as
the ``postgres`` user (``$DURABLE_TEST_PG_USER``), since PostgreSQL refuses to run as root. One
cluster is made with ``initdb`` per test process and copied for every server, and fsync is off,
so a server is up in well under a second; what was committed survives an immediate stop.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

OWNER = os.environ.get("DURABLE_TEST_PG_USER", "postgres")  # used only when the tests run as root
TIMEOUT = 30  # seconds pg_ctl waits for a start or a stop

# Quick: no fsync, since the OS keeps what a killed server wrote; but commits are synchronous,
# so everything committed survives ``stop(mode="immediate")`` (an async commit would not).
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "synchronous_commit": "on",
    "full_page_writes": "off",
    "shared_buffers": "16MB",
    "max_connections": "50",
    "max_wal_size": "64MB",
    "logging_collector": "off",
}

_template_lock = threading.Lock()
_template: Path | None = None


def bin_dir() -> Path:
    """The folder of the PostgreSQL server binaries (initdb, pg_ctl)."""
    given = os.environ.get("DURABLE_TEST_PG_BIN")
    if given:
        return Path(given)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if found:
        return Path(found[-1])
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        return Path(pg_ctl).parent
    raise RuntimeError("no PostgreSQL server binaries: install postgresql or set DURABLE_TEST_PG_BIN")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_owner(command: list[str]) -> list[str]:
    return ["runuser", "-u", OWNER, "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str], cwd: Path, what: str, log: Path | None = None) -> None:
    done = subprocess.run(
        _as_owner(command), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT + 30, check=False
    )
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stdout}{done.stderr}{tail}")


def _owned_folder(prefix: str) -> Path:
    # Under the system temp folder, not pytest's tmp_path: root's 0700 folders there are closed
    # to the postgres user.
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        owner = pwd.getpwnam(OWNER)
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    return folder


def _cluster_template() -> Path:
    # initdb is the slow part (a second or two); do it once per process and copy the result.
    global _template
    with _template_lock:
        if _template is None:
            folder = _owned_folder("durable-pg-template-")
            atexit.register(shutil.rmtree, folder, True)
            command = [str(bin_dir() / "initdb"), "-D", str(folder / "data"), "-U", "postgres"]
            command += ["-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]
            _run(command, folder, "initdb")
            _template = folder / "data"
        return _template


class PgServer:
    """A private PostgreSQL server: ``start()``, ``stop(mode)``, ``restart(mode)``, ``url``."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.folder = _owned_folder("durable-pg-")
        self.data = self.folder / "data"
        self.log = self.folder / "server.log"
        self.running = False
        _run(["cp", "-a", str(_cluster_template()), str(self.data)], self.folder, "copying the cluster")
        settings = {**SETTINGS, "port": str(self.port), "unix_socket_directories": f"'{self.folder}'"}
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write("".join(f"{name} = {value}\n" for name, value in settings.items()))

    @property
    def url(self) -> str:
        """The URL of the ``postgres`` database of this server."""
        return self.url_of("postgres")

    def url_of(self, database: str) -> str:
        """The URL of ``database`` on this server."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create database ``name`` (the server must be running) and return its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def start(self) -> None:
        """Start the server and wait until it accepts connections (after crash recovery)."""
        command = [str(bin_dir() / "pg_ctl"), "-D", str(self.data), "-l", str(self.log)]
        _run([*command, "-w", "-t", str(TIMEOUT), "start"], self.folder, "pg_ctl start", self.log)
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``"immediate"`` kills it as a crash would, ``"fast"`` cleanly."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be smart, fast or immediate, not {mode!r}")
        command = [str(bin_dir() / "pg_ctl"), "-D", str(self.data), "-m", mode]
        _run([*command, "-w", "-t", str(TIMEOUT), "stop"], self.folder, "pg_ctl stop", self.log)
        self.running = False

    def restart(self, mode: str = "immediate") -> None:
        """Stop the server (by ``mode``) and start it again on the same port."""
        self.stop(mode)
        self.start()

    def close(self) -> None:
        """Stop the server if it runs (or was left half-started), and remove its folder."""
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists():
            try:
                self.stop("immediate")
            except RuntimeError:  # pg_ctl could not stop it: end the postmaster we started
                with contextlib.suppress(OSError, ValueError, IndexError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        self.running = False
        shutil.rmtree(self.folder, ignore_errors=True)

    def standby(self) -> PgServer:
        """A streaming replica of this running server (``pg_basebackup -R``), on a port of its
        own, not started yet: ``start()`` it, and it replays what this one commits."""
        replica = PgServer.__new__(PgServer)
        replica.port, replica.running = free_port(), False
        replica.folder = _owned_folder("durable-pg-standby-")
        replica.data, replica.log = replica.folder / "data", replica.folder / "server.log"
        command = [
            str(bin_dir() / "pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
        ]
        _run(
            [*command, "-D", str(replica.data), "-R", "-X", "stream", "--no-sync"],
            replica.folder,
            "pg_basebackup",
        )
        settings = {
            "port": str(replica.port),
            "unix_socket_directories": f"'{replica.folder}'",
            "hot_standby": "on",
        }
        with open(replica.data / "postgresql.conf", "a") as conf:
            conf.write("".join(f"{name} = {value}\n" for name, value in settings.items()))
        return replica

    def __enter__(self) -> PgServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@pytest.fixture
def pg_server() -> Iterator[PgServer]:
    """A private PostgreSQL server for this test, running; stopped and removed afterwards."""
    server = PgServer()
    try:
        server.start()
        yield server
    finally:
        server.close()
