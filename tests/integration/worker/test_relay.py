"""The relay under trouble: re-sends that do not compound, and a broker outage that ties up
neither the relay nor the sweeps (PostgreSQL, on each of BROKERS: Redis and RabbitMQ); then the
relay's statements exactly (which runs a pass sends or sends again, and when; batches; runs
another relay holds), on both backends where they can run there."""

from __future__ import annotations

import time
import types
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, insert, select, update

from durable_celery import Durable
from durable_celery.models import aware
from durable_celery.store import queries
from durable_celery.store.db import utcnow
from durable_celery.store.schema import nodes, runs
from durable_celery.worker.relay import BrokerDown, relay_once
from durable_celery.worker.upkeep import Upkeep
from tests.conftest import BROKERS, DEAD_BROKERS, FAST
from tests.integration.helpers import (
    Steps,
    ago,
    delete_queue,
    drop_messages,
    one_step,
    queue_depth,
    run_row,
    set_run,
)

pytestmark = [pytest.mark.timeout(90)]


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


@pytest.mark.parametrize("backend", BROKERS)
def test_a_lost_message_is_sent_again_at_doubling_intervals_and_never_beside_its_queued_copy(
    pg_url, broker_url
):
    queue = f"relay-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, broker_url, queue, relay_after=0.5)
    app = durable.app
    live_node(durable, [queue])
    run_id = durable.start("ship", {"order": 1})
    assert durable.flush(timeout=10)  # the message left from the background publisher
    due_at = relay_state(durable, run_id).due_at
    assert queue_depth(app, queue) == 1
    assert relay_once(durable.runtime, durable.app) == 0  # not relay_after old yet
    time.sleep(0.6)
    # Its message still waits in the queue (a backlog): nothing is re-sent, the relay looks later.
    assert relay_once(durable.runtime, durable.app) == 0 and queue_depth(app, queue) == 1
    looked = relay_state(durable, run_id)
    assert looked.resends == 0 and looked.resend_at is not None and looked.due_at == due_at

    drop_messages(app, queue)  # the broker lost it
    wait_past(durable, looked.resend_at)
    before = db_now(durable)
    assert relay_once(durable.runtime, durable.app) == 1 and queue_depth(app, queue) == 1
    after = db_now(durable)
    sent = relay_state(durable, run_id)
    assert sent.resends == 1 and sent.due_at == due_at  # the run's age still counts from its due time
    # The next re-send waits twice as long: 1 s from this one, on the database's clock.
    assert before + timedelta(seconds=1) <= sent.resend_at <= after + timedelta(seconds=1)

    drop_messages(app, queue)
    assert relay_once(durable.runtime, durable.app) == 0  # lost again, but not due again yet
    wait_past(durable, sent.resend_at)
    before = db_now(durable)
    assert relay_once(durable.runtime, durable.app) == 1 and relay_state(durable, run_id).resends == 2
    after = db_now(durable)
    third = relay_state(durable, run_id)
    assert before + timedelta(seconds=2) <= third.resend_at <= after + timedelta(seconds=2)  # then 2 s

    # A queue no live worker consumes gets nothing again: its message waits there for one.
    with durable.db.begin() as conn:
        conn.execute(update(nodes).values(queues=["elsewhere"]))
    drop_messages(app, queue)
    time.sleep(2.2)
    assert relay_once(durable.runtime, durable.app) == 0 and queue_depth(app, queue) == 0
    assert durable.status_summary()["oldest_ready_seconds"] >= 4.0  # due since the start
    delete_queue(app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_a_relay_pass_stops_at_the_first_refused_message(pg_url, backend):
    durable = make(pg_url, DEAD_BROKERS[backend], "relay-down", publish_retries=0)
    ids = [durable.start("ship", {"order": n}) for n in range(30)]
    assert durable.flush(timeout=10)  # each publish failed: the runs are flagged for the relay
    assert not any(relay_state(durable, i).published for i in ids)
    began = time.monotonic()
    with pytest.raises(BrokerDown):
        relay_once(durable.runtime, durable.app)
    assert time.monotonic() - began < 5  # one refused message, not thirty
    assert not any(relay_state(durable, i).published for i in ids)  # all left for the next pass
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_a_probe_pass_during_an_outage_writes_one_row_not_a_batch(pg_url, backend):
    """After a refusal the relay probes with one run: a pass of an outage takes one row and
    flags it back, where a full pass takes a batch and flags it all back."""
    from sqlalchemy import event

    durable = make(pg_url, DEAD_BROKERS[backend], "relay-probe", publish_retries=0)
    ids = [durable.start("ship", {"order": n}) for n in range(30)]
    assert durable.flush(timeout=10)
    updated: list[int] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("UPDATE"):
            updated.append(cursor.rowcount)

    event.listen(durable.db.engine, "after_cursor_execute", count)
    try:
        with pytest.raises(BrokerDown):
            relay_once(durable.runtime, durable.app, probe=True)
        assert sum(updated) == 2  # the probe's run taken, then flagged unsent again
        updated.clear()
        with pytest.raises(BrokerDown):
            relay_once(durable.runtime, durable.app)
        assert sum(updated) == 60  # every due run taken, then flagged unsent again
    finally:
        event.remove(durable.db.engine, "after_cursor_execute", count)
    assert not any(relay_state(durable, i).published for i in ids)
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_a_probe_that_goes_through_sends_the_rest_in_the_same_pass(pg_url, broker_url):
    queue = f"relay-probe-ok-{uuid.uuid4().hex[:6]}"
    durable = make(pg_url, broker_url, queue, publish_in_background=False)
    ids = [durable.start("ship", {"order": n}) for n in range(7)]
    with durable.db.begin() as conn:
        conn.execute(update(runs).where(runs.c.id.in_(ids)).values(published=False))
    assert relay_once(durable.runtime, durable.app, probe=True) == 7
    assert all(relay_state(durable, i).published for i in ids)
    assert queue_depth(durable.app, queue) == 14  # each run's first message, then the relay's
    delete_queue(durable.app, queue)
    durable.db.dispose()


@pytest.mark.parametrize("backend", BROKERS)
def test_a_broker_outage_starves_neither_the_sweep_nor_the_node_heartbeat(pg_url, backend):
    # Default publish retries: each refused publish blocks about a second, as in production.
    durable = make(pg_url, DEAD_BROKERS[backend], "relay-outage", sweep_interval=0.5, stale_lock_timeout=2.0)
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
    upkeep = Upkeep(
        durable.runtime, durable.engine, durable.app, types.SimpleNamespace(hostname="outage@test")
    )
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


# -- the relay's statements, exactly, on both backends ------------------------------------------


def test_a_start_on_a_bare_connection_flags_only_its_own_run_for_the_relay(durable):
    """Guards mutants of durable_celery/store/queries.py (the relay's statements) that the tests
    above let through.

    Its message waits for the relay (the commit is the caller's); runs already sent stay sent."""
    steps = Steps(durable)
    sent = durable.start(steps.wf)
    assert run_row(durable, sent).published is True
    with durable.db.engine.begin() as conn:
        flagged = durable.start(steps.wf, connection=conn)
    assert run_row(durable, flagged).published is False
    assert run_row(durable, sent).published is True


@pytest.mark.parametrize("backend", BROKERS)  # the broker's queue depth: Redis, RabbitMQ
def test_a_lost_message_is_sent_again_only_relay_after_its_run_became_due(make_durable):
    """Guards mutants of durable_celery/store/queries.py (the relay's statements) that the tests
    above let through."""
    from durable_celery.worker.relay import relay_once

    durable = make_durable(relay_after=30)
    one_step(durable, "shipped")
    app, queue = durable.app, durable.app.conf.task_default_queue
    run_id = durable.start("shipped")
    assert durable.flush(timeout=10) and queue_depth(app, queue) == 1
    drop_messages(app, queue)  # lost at once
    try:
        assert relay_once(durable.runtime, app) == 0 and queue_depth(app, queue) == 0  # too soon to tell
        set_run(durable, run_id, due_at=ago(durable, 31))
        assert relay_once(durable.runtime, app) == 1 and queue_depth(app, queue) == 1
        assert run_row(durable, run_id).resends == 1
    finally:
        delete_queue(app, queue)


@pytest.mark.parametrize("backend", BROKERS)  # the broker's queue depth: Redis, RabbitMQ
def test_only_sent_unclaimed_runs_of_this_build_count_against_the_messages_queued(make_durable):
    """Guards mutants of durable_celery/store/queries.py (the relay's statements) that the tests
    above let through.

    A queue's runs re-sent are at most its sent, unclaimed, unfinished runs of the workflows
    this build knows, less the messages the broker holds: a run never sent (sent anyway), a
    finished one, or another build's run whose message was lost (that build's relay's to send
    again) must not get a re-send beside a message still queued."""
    from durable_celery.worker.relay import relay_once

    ours = make_durable("ours", relay_after=0.5)
    one_step(ours, "shipped")
    theirs = make_durable("theirs", relay_after=0.5)
    one_step(theirs, "not_ours")
    app, queue = ours.app, ours.app.conf.task_default_queue
    lost = theirs.start("not_ours")
    ended = ours.start("shipped")
    assert theirs.flush(timeout=10) and ours.flush(timeout=10)
    drop_messages(app, queue)  # the broker lost both messages
    set_run(ours, ended, status="cancelled", finished_at=ours.db.utcnow())  # its due_at left behind
    with ours.db.engine.begin() as conn:
        unsent = ours.start("shipped", connection=conn)  # flagged for the relay
    queued = ours.start("shipped")
    assert ours.flush(timeout=10) and queue_depth(app, queue) == 1
    for run_id in (lost, ended, unsent, queued):  # due long enough to be looked at again
        set_run(ours, run_id, due_at=ago(ours, 60))
    try:
        assert relay_once(ours.runtime, ours.app) == 1  # the unsent run's message
        assert queue_depth(app, queue) == 2
        assert (run_row(ours, unsent).published, run_row(ours, unsent).resends) == (True, 0)
        assert run_row(ours, queued).resends == 0 and run_row(ours, queued).resend_at is not None
        assert run_row(ours, lost).resend_at is None and run_row(ours, ended).resend_at is None  # not taken
    finally:
        delete_queue(app, queue)


def test_a_debounce_restarted_after_the_relay_sent_its_run_waits_its_whole_period(durable):
    """Guards mutants of durable_celery/store/queries.py (the relay's statements) that the tests
    above let through.

    The relay sent a debounced run that no worker has claimed yet; a later start restarts
    the debounce (due later, unsent again): the relay's earlier mark to look again is no
    reason to send it before the new period ends."""
    from durable_celery.worker.relay import relay_once

    wf = durable.workflow("indexed", debounce={"period": 60, "timeout": 600})
    wf.step(lambda rev: rev, name="index")
    run_id = durable.start(wf, {"rev": 1}, key="article:1")
    set_run(durable, run_id, due_at=ago(durable, 1))  # its first period is over
    assert relay_once(durable.runtime, durable.app) == 1
    sent = run_row(durable, run_id)  # the relay looks again relay_after (30 s) from now
    assert sent.published is True and aware(sent.resend_at) > durable.db.utcnow() + timedelta(seconds=20)
    assert durable.start(wf, {"rev": 2}, key="article:1") == run_id  # debounced: due in 60 s
    set_run(durable, run_id, resend_at=ago(durable, 1))  # the relay's mark came due meanwhile
    assert relay_once(durable.runtime, durable.app) == 0
    row = run_row(durable, run_id)
    assert row.published is False and aware(row.due_at) > durable.db.utcnow() + timedelta(seconds=50)


@pytest.mark.parametrize("backend", ["postgres"])  # SQLite: one writer at a time, no row locks
def test_the_relay_passes_over_a_run_another_relay_holds(durable):
    """Guards mutants of durable_celery/store/queries.py (the relay's statements) that the tests
    above let through.

    Relays on several nodes take due runs ``FOR UPDATE SKIP LOCKED``: a run another node's
    relay holds is left to it, and this pass sends the rest without waiting for that lock."""
    from sqlalchemy import event

    from durable_celery.worker.relay import relay_once

    one_step(durable, "shipped")
    with durable.db.engine.begin() as conn:  # two runs the relay must send
        held, free = (durable.start("shipped", connection=conn) for _ in range(2))

    def bounded(conn, cursor, statement, parameters, context, executemany):
        if "FOR UPDATE" in statement:  # a wait for the other relay's lock fails, never hangs
            cursor.execute("SET LOCAL lock_timeout = '2s'")

    other = durable.db.engine.connect()
    other.begin()
    other.execute(select(runs.c.id).where(runs.c.id == held).with_for_update())
    event.listen(durable.db.engine, "before_cursor_execute", bounded)
    try:
        assert relay_once(durable.runtime, durable.app) == 1
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", bounded)
        other.rollback()
        other.close()
    assert (run_row(durable, free).published, run_row(durable, held).published) == (True, False)


def test_a_relay_pass_takes_its_runs_a_batch_at_a_time(durable, monkeypatch):
    """Guards mutants of durable_celery/store/queries.py (the relay's statements) that the tests
    above let through.

    Each transaction of a pass locks at most ``RELAY_BATCH`` runs; the pass goes on until a
    batch comes back short."""
    from durable_celery.worker import relay

    monkeypatch.setattr(relay, "RELAY_BATCH", 2)
    taken: list[int] = []
    real = queries.take_due_runs_txn

    def counted(*args: Any) -> Any:
        rows = real(*args)
        taken.append(len(rows))
        return rows

    monkeypatch.setattr(queries, "take_due_runs_txn", counted)
    one_step(durable, "shipped")
    with durable.db.engine.begin() as conn:  # five runs the relay must send
        for _ in range(5):
            durable.start("shipped", connection=conn)
    assert relay.relay_once(durable.runtime, durable.app) == 5
    assert taken == [2, 2, 1]


@pytest.mark.parametrize("backend", BROKERS)
def test_a_pass_with_no_re_send_due_reads_no_backlog_count(pg_url, broker_url, monkeypatch):
    """The per-queue count of sent, unclaimed runs reads the whole ready backlog: a pass reads
    it only once it meets a run due for a re-send."""
    from durable_celery.worker import relay

    queue = f"relay-nocount-{uuid.uuid4().hex[:6]}"
    durable = make(pg_url, broker_url, queue, relay_after=60.0)
    run_ids = [durable.start("ship", {"order": n}) for n in range(3)]
    assert durable.flush(timeout=10)
    counted: list[float] = []
    real = relay.queries.relay_candidates

    def counting(db, conn, after, *where):
        counted.append(after)
        return real(db, conn, after, *where)

    monkeypatch.setattr(relay.queries, "relay_candidates", counting)
    assert relay_once(durable.runtime, durable.app) == 0 and counted == []  # sent a moment ago
    with durable.db.begin() as conn:  # became due long ago: a re-send is due now
        conn.execute(update(runs).where(runs.c.id.in_(run_ids)).values(due_at=utcnow() - timedelta(hours=1)))
    assert relay_once(durable.runtime, durable.app) == 0  # all three still wait in the queue
    assert counted == [60.0]
    assert queue_depth(durable.app, queue) == 3
    delete_queue(durable.app, queue)
    durable.db.dispose()
