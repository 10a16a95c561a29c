"""Fixtures: a fresh PostgreSQL database per test (cloned from a migrated template), a Redis
broker, and the embedded SQLite default; the behaviour suite runs on both backends.

The suite is a good neighbour on shared servers: it drops only databases it created (the
session's template ``durable_test_template_<hex>`` and each test's clone) and flushes nothing.
Its broker is a ``redis-server`` of its own on a spare port, started for the session's first test
outside ``tests/unit`` and stopped at the end, unless ``DURABLE_TEST_REDIS`` names one to use.
Tests on RabbitMQ (``backend="rabbitmq"``, or the ``rabbitmq`` fixture) use the RabbitMQ at
``DURABLE_TEST_AMQP`` (127.0.0.1:5672) in a vhost of the session's own (``durable_test_<hex>``,
one per xdist worker), made with ``rabbitmqctl`` and deleted at the end.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, settings

from durable_celery import Durable
from durable_celery.testing import Fake

# libpq's default gssencmode=prefer asks Kerberos for credentials on each connect, which can
# crash a process connecting from many threads at once (psycopg issues 1088, 1213); the test
# servers use trust authentication. Set before any connection, inherited by every worker the
# tests start.
os.environ.setdefault("PGGSSENCMODE", "disable")


def _spare_port() -> int:
    """A port in 20000-29999 that nothing listens on now; below the ephemeral range, so no client
    socket takes it before the server starts on it."""
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999 for the test redis-server")


# Hypothesis profiles of the model suite (tests/model): ``ci`` by default, ``long`` with
# ``--hypothesis-profile=long``. Registered here so that option works from any command line.
_HYPOTHESIS = {
    "deadline": None,  # a step is a few database round trips; their time varies on a busy machine
    "database": None,  # failures are kept as explicit tests (tests/model/test_key_model_regressions.py)
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=60, stateful_step_count=30, **_HYPOTHESIS)
settings.register_profile("long", max_examples=1000, stateful_step_count=50, **_HYPOTHESIS)

PG_HOST = os.environ.get("DURABLE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
# Tests import REDIS_URL: it is fixed here, and the private server starts on this port later.
PRIVATE_REDIS_PORT = None if os.environ.get("DURABLE_TEST_REDIS") else _spare_port()
REDIS_URL = os.environ.get("DURABLE_TEST_REDIS") or f"redis://127.0.0.1:{PRIVATE_REDIS_PORT}/0"
AMQP_HOST = os.environ.get("DURABLE_TEST_AMQP", "127.0.0.1:5672")
TEMPLATE = os.environ.get("DURABLE_TEST_TEMPLATE") or f"durable_test_template_{uuid.uuid4().hex[:10]}"
UNIT_TESTS = Path(__file__).resolve().parent / "unit"

# Settings that make tests quick: a fast waker, fast heartbeats, short backoffs.
FAST = {
    "poll_interval": 0.1,
    "heartbeat_interval": 0.3,
    "stale_lock_timeout": 30.0,
    "backoff_base": 0.1,
    "relay_after": 30.0,
}


def _admin() -> psycopg.Connection[Any]:
    return psycopg.connect(f"{PG_HOST}/postgres", autocommit=True)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database of this session's, migrated once and dropped at the end; every test clones it
    (fails, never skips, without a server)."""
    with _admin() as conn:
        try:
            conn.execute(f"CREATE DATABASE {TEMPLATE}")
        except psycopg.errors.DuplicateDatabase:
            pytest.fail(
                f"database {TEMPLATE} exists already at {PG_HOST}: the suite drops only what it creates; "
                "drop it if it is a leftover, or name another with DURABLE_TEST_TEMPLATE",
                pytrace=False,
            )
    try:
        durable = Durable(Celery("template", broker="memory://"), f"{PG_HOST}/{TEMPLATE}", upkeep=False)
        durable.migrate()
        durable.db.dispose()
        yield TEMPLATE
    finally:
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")


class PrivateRedis:
    """A ``redis-server`` without persistence on ``port``, in a folder of its own, stopped on
    exit, and by a watchdog if this process dies without exiting (killed, say)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.folder = Path(tempfile.mkdtemp(prefix="durable-test-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrivateRedis:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.folder), "--logfile", str(self.folder / "redis.log")]
        try:
            self.proc = subprocess.Popen(["redis-server", *args])
        except FileNotFoundError:
            self.__exit__()
            pytest.fail(
                "no redis-server on the PATH: install Redis, or set DURABLE_TEST_REDIS", pytrace=False
            )
        # The watchdog waits for EOF on its stdin, a pipe only we hold: it comes when we close it
        # or when this process dies, however it dies; then it stops the server.
        stop = f"read -r _; kill {self.proc.pid} 2>/dev/null"
        self.watchdog = subprocess.Popen(["sh", "-c", stop], stdin=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"the test redis-server on 127.0.0.1:{self.port} did not start: {self._log()}"
                self.__exit__()
                pytest.fail(why, pytrace=False)
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        if self.watchdog is not None:  # it stops the server while that is still our child
            assert self.watchdog.stdin is not None
            self.watchdog.stdin.close()
            self.watchdog.wait(10)
            self.watchdog = None
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)

    def _answers(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False
        finally:
            client.close()

    def _log(self) -> str:
        log = self.folder / "redis.log"
        return log.read_text(errors="replace")[-1000:] if log.exists() else "(no log)"


@pytest.fixture(scope="session", autouse=True)
def redis_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """REDIS_URL, up: the private server, started when this session runs a test outside
    tests/unit (those need no servers), or DURABLE_TEST_REDIS's, used as it is."""
    items = request.session.items
    if PRIVATE_REDIS_PORT is None or all(Path(item.path).is_relative_to(UNIT_TESTS) for item in items):
        yield REDIS_URL
        return
    with PrivateRedis(PRIVATE_REDIS_PORT):
        yield REDIS_URL


