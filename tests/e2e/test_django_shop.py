"""The Django example (examples/django_shop) passes its own tests under Django's own runner.

``python manage.py test orders`` runs in a process of its own (Django's settings are per process,
and this one may have another Django project set up) against PostgreSQL and the suite's Redis.
Django's runner creates the test database ``test_<name>``, the example's DjangoDurable follows
it there, and the runner drops it at the end: which fails with "being accessed by other users"
if any connection of durable's were left open on it. The database ``<name>`` and the queue are
this test's own; it drops both databases and the queue's Redis keys, nothing else.

The shop's atomic step ``ship`` under real ``celery -A shop_project worker`` processes (prefork):
killed with SIGKILL while ``ship`` has created its shipment but not committed, the order is
shipped once all the same. A test-only Django app (``HOLD_APP``, installed by the test's
settings module) holds the first try of ``ship`` right after its shipment's INSERT, and says so
with a file, so the test kills it there and nowhere else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
import pytest
import redis
from celery import Celery

from durable_celery import Durable
from durable_celery.testing import wait_for
from tests.conftest import PG_HOST, _admin
from tests.e2e.support import until
from tests.e2e.test_examples import ROOT, clean_env

SHOP = ROOT / "examples" / "django_shop"

# The example's tests that must have run (all of them pass, or the runner exits 1).
SHOP_TESTS = [
    "test_the_run_commits_with_the_request_and_a_worker_fulfils_the_order",
    "test_a_ship_try_that_fails_after_writing_keeps_nothing_and_the_retry_ships_once",
    "test_a_declined_payment_after_the_start_rolls_the_run_back_and_sends_nothing",
    "test_an_error_after_the_start_rolls_the_run_back_and_sends_nothing",
    "test_a_bad_form_starts_nothing",
    "test_connections_stay_bounded_over_many_runs_and_none_is_left_behind",
    # POST /payments/, keyed by its Idempotency-Key (issue 41)
    "test_a_payment_is_201_and_a_repeat_gets_the_same_run_and_result",
    "test_the_same_key_with_another_body_is_409_and_the_first_body_still_gets_its_answer",
    "test_no_key_or_a_bad_body_is_400_and_starts_nothing",
    "test_a_declined_payment_is_402_and_stays_so_for_its_key",
    "test_a_slow_payment_is_202_and_a_repeat_after_it_completed_is_201_with_the_same_run",
    "test_two_requests_racing_with_one_key_make_one_run_and_both_name_it",
    "test_two_requests_racing_with_one_key_and_two_bodies_one_run_and_the_other_is_409",
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


def shop_env(database: str, queue: str, broker: str, **extra: str) -> dict[str, str]:
    """The shop's environment on ``database`` (the suite's PostgreSQL), ``queue`` and ``broker``."""
    where = urlsplit(PG_HOST)
    return clean_env(
        PYTHONPATH=str(ROOT),  # this checkout's durable_celery
        SHOP_DB_NAME=database,
        SHOP_DB_HOST=where.hostname or "127.0.0.1",
        SHOP_DB_PORT=str(where.port or 5432),
        SHOP_DB_USER=unquote(where.username or "postgres"),
        SHOP_DB_PASSWORD=unquote(where.password or ""),
        SHOP_BROKER_URL=broker,
        SHOP_QUEUE=queue,
        **extra,
    )


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_the_django_shop_passes_its_tests_under_manage_py_test(
    shop_database: str, shop_queue: str, redis_server: str
) -> None:
    env = shop_env(shop_database, shop_queue, redis_server)
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


# The test's settings: the shop's own, with the app that holds ``ship``, and durable's timings
# short: a lock is stale after SHOP_STALE_LOCK_TIMEOUT (4) seconds without a heartbeat, looked for
# every 0.5 s. The shop's are read from their file: importing shop_project.settings imports the
# package first, whose DjangoDurable reads Django's settings (these, half made by then).
SETTINGS = f"""
import os
import runpy

shop = runpy.run_path({str(SHOP / "shop_project" / "settings.py")!r})
globals().update((name, value) for name, value in shop.items() if name.isupper())
INSTALLED_APPS = [*INSTALLED_APPS, "hold_ship.HoldShipConfig"]
CELERY_DURABLE_HEARTBEAT_INTERVAL = 0.5
CELERY_DURABLE_STALE_LOCK_TIMEOUT = float(os.environ.get("SHOP_STALE_LOCK_TIMEOUT", "4"))
CELERY_DURABLE_SWEEP_INTERVAL = 0.5
CELERY_DURABLE_POLL_INTERVAL = 0.2
"""

# A Django app for this test only. Its receiver runs inside ``ship``'s transaction, right after
# the shipment's INSERT: each try leaves ``inside-<n>`` (its process id, written whole), and the
# first one then stays there, its transaction open and busy (an idle one would be ended by
# PostgreSQL after stale_lock_timeout), until it is killed, or fails after 60 s.
HOLD_APP = """
import os
import time
from pathlib import Path

