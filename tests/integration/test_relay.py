"""The relay under trouble: re-sends that do not compound, and a broker outage that ties up
neither the relay nor the sweeps. PostgreSQL and Redis."""

from __future__ import annotations

import time
import types
import uuid
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import func, insert, select, update

from durable_celery import Durable
from durable_celery.relay import BrokerDown, relay_once
from durable_celery.store import queries
from durable_celery.store.db import utcnow
from durable_celery.store.schema import nodes, runs
from durable_celery.upkeep import Upkeep
from tests.conftest import FAST, REDIS_URL

pytestmark = [pytest.mark.timeout(90)]

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def make(url: str, broker: str, queue: str, **settings) -> Durable:
    app = Celery("relay", broker=broker)
    app.conf.task_default_queue = queue
    app.conf.broker_connection_timeout = 1
    durable = Durable(app, url, **{**FAST, **settings})
    durable.workflow("ship").step(lambda order: order, name="pack")
    return durable


def relay_state(durable: Durable, run_id: str):
    with durable.db.engine.connect() as conn:
        return conn.execute(
            select(runs.c.due_at, runs.c.published, runs.c.resends, runs.c.resend_at).where(
                runs.c.id == run_id
            )
        ).first()


def db_now(durable: Durable):
    with durable.db.engine.connect() as conn:
        return conn.execute(select(func.now())).scalar_one()


def wait_past(durable: Durable, moment) -> None:
    """Sleep until the database's clock has passed ``moment``."""
    while (left := (moment - db_now(durable)).total_seconds()) >= 0:
        time.sleep(left + 0.01)


def _locked_by(durable: Durable, run_id: str):
    with durable.db.engine.connect() as conn:
        return conn.execute(select(runs.c.locked_by).where(runs.c.id == run_id)).scalar()


def live_node(durable: Durable, queues: list[str]) -> None:
    with durable.db.begin() as conn:
        conn.execute(
            insert(nodes).values(
                name="celery@box", queues=queues, pid=1, started_at=utcnow(), seen_at=utcnow()
            )
        )


def test_a_lost_message_is_sent_again_at_doubling_intervals_and_never_beside_its_queued_copy(
    pg_url, redis_client
):
    queue = f"relay-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, REDIS_URL, queue, relay_after=0.5)
    live_node(durable, [queue])
    run_id = durable.start("ship", {"order": 1})
    assert durable.flush(timeout=10)  # the message left from the background publisher
    due_at = relay_state(durable, run_id).due_at
    assert redis_client.llen(queue) == 1
    assert relay_once(durable) == 0  # not relay_after old yet
    time.sleep(0.6)
    # Its message still waits in the queue (a backlog): nothing is re-sent, the relay looks later.
    assert relay_once(durable) == 0 and redis_client.llen(queue) == 1
    looked = relay_state(durable, run_id)
    assert looked.resends == 0 and looked.resend_at is not None and looked.due_at == due_at

    redis_client.delete(queue)  # the broker lost it
    wait_past(durable, looked.resend_at)
    before = db_now(durable)
    assert relay_once(durable) == 1 and redis_client.llen(queue) == 1
    after = db_now(durable)
    sent = relay_state(durable, run_id)
    assert sent.resends == 1 and sent.due_at == due_at  # the run's age still counts from its due time
    # The next re-send waits twice as long: 1 s from this one, on the database's clock.
    assert before + timedelta(seconds=1) <= sent.resend_at <= after + timedelta(seconds=1)

    redis_client.delete(queue)
    assert relay_once(durable) == 0  # lost again, but not due again yet
    wait_past(durable, sent.resend_at)
    before = db_now(durable)
    assert relay_once(durable) == 1 and relay_state(durable, run_id).resends == 2
    after = db_now(durable)
    third = relay_state(durable, run_id)
    assert before + timedelta(seconds=2) <= third.resend_at <= after + timedelta(seconds=2)  # then 2 s

    # A queue no live worker consumes gets nothing again: its message waits there for one.
    with durable.db.begin() as conn:
        conn.execute(update(nodes).values(queues=["elsewhere"]))
    redis_client.delete(queue)
    time.sleep(2.2)
    assert relay_once(durable) == 0 and redis_client.llen(queue) == 0
    assert durable.status_summary()["oldest_ready_seconds"] >= 4.0  # due since the start
    redis_client.delete(queue)
    durable.db.dispose()


def test_a_relay_pass_stops_at_the_first_refused_message(pg_url):
    durable = make(pg_url, DEAD_BROKER, "relay-down", publish_retries=0)
    ids = [durable.start("ship", {"order": n}) for n in range(30)]
    assert durable.flush(timeout=10)  # each publish failed: the runs are flagged for the relay
    assert not any(relay_state(durable, i).published for i in ids)
    began = time.monotonic()
    with pytest.raises(BrokerDown):
        relay_once(durable)
    assert time.monotonic() - began < 5  # one refused message, not thirty
    assert not any(relay_state(durable, i).published for i in ids)  # all left for the next pass
    durable.db.dispose()


def test_a_broker_outage_starves_neither_the_sweep_nor_the_node_heartbeat(pg_url):
    # Default publish retries: each refused publish blocks about a second, as in production.
    durable = make(pg_url, DEAD_BROKER, "relay-outage", sweep_interval=0.5, stale_lock_timeout=2.0)
    rows = [
        {
            "id": str(uuid.uuid4()),
            "workflow": "ship",
            "status": "pending",
            "step_name": "pack",
            "input": {"order": n},
            "context": {},
            "created_at": utcnow(),
            "due_at": utcnow(),
            "published": False,
            "queue": "relay-outage",
        }
        for n in range(600)  # more than one relay batch, each message refused
    ]
    lost_id = durable.start("ship", {"order": -1})
    with durable.db.begin() as conn:
        conn.execute(insert(runs), rows)
    with durable.db.single() as conn:  # a worker claimed a run and vanished an hour ago
        assert queries.claim_run(durable.db, conn, lost_id, 0, "ghost-node:1") is not None
    with durable.db.begin() as conn:
        conn.execute(
            update(runs).where(runs.c.id == lost_id).values(heartbeat_at=utcnow() - timedelta(hours=1))
        )
    upkeep = Upkeep(durable, types.SimpleNamespace(hostname="outage@test"))
    upkeep.start()
    try:
        deadline = time.monotonic() + 20
        while _locked_by(durable, lost_id) is not None:  # handed back: unlocked, for the relay
            assert time.monotonic() < deadline, "the stale lock was not swept during the outage"
            time.sleep(0.1)
        first = {n["name"]: n["seen_at"] for n in durable.list_nodes()}["outage@test"]
        deadline = time.monotonic() + 10
        while {n["name"]: n["seen_at"] for n in durable.list_nodes()}["outage@test"] == first:
            assert time.monotonic() < deadline, "the node's heartbeat stopped during the outage"
            time.sleep(0.1)
    finally:
        upkeep.stop()
        durable.db.dispose()
