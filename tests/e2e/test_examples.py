"""The examples as real programs: the demo's whole output, and the shop app under `celery worker`.

The demo needs no servers and runs from any folder. The worker test runs
`celery -A examples.shop worker` as its own process against PostgreSQL and Redis, and fails
(never skips) when either is unreachable.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.conftest import PRIVATE_REDIS_PORT, REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_DEMO = Path(__file__).with_name("demo_output.txt")
PG_HOST = os.environ.get("DURABLE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
# The suite's own Redis (database 11 of it), unless DURABLE_TEST_SHOP_REDIS names another.
SHOP_REDIS_GIVEN = os.environ.get("DURABLE_TEST_SHOP_REDIS")
SHOP_REDIS = SHOP_REDIS_GIVEN or REDIS_URL.rsplit("/", 1)[0] + "/11"


def clean_env(**extra: str) -> dict[str, str]:
    """Only PATH and HOME from this process, so no server address leaks into a child."""
    env = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_demo(cwd: Path) -> None:
    """Run `python -m durable_celery demo` in ``cwd`` and compare its whole output."""
    done = subprocess.run(
        [sys.executable, "-m", "durable_celery", "demo"],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    # The story's own failure is told in the report, not logged as an ERROR with a traceback.
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    expected = EXPECTED_DEMO.read_text()
    if done.stdout != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                done.stdout.splitlines(keepends=True),
                "demo_output.txt",
                "python -m durable_celery demo",
            )
        )
        pytest.fail(f"the demo's output changed:\n{diff}\nstderr:\n{done.stderr}")


@pytest.mark.timeout(120)
def test_demo_prints_exactly_the_expected_output() -> None:
    run_demo(ROOT)


@pytest.mark.timeout(120)
def test_demo_runs_outside_a_checkout_and_leaves_nothing_behind(tmp_path: Path) -> None:
    # From an empty folder `examples` is not importable: the demo needs only the package.
    # (tests/release/check_wheel.sh runs it from an installed wheel as well.)
    run_demo(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def shop_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for the shop, dropped afterwards."""
    name = f"durable_example_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield f"{PG_HOST}/{name}"
    finally:
        with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def shop_broker(redis_server: str) -> Iterator[str]:
    """The shop's Redis database: one of the suite's own server, emptied afterwards; one of a
    server given with DURABLE_TEST_SHOP_REDIS or DURABLE_TEST_REDIS is left as it is."""
    client = redis.Redis.from_url(SHOP_REDIS, socket_connect_timeout=5)
    client.ping()
    try:
        yield SHOP_REDIS
    finally:
        if not SHOP_REDIS_GIVEN and PRIVATE_REDIS_PORT is not None:
            client.flushdb()  # a database of the server this session started
        client.close()


# The producer: starts two orders through examples.shop's own app, polls get_run until both
# finish, and prints what the database recorded (run ids stay inside this process).
PRODUCER = """
import json, time
from examples.shop import durable, place_order

orders = [
    {"order_id": "E-1", "sku": "mug", "quantity": 3, "payment_token": "tok_visa"},
    {"order_id": "E-2", "sku": "tee", "quantity": 1, "payment_token": "tok_flaky"},
]
run_ids = [place_order.start(order) for order in orders]
deadline = time.monotonic() + 60
runs = [durable.get_run(run_id) for run_id in run_ids]
while not all(run.finished for run in runs) and time.monotonic() < deadline:
    time.sleep(0.1)
    runs = [durable.get_run(run_id) for run_id in run_ids]
print(json.dumps([
    {
        "status": run.status,
        "output": run.output,
        "error": run.error,
        "steps": [[s.name, s.attempt, s.status, s.worker] for s in durable.list_steps(run.id)],
    }
    for run in runs
]))
"""


def celery(*args: str) -> list[str]:
    """A `celery` command line on this interpreter."""
    return [sys.executable, "-m", "celery", "-A", "examples.shop", *args]


def stop(process: subprocess.Popen[Any]) -> int:
    """SIGTERM (Celery's warm shutdown), then wait; kill only if it will not stop."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
            raise
    return process.returncode


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_shop_runs_under_a_celery_worker_on_postgres_and_redis(
    shop_database: str, shop_broker: str, tmp_path: Path
) -> None:
    env = clean_env(DURABLE_DATABASE_URL=shop_database, SHOP_BROKER_URL=shop_broker)
    migrate = subprocess.run(
        celery("durable", "migrate"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert migrate.returncode == 0, migrate.stderr
    assert "applying 0001" in migrate.stdout
    check = subprocess.run(
        celery("durable", "migrate", "--check"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert (check.returncode, check.stdout.strip()) == (0, "database is up to date"), check.stderr

    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        worker = subprocess.Popen(
            celery("worker", "--pool", "threads", "-c", "2", "-Q", "shop", "-l", "info", "-n", "shop-e2e@%h"),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        producer = subprocess.run(
            [sys.executable, "-c", PRODUCER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
        )
        assert producer.returncode == 0, producer.stderr
        assert worker.poll() is None, "the worker exited early"
    finally:
        exit_code = stop(worker)
    worker_log = log_path.read_text()
    plain, flaky = json.loads(producer.stdout)
    assert plain["status"] == "completed", (plain, worker_log)
    assert plain["output"] == {
        "order": "E-1",
        "charged_cents": 3600,
        "payment": "PAY-E-1-1",
        "tracking": "TRK-E-1",
    }
    assert [step[:3] for step in plain["steps"]] == [
        ["reserve_stock", 1, "completed"],
        ["charge", 1, "completed"],
        ["ship", 1, "completed"],
    ]
    # The retry went through the relay inside the worker: the upkeep bootstep runs there.
    assert flaky["status"] == "completed", (flaky, worker_log)
    assert flaky["output"]["payment"] == "PAY-E-2-2"
    assert [step[:3] for step in flaky["steps"]] == [
        ["reserve_stock", 1, "completed"],
        ["charge", 1, "failed"],
        ["charge", 2, "completed"],
        ["ship", 1, "completed"],
    ]
    # Every step ran in the worker process, not in the producer.
    assert {step[3].rsplit(":", 1)[1] for step in plain["steps"] + flaky["steps"]} == {str(worker.pid)}
    assert exit_code == 0, worker_log
    assert "durable.place_order.charge" in worker_log