from django.apps import AppConfig
from django.db import connection
from django.db.models.signals import post_save


def hold_the_first_try(sender, instance, created, **kwargs):
    marks = Path(os.environ["SHOP_MARKS"])
    tries = len(list(marks.glob("inside-*"))) + 1
    (marks / "writing").write_text(str(os.getpid()))
    (marks / "writing").rename(marks / f"inside-{tries}")
    deadline = time.monotonic() + 60
    while tries == 1 and time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        time.sleep(0.2)
    if tries == 1:
        raise RuntimeError("ship was held 60 s and nobody killed it")


class HoldShipConfig(AppConfig):
    name = "hold_ship"

    def ready(self):
        post_save.connect(hold_the_first_try, sender="orders.Shipment", weak=False)
"""

# Places an order as a customer would (Django's test client on the shop's URLs: the view's
# request commits), waits until its first message is sent, and prints the order and its run.
PLACE_ORDER = """
import json
from django.test import Client
from shop_project.celery import durable

response = Client().post("/orders/", {"item": "mug", "quantity": "2", "payment_token": "tok_visa"})
assert response.status_code == 201, response.content
assert durable.flush(timeout=10), "the run's first message was not sent within 10 s"
print(json.dumps(response.json()))
"""

# Whether a transaction not yet committed has written to the shipments table: PostgreSQL keeps
# the writer's RowExclusiveLock on it until the transaction ends.
SHIPMENT_WRITERS = """
SELECT count(*) FROM pg_locks JOIN pg_class ON pg_class.oid = pg_locks.relation
WHERE pg_locks.database = (SELECT oid FROM pg_database WHERE datname = current_database())
AND pg_class.relname = 'orders_shipment' AND pg_locks.mode = 'RowExclusiveLock'
"""


class HeldShop:
    """The shop with ``hold_ship`` on this test's database and queue: ``manage.py`` commands and
    ``celery -A shop_project worker`` processes (prefork, one pool process), each worker in a
    process group of its own; and a Durable of the test's to read the runs."""

    def __init__(self, tmp_path: Path, env: dict[str, str], database: str) -> None:
        self.folder, self.env, self.database = tmp_path, env, database
        self.marks = tmp_path / "marks"
        self.workers: list[subprocess.Popen[bytes]] = []
        app = Celery("shop-test", broker="memory://", set_as_current=False)
        self.durable = Durable(app, f"{PG_HOST}/{database}", upkeep=False)

    def manage(self, *args: str) -> str:
        """What ``python manage.py <args>`` printed; fails the test if it fails."""
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=SHOP,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"manage.py {args[0]} exited {done.returncode}:\n{done.stderr}"
        return done.stdout

    def worker(self, name: str, stale_lock_timeout: float) -> subprocess.Popen[bytes]:
        """A worker named ``name``, its output in ``<name>.log``."""
        command = [sys.executable, "-m", "celery", "-A", "shop_project", "worker", "-P", "prefork", "-c", "1"]
        command += ["-Q", self.env["SHOP_QUEUE"], "-n", f"{name}@%h", "-l", "info"]
        command += ["--without-mingle", "--without-gossip"]
        env = {**self.env, "SHOP_STALE_LOCK_TIMEOUT": str(stale_lock_timeout)}
        with (self.folder / f"{name}.log").open("w") as log:
            process = subprocess.Popen(
                command, cwd=SHOP, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.workers.append(process)
        return process

    def logs(self) -> str:
        """Every worker's output, for a failure's message."""
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in sorted(self.folder.glob("*.log")))

    def sql(self, query: str) -> Any:
        """The first column of the first row ``query`` returns on the shop's database."""
        with psycopg.connect(f"{PG_HOST}/{self.database}", connect_timeout=5) as conn:
            row = conn.execute(query).fetchone()
            return row[0] if row else None

    def inside(self, n: int) -> int:
        """The process id that ``ship``'s ``n``-th try left, 0 while there is none."""
        try:
            return int((self.marks / f"inside-{n}").read_text())
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        """Kill whatever is left of the workers; close the test's Durable."""
        for process in self.workers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.durable.db.dispose()


