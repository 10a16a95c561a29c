"""The outbox on RabbitMQ, in this process: publisher confirms (a message the broker did not
confirm leaves its run flagged for the relay), the relay's re-send budget read from RabbitMQ's
queue depths, and what a producer says about a vhost that does not exist. PostgreSQL and the
machine's RabbitMQ, in the session's vhost; fails (never skips) without them."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import insert

from durable_celery import Durable
from durable_celery.store.db import utcnow
from durable_celery.store.schema import nodes
from durable_celery.worker.relay import BrokerDown, broker_depths, relay_once
from tests.conftest import AMQP_HOST, FAST, rabbitmqctl
from tests.integration.helpers import ago, run_row, set_run

pytestmark = [pytest.mark.timeout(90)]


def make(pg_url: str, broker: str, queue: str, **settings) -> Durable:
    app = Celery("rabbit", broker=broker)
    app.conf.task_default_queue = queue
    app.conf.broker_connection_timeout = 2
    durable = Durable(app, pg_url, **{**FAST, **settings})
    durable.workflow("ship").step(lambda order: order, name="pack")
    return durable


def depth(durable: Durable, queue: str) -> int:
    """Messages RabbitMQ holds in ``queue`` (0 when it has no such queue)."""
    depths = broker_depths(durable.app, [queue])
    assert depths is not None, "RabbitMQ did not answer"
    return depths[queue]


def drop_messages(durable: Durable, queue: str) -> None:
    """What a broker that lost its messages looks like: the queue emptied."""
    with durable.app.connection_for_write() as conn, conn.channel() as channel:
        channel.queue_purge(queue)


@pytest.fixture
def full_queues(rabbitmq: str) -> Iterator[str]:
    """A prefix whose queues hold nothing: a policy of ``max-length`` 0 with ``reject-publish``
    on this session's vhost, so the broker nacks every message published to them."""
    vhost = rabbitmq.rsplit("/", 1)[1]
    prefix, policy = f"full-{uuid.uuid4().hex[:8]}-", f"full-{uuid.uuid4().hex[:8]}"
    definition = '{"max-length": 0, "overflow": "reject-publish"}'
    rabbitmqctl("set_policy", "-p", vhost, "--apply-to", "queues", policy, f"^{prefix}", definition)
    yield prefix
    rabbitmqctl("clear_policy", "-p", vhost, policy)


@pytest.mark.parametrize("background", [True, False], ids=["send_soon", "send_now"])
def test_a_message_the_broker_nacked_leaves_its_run_flagged_for_the_relay(
    pg_url, rabbitmq, full_queues, background
):
    durable = make(pg_url, rabbitmq, f"{full_queues}ship", publish_in_background=background)
    try:
        run_id = durable.start("ship", {"order": 1})
        assert durable.flush(timeout=30)
        row = run_row(durable, run_id)
        assert row.published is False and row.due_at is not None  # the relay's to send
        with pytest.raises(BrokerDown):  # the relay's send is refused the same way
            relay_once(durable.runtime, durable.app)
        assert run_row(durable, run_id).published is False
    finally:
        durable.db.dispose()


def test_a_confirmed_message_counts_as_sent_and_confirms_can_be_turned_off(pg_url, rabbitmq, full_queues):
    queue = f"ok-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, rabbitmq, queue)
    unconfirmed = make(pg_url, rabbitmq, f"{full_queues}ship")
    unconfirmed.app.conf.broker_transport_options = {"confirm_publish": False}
    try:
        run_id = durable.start("ship", {"order": 1})
        assert durable.flush(timeout=30) and run_row(durable, run_id).published is True
        assert depth(durable, queue) == 1
        # Confirms off (the app's own choice): the broker drops the message unseen, the run
        # stays marked sent and waits for relay_after.
        lost = unconfirmed.start("ship", {"order": 2})
        assert unconfirmed.flush(timeout=30) and run_row(unconfirmed, lost).published is True
    finally:
        with durable.app.connection_for_write() as conn, conn.channel() as channel:
            channel.queue_delete(queue)
        durable.db.dispose()
        unconfirmed.db.dispose()


def test_the_relay_resends_only_what_the_rabbitmq_queue_no_longer_holds(pg_url, rabbitmq):
    queue = f"relay-{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, rabbitmq, queue, relay_after=30)
    with durable.db.begin() as conn:  # a live worker node consumes the queue
        conn.execute(
            insert(nodes).values(
                name="celery@box", queues=[queue], pid=1, started_at=utcnow(), seen_at=utcnow()
            )
        )
    try:
        assert depth(durable, "no-such-queue") == 0  # a queue RabbitMQ lacks holds nothing
        first, second = durable.start("ship", {"order": 1}), durable.start("ship", {"order": 2})
        assert durable.flush(timeout=30) and depth(durable, queue) == 2
        for run_id in (first, second):
            set_run(durable, run_id, due_at=ago(durable, 60))  # unclaimed for relay_after
        assert relay_once(durable.runtime, durable.app) == 0  # both messages still wait there
        assert depth(durable, queue) == 2

        drop_messages(durable, queue)  # the broker lost them
        for run_id in (first, second):
            set_run(durable, run_id, resend_at=ago(durable, 1))
        assert relay_once(durable.runtime, durable.app) == 2 and depth(durable, queue) == 2
        assert {run_row(durable, r).resends for r in (first, second)} == {1}

        with durable.app.connection_for_write() as conn, conn.channel() as channel:
            channel.basic_get(queue, no_ack=True)  # one of the two taken away: one re-send due
        for run_id in (first, second):
            set_run(durable, run_id, resend_at=ago(durable, 1))
        assert relay_once(durable.runtime, durable.app) == 1 and depth(durable, queue) == 2
    finally:
        with durable.app.connection_for_write() as conn, conn.channel() as channel:
            channel.queue_delete(queue)
        durable.db.dispose()


def test_a_producer_on_a_vhost_that_does_not_exist_flags_its_runs_and_says_why(pg_url, rabbitmq, caplog):
    missing = f"durable_missing_{uuid.uuid4().hex[:8]}"
    durable = make(pg_url, f"amqp://guest:guest@{AMQP_HOST}/{missing}", "ship", publish_retries=0)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="durable_celery"):
            run_id = durable.start("ship", {"order": 1})
            assert durable.flush(timeout=30)
        assert time.monotonic() - started < 10
        assert run_row(durable, run_id).published is False
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert said and f"NOT_ALLOWED - vhost {missing} not found" in said[0], caplog.text
    finally:
        durable.db.dispose()
