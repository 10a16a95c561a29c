"""The Django example (examples/django_shop) passes its own tests under Django's own runner.

``python manage.py test orders`` runs in a process of its own (Django's settings are per process,
and this one may have another Django project set up) against PostgreSQL and the suite's Redis.
Django's runner creates the test database ``test_<name>``, the example's DjangoDurable follows
it there, and the runner drops it at the end: which fails with "being accessed by other users"
if any connection of durable's were left open on it. The database ``<name>`` and the queue are
this test's own; it drops both databases and the queue's Redis keys, nothing else.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import psycopg
import pytest
import redis

from tests.conftest import PG_HOST, _admin
from tests.e2e.test_examples import ROOT, clean_env

SHOP = ROOT / "examples" / "django_shop"

# The example's tests that must have run (all of them pass, or the runner exits 1).
SHOP_TESTS = [
    "test_the_run_commits_with_the_request_and_a_worker_fulfils_the_order",
    "test_a_declined_payment_after_the_start_rolls_the_run_back_and_sends_nothing",
    "test_an_error_after_the_start_rolls_the_run_back_and_sends_nothing",
    "test_a_bad_form_starts_nothing",
    "test_connections_stay_bounded_over_many_runs_and_none_is_left_behind",
]


def _exists(database: str) -> bool:
    with _admin() as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone() is not None


@pytest.fixture
def shop_database() -> Iterator[str]:
    """An empty database of this test's for the shop; it and Django's ``test_<name>`` of it are
    dropped at the end (the name is random, so both are this test's)."""
    name = f"durable_t_djshop_{uuid.uuid4().hex[:10]}"
    assert not _exists(f"test_{name}")
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS test_{name} WITH (FORCE)")
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def shop_queue(redis_server: str) -> Iterator[str]:
    """A queue of this test's on the suite's Redis; its keys are deleted at the end."""
    queue = f"q-djshop-{uuid.uuid4().hex[:8]}"
    yield queue
    client = redis.Redis.from_url(redis_server)
    try:
        mine = list(client.scan_iter(match=f"*{queue}*"))  # the queue and kombu's binding of it
        if mine:
            client.delete(*mine)
    finally:
        client.close()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_the_django_shop_passes_its_tests_under_manage_py_test(
    shop_database: str, shop_queue: str, redis_server: str
) -> None:
    where = urlsplit(PG_HOST)
    env = clean_env(
        PYTHONPATH=str(ROOT),  # this checkout's durable_celery
        SHOP_DB_NAME=shop_database,
        SHOP_DB_HOST=where.hostname or "127.0.0.1",
        SHOP_DB_PORT=str(where.port or 5432),
        SHOP_DB_USER=unquote(where.username or "postgres"),
        SHOP_DB_PASSWORD=unquote(where.password or ""),
        SHOP_BROKER_URL=redis_server,
        SHOP_QUEUE=shop_queue,
    )
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "manage.py", "test", "orders", "--noinput", "-v", "2"],
        cwd=SHOP,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    took = time.monotonic() - began
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"manage.py test exited {done.returncode} after {took:.1f}s:\n{output}"
    assert "being accessed by other users" not in output, output
    assert re.search(r"^OK$", done.stderr, re.MULTILINE), output
    ran = re.search(r"^Ran (\d+) tests? in", done.stderr, re.MULTILINE)
    assert ran and int(ran[1]) >= len(SHOP_TESTS), output
    missing = [name for name in SHOP_TESTS if f"{name} (orders.tests." not in output]  # -v 2 names each
    assert not missing, f"these tests of the shop did not run: {missing}\n{output}"
    # Django's runner dropped its test database itself: nothing held it open.
    assert not _exists(f"test_{shop_database}"), output
    with psycopg.connect(f"{PG_HOST}/{shop_database}") as conn:  # the runner left <name> untouched
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
        assert tables == (0,)