@pytest.fixture
def held_shop(shop_database: str, shop_queue: str, redis_server: str, tmp_path: Path) -> Iterator[HeldShop]:
    """The shop with ``hold_ship``, migrated, on a database and queue of this test's."""
    (tmp_path / "hold_ship").mkdir()
    (tmp_path / "hold_ship" / "__init__.py").write_text(HOLD_APP)
    (tmp_path / "hold_settings.py").write_text(SETTINGS)
    (tmp_path / "marks").mkdir()
    env = shop_env(shop_database, shop_queue, redis_server, SHOP_MARKS=str(tmp_path / "marks"))
    env |= {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "DJANGO_SETTINGS_MODULE": "hold_settings"}
    shop = HeldShop(tmp_path, env, shop_database)
    try:
        shop.manage("migrate", "--noinput")
        yield shop
    finally:
        shop.close()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(180)
@pytest.mark.parametrize("killed", ["worker", "pool_process"])
def test_a_worker_killed_inside_the_atomic_ship_step_leaves_the_order_shipped_once(
    held_shop: HeldShop, killed: str
) -> None:
    """SIGKILL after ``ship`` wrote its shipment, before its commit: of the whole worker (a new
    worker takes the run over once its lock is stale) or of its pool process only (the worker
    sees it die and tries ``ship`` again). Either way: one shipment, the order shipped once."""
    shop = held_shop
    # Killing the pool process alone, the worker's own sweep must not take the run over first:
    # Celery may take seconds to report a pool process that died just after its task began.
    first = shop.worker("first", stale_lock_timeout=4.0 if killed == "worker" else 300.0)
    placed = json.loads(shop.manage("shell", "-v", "0", "-c", PLACE_ORDER))
    order, run_id = placed["order"], placed["run"]

    # Inside ship's first try: its shipment is written and not committed, so no one else sees it.
    pid = until(lambda: shop.inside(1), 60, "ship's first try to write its shipment", shop.logs)
    assert pid != first.pid and _alive(pid)  # a pool process, not the worker's main process
    assert shop.sql(SHIPMENT_WRITERS) == 1
    assert shop.sql("SELECT count(*) FROM orders_shipment") == 0

    if killed == "worker":  # the whole worker at once, its pool process too: a lost machine
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
    else:  # what the OOM killer does to a pool process
        os.kill(pid, signal.SIGKILL)
    until(lambda: not _alive(pid), 10, f"pool process {pid} to end", shop.logs)
    # PostgreSQL rolled the try back when its connection went: the writer's lock went with it.
    until(lambda: shop.sql(SHIPMENT_WRITERS) == 0, 10, "the try to be rolled back", shop.logs)
    assert shop.sql("SELECT count(*) FROM orders_shipment") == 0
    assert shop.sql(f"SELECT fulfilled FROM orders_order WHERE id = {order}") is False

    if killed == "worker":
        assert shop.durable.get_run(run_id).status == "running"  # its lock is left behind
        second = shop.worker("second", stale_lock_timeout=4.0)
    else:
        second = first  # the worker lives on, with a new pool process
    run = wait_for(shop.durable, run_id, timeout=60)
    second.send_signal(signal.SIGTERM)  # a warm shutdown: it stops clean
    assert second.wait(30) == 0, shop.logs()

    assert run.status == "completed", (run.error, shop.logs())
    shipped = {"tracking": f"TRK-{order}", "capture": f"CAP-{order}"}
    assert run.output == {"order": order, "picked": "2 x mug", **shipped}
    assert shop.inside(2) not in (0, pid) and shop.inside(3) == 0  # ship ran twice, in two processes
    assert shop.sql("SELECT count(*) FROM orders_shipment") == 1
    assert shop.sql(f"SELECT count(*) FROM orders_shipment WHERE order_id = {order}") == 1
    assert shop.sql(f"SELECT fulfilled FROM orders_order WHERE id = {order}") is True
    steps = shop.durable.list_steps(run_id)
    tries = [(step.name, step.attempt, step.status) for step in steps]
    if killed == "worker":  # taken over after the stale lock, without using an attempt
        assert tries == [("pick", 1, "completed"), ("ship", 1, "completed")]
        (recovered,) = shop.durable.activity(kinds=["stale_recovered"], run_id=run_id)
        assert recovered.details["losses"] == 1 and not recovered.details["failed"]
    else:  # the worker saw its pool process die: that try failed, the next one shipped
        assert tries == [("pick", 1, "completed"), ("ship", 1, "failed"), ("ship", 2, "completed")]
        lost = steps[1].error or {}
        assert lost.get("type") == "WorkerLost" and str(pid) in lost.get("message", ""), lost