@pytest.fixture(scope="session")
def redis_client(redis_server: str) -> Iterator[redis.Redis]:
    """A client of the test broker's Redis; never flushed (a private server starts empty)."""
    client = redis.Redis.from_url(redis_server)
    client.ping()  # fails, never skips, without a server
    yield client
    client.close()


def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` on the machine's node; its output (fails the test when it fails)."""
    try:
        done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.fail("no rabbitmqctl on the PATH: install RabbitMQ", pytrace=False)
    if done.returncode:
        pytest.fail(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}", pytrace=False)
    return done.stdout


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[str]:
    """The AMQP URL of a vhost of this session's own on the machine's RabbitMQ (user guest),
    deleted at the end with everything in it (fails, never skips, without RabbitMQ)."""
    vhost = f"durable_test_{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{AMQP_HOST}/{vhost}"
    finally:
        rabbitmqctl("delete_vhost", vhost)


# The brokers the broker-sensitive tests run on: ``@pytest.mark.parametrize("backend", BROKERS)``
# gives them PostgreSQL with Redis, then PostgreSQL with RabbitMQ (the ``broker_url`` fixture is
# that broker's URL). A suite that also runs on the embedded default takes BROKERS_AND_SQLITE.
BROKERS = ["postgres", "rabbitmq"]
BROKERS_AND_SQLITE = [*BROKERS, "sqlite"]
# Brokers nothing listens on (port 1), by the backend they stand in for.
DEAD_BROKERS = {"postgres": "redis://127.0.0.1:1/0", "rabbitmq": "amqp://guest:guest@127.0.0.1:1//"}


@pytest.fixture
def broker_url(backend: str, request: pytest.FixtureRequest) -> str:
    """The broker of this test's backend: the test Redis ("postgres"), or the session's RabbitMQ
    vhost ("rabbitmq"); for tests parametrised over BROKERS."""
    if backend == "rabbitmq":
        return str(request.getfixturevalue("rabbitmq"))
    assert backend == "postgres", f"no broker of its own for the backend {backend!r}"
    request.getfixturevalue("redis_client")
    return REDIS_URL


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test."""
    name = f"durable_t_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield f"{PG_HOST}/{name}"
    with _admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    """The storage backend of the behaviour suite: PostgreSQL + Redis, or the embedded default."""
    return str(request.param)


# The suites of the features the in-memory store must run as the embedded default does
# (waits, children, compensation, running) also run on it: their ``backend`` fixture takes
# ``params=EVERY_STORE``.
EVERY_STORE = ["postgres", "sqlite", "memory"]


MakeDurable = Callable[..., Durable]


@pytest.fixture
def make_durable(backend: str, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[MakeDurable]:
    """Build a Celery app and its Durable on this test's backend; each gets its own queue."""
    created: list[Durable] = []
    queue = f"q-{uuid.uuid4().hex[:8]}"
    if backend == "fake":
        url, broker = f"memory://{uuid.uuid4().hex}", "memory://localhost/"
    elif backend == "postgres":
        request.getfixturevalue("redis_client")
        url, broker = request.getfixturevalue("pg_url"), REDIS_URL
    elif backend == "rabbitmq":
        url, broker = request.getfixturevalue("pg_url"), request.getfixturevalue("rabbitmq")
    else:
        url, broker = f"sqlite:///{tmp_path}/durable.sqlite3", "memory://"
        if backend == "memory" or os.environ.get("DURABLE_TEST_SQLITE") == "memory":
            url = f"memory://{uuid.uuid4().hex}"  # the in-memory store (memory://)

    def make(name: str = "tests", *, broker_url: str | None = None, **settings: Any) -> Durable:
        if backend == "fake":  # testing.Fake: the memory store, steps run by testing.worker's thread
            app = Celery(name, broker="memory://localhost/", set_as_current=True)
            fake = Fake(app, store=url, **{**FAST, **settings})
            created.append(fake)
            return fake
        app = Celery(name, broker=broker_url or broker, set_as_current=True)
        app.conf.task_default_queue = queue
        app.conf.broker_connection_retry_on_startup = True
        if app.conf.broker_url == "memory://":
            app.conf.broker_transport_options = {"polling_interval": 0.05}
        durable = Durable(app, url, **{**FAST, **settings})
        if backend == "sqlite" and not created:
            durable.migrate()
        created.append(durable)
        return durable

    yield make
    for durable in created:
        durable.db.dispose()


@pytest.fixture
def durable(make_durable: MakeDurable) -> Durable:
    """A Durable on this test's backend."""
    return make_durable()
