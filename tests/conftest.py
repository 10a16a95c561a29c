"""Fixtures: a fresh PostgreSQL database per test (cloned from a migrated template), a Redis
broker, and the embedded SQLite default; the behaviour suite runs on both backends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from durable_celery import Durable

PG_HOST = os.environ.get("DURABLE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("DURABLE_TEST_REDIS", "redis://127.0.0.1:6379/9")
TEMPLATE = os.environ.get("DURABLE_TEST_TEMPLATE", "durable_test_template")

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
def pg_template() -> str:
    """A database migrated once; every test clones it (fails, never skips, without a server)."""
    with _admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    durable = Durable(Celery("template", broker="memory://"), f"{PG_HOST}/{TEMPLATE}", upkeep=False)
    durable.migrate()
    durable.db.dispose()
    return TEMPLATE


@pytest.fixture(scope="session")
def redis_client() -> redis.Redis:
    """The test broker's Redis, emptied once per session."""
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    return client


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


MakeDurable = Callable[..., Durable]


@pytest.fixture
def make_durable(backend: str, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[MakeDurable]:
    """Build a Celery app and its Durable on this test's backend; each gets its own queue."""
    created: list[Durable] = []
    queue = f"q-{uuid.uuid4().hex[:8]}"
    if backend == "postgres":
        request.getfixturevalue("redis_client")
        url, broker = request.getfixturevalue("pg_url"), REDIS_URL
    else:
        url, broker = f"sqlite:///{tmp_path}/durable.sqlite3", "memory://"

    def make(name: str = "tests", *, broker_url: str | None = None, **settings: Any) -> Durable:
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
