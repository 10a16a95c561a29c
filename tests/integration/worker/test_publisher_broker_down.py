"""A producer while the broker is away (publisher.py, relay.py): ``start()`` and ``retry()``
never wait for a broker connection, whether the broker refuses connections or takes them and
never answers; a process that exits flags what it could not send within about a second; and a
relay pass after a reconnect re-sends at once the runs whose message the broker cannot hold.
PostgreSQL and Redis (a queue of each test's own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import select

from durable_celery import Durable
from durable_celery.store.schema import runs
from durable_celery.worker.relay import relay_once, resend_lost
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.timeout(90)]

LOOSE = 0.5  # the longest a start (or a retry) may take with the broker away; it takes ~1 ms


@pytest.fixture
def refusing() -> Iterator[str]:
    """A broker URL whose port refuses connections (Redis is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free again once closed: nothing listens there
    yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture
def silent() -> Iterator[str]:
    """A broker URL whose port takes connections and never answers (a hung broker)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # the kernel completes the handshakes; nothing ever reads
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


def make(url: str, broker: str, queue: str, **settings) -> Durable:
    app = Celery(f"down-{uuid.uuid4().hex[:6]}", broker=broker)
    app.conf.task_default_queue = queue
    durable = Durable(app, url, **{"upkeep": False, "relay_after": 120.0, **settings})
    durable.workflow("ship").step(lambda order: order, name="pack")
    return durable


def published(durable: Durable, run_ids: list[str]) -> list[bool]:
    with durable.db.engine.connect() as conn:
        rows = conn.execute(select(runs.c.id, runs.c.published).where(runs.c.id.in_(run_ids))).all()
    return [flag for _, flag in sorted(rows, key=lambda row: run_ids.index(row[0]))]


def timed_starts(durable: Durable, count: int) -> tuple[list[str], list[float]]:
    run_ids, took = [], []
    for n in range(count):
        began = time.monotonic()
        run_ids.append(durable.start("ship", {"order": n}))
        took.append(time.monotonic() - began)
    return run_ids, took


@pytest.mark.parametrize("broker", ["refusing", "silent"])
def test_a_start_returns_at_once_whatever_the_brokers_state(pg_url, broker, request):
    durable = make(pg_url, request.getfixturevalue(broker), f"down-{uuid.uuid4().hex[:8]}")
    durable.list_runs(limit=1)  # the database pool's first connection is not the broker's
    run_ids, took = timed_starts(durable, 20)
    print(
        f"\nstart() with the broker {broker}: max {max(took) * 1000:.1f} ms, "
        f"mean {sum(took) / 20 * 1000:.2f} ms"
    )
    assert max(took) < LOOSE, took
    if broker == "refusing":  # each batch gets its retries, then its runs are flagged for the relay
        began = time.monotonic()
        assert durable.flush(timeout=10)
        assert time.monotonic() - began < 3
        assert published(durable, run_ids) == [False] * 20
    durable.db.dispose()


def test_a_silent_broker_holds_the_publisher_a_few_seconds_not_for_ever(pg_url, silent):
    durable = make(pg_url, silent, f"down-{uuid.uuid4().hex[:8]}", publish_retries=0)
    run_ids = [durable.start("ship", {"order": n}) for n in range(3)]
    began = time.monotonic()
    assert durable.flush(timeout=30)  # the socket timeout (5 s) ends the one try
    print(f"\nflush with the broker silent: {time.monotonic() - began:.1f} s")
    assert published(durable, run_ids) == [False] * 3
    durable.db.dispose()


def test_a_retry_returns_at_once_with_the_broker_silent(pg_url, silent):
    queue = f"down-{uuid.uuid4().hex[:8]}"
    eager = Celery(f"eager-{uuid.uuid4().hex[:6]}", broker="memory://")
    eager.conf.task_always_eager = True
    failing = Durable(eager, pg_url, upkeep=False)

    def pack(order):
        raise RuntimeError("out of boxes")

    failing.workflow("ship").step(pack, name="pack")
    run_id = failing.start("ship", {"order": 1})
    assert failing.get_run(run_id).status == "failed"
    durable = make(pg_url, silent, queue)
    began = time.monotonic()
    durable.retry(run_id, by="test", origin="api")
    assert time.monotonic() - began < LOOSE
    assert durable.get_run(run_id).status in ("pending", "running")
    failing.db.dispose()
    durable.db.dispose()


EXITING = """
import os, sys, time
from celery import Celery
from durable_celery import Durable

app = Celery("exiting", broker=os.environ["BROKER"])
app.conf.task_default_queue = os.environ["QUEUE"]
durable = Durable(app, os.environ["DB"], upkeep=False)
durable.workflow("ship").step(lambda order: order, name="pack")
ids = [durable.start("ship", {"order": n}) for n in range(20)]
print(*ids, flush=True)
print(time.time(), flush=True)
"""


def test_a_process_exiting_with_a_silent_broker_flags_its_runs_within_a_second_or_two(pg_url, silent):
    env = {**os.environ, "BROKER": silent, "QUEUE": f"down-{uuid.uuid4().hex[:8]}", "DB": pg_url}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXITING)], env=env, capture_output=True, text=True, timeout=60
    )
    exited = time.time()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    run_ids, last_line = lines[0].split(), float(lines[1])
    print(f"\nexit with the broker silent: {exited - last_line:.2f} s")
    assert exited - last_line < 2.5
    durable = make(pg_url, silent, env["QUEUE"])
    assert published(durable, run_ids) == [False] * 20  # the relay sends them, at its next pass
    durable.db.dispose()


def test_after_a_reconnect_the_relay_resends_at_once_what_the_queue_cannot_hold(pg_url, redis_client):
    queue = f"down-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, REDIS_URL, queue)
    run_ids = [durable.start("ship", {"order": n}) for n in range(6)]
    assert durable.flush(timeout=10)
    assert redis_client.llen(queue) == 6 and published(durable, run_ids) == [True] * 6
    redis_client.ltrim(queue, 0, 1)  # the broker lost four of them (a restart, say)
    rt, app = durable.runtime, durable.app
    assert relay_once(rt, app) == 0  # a plain pass waits relay_after (120 s) before any re-send
    assert resend_lost(rt, app) == 4  # as many as the queue holds fewer than its sent, unclaimed runs
    assert redis_client.llen(queue) == 6
    assert resend_lost(rt, app) == 0  # the queue holds one per run again: nothing more
    assert redis_client.llen(queue) == 6
    redis_client.delete(queue)
    durable.db.dispose()


def test_the_second_pass_after_a_reconnect_resends_what_the_first_still_saw_in_flight(
    pg_url, redis_client, monkeypatch
):
    """A message a consumer had taken when the broker went counts at the first pass, and is
    gone by the next: the pass a few seconds later re-sends it."""
    from durable_celery.worker import broker_reconnect

    queue = f"down-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, REDIS_URL, queue, upkeep=True)  # upkeep: this app's workers relay
    run_ids = [durable.start("ship", {"order": n}) for n in range(3)]
    assert durable.flush(timeout=10) and redis_client.llen(queue) == 3
    sent: list[int] = []

    def resend(rt, app):
        sent.append(broker_reconnect.resend_lost.__wrapped__(rt, app))
        if len(sent) == 1:  # between the passes, the messages turn out lost
            redis_client.delete(queue)
        return sent[-1]

    resend.__wrapped__ = resend_lost  # type: ignore[attr-defined]
    monkeypatch.setattr(broker_reconnect, "resend_lost", resend)
    monkeypatch.setattr(broker_reconnect, "RECONNECT_PASSES", (0.0, 0.2))
    thread = broker_reconnect.relay_after_reconnect(durable.app)
    assert thread is not None
    thread.join(20)
    assert sent == [0, 3] and redis_client.llen(queue) == 3
    assert published(durable, run_ids) == [True] * 3
    redis_client.delete(queue)
    durable.db.dispose()


def test_a_pass_after_a_reconnect_stops_at_a_batch_it_could_not_send_from(pg_url, redis_client, monkeypatch):
    from durable_celery.store import queries
    from durable_celery.worker import relay

    queue = f"down-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, REDIS_URL, queue)
    run_ids = [durable.start("ship", {"order": n}) for n in range(5)]
    assert durable.flush(timeout=10) and redis_client.llen(queue) == 5  # every message is queued
    monkeypatch.setattr(relay, "RELAY_BATCH", 2)
    taken: list[int] = []
    real = queries.take_due_runs_txn

    def counted(*args):
        rows = real(*args)
        taken.append(len(rows))
        return rows

    monkeypatch.setattr(queries, "take_due_runs_txn", counted)
    assert resend_lost(durable.runtime, durable.app) == 0  # nothing to re-send, and it ends
    # One batch (the rows it left as they were would come back in every batch), taken twice:
    # the first take meets re-sends due and is given back while the queue's budget is read.
    assert taken == [2, 2]
    assert published(durable, run_ids) == [True] * 5 and redis_client.llen(queue) == 5
    redis_client.delete(queue)
    durable.db.dispose()
