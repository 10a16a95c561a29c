"""The transactional outbox: a committed start is never lost, whatever the broker did. The tests
of the broker run on each of BROKERS (Redis, RabbitMQ)."""

from __future__ import annotations

import pytest
from celery import Celery

from durable_celery import Durable, RunNotFound
from durable_celery.testing import wait_for, worker
from tests.conftest import BROKERS, DEAD_BROKERS, FAST, REDIS_URL
from tests.integration.helpers import delete_queue, drop_messages, queue_depth

pytestmark = [pytest.mark.timeout(60)]


def define(durable: Durable) -> None:
    wf = durable.workflow("ship")

    @wf.step
    def pack(order):
        return f"packed {order}"

    @wf.step
    def send(order):
        return f"sent {order}"


def make(url: str, broker: str, queue: str, **settings) -> Durable:
    app = Celery("outbox", broker=broker)
    app.conf.task_default_queue = queue
    app.conf.broker_connection_timeout = 1
    durable = Durable(app, url, **{**FAST, **settings})
    define(durable)
    return durable


@pytest.mark.parametrize("backend", BROKERS)
def test_start_while_broker_is_down_completes_once_it_is_back(pg_url, backend, broker_url):
    producer = make(pg_url, DEAD_BROKERS[backend], "outbox-a", publish_retries=0)
    run_id = producer.start("ship", {"order": 42})  # commits; the publish fails
    run = producer.get_run(run_id)
    assert run.status == "pending"
    consumer = make(pg_url, broker_url, "outbox-a")
    with worker(consumer):
        done = wait_for(consumer, run_id, timeout=20)
    assert done.status == "completed" and done.output == "sent 42"
    assert [s.name for s in consumer.list_steps(run_id)] == ["pack", "send"]


@pytest.mark.parametrize("backend", BROKERS)
def test_committed_start_whose_message_was_lost_is_relayed(pg_url, broker_url):
    producer = make(pg_url, broker_url, "outbox-b")
    run_id = producer.start("ship", {"order": 7})
    assert producer.flush(timeout=10)  # the message left from the background publisher
    assert queue_depth(producer.app, "outbox-b") == 1
    drop_messages(producer.app, "outbox-b")  # the broker lost it (a restart without persistence)
    consumer = make(pg_url, broker_url, "outbox-b", relay_after=1.0)
    with worker(consumer):
        done = wait_for(consumer, run_id, timeout=20)
    assert done.status == "completed" and done.output == "sent 7"


@pytest.mark.parametrize("backend", BROKERS)
def test_nothing_is_published_for_a_rolled_back_start(pg_url, broker_url):
    from sqlalchemy import create_engine

    durable = make(pg_url, broker_url, "outbox-c")
    engine = create_engine(durable.db.url)
    with engine.connect() as conn:
        trans = conn.begin()
        run_id = durable.start("ship", {"order": 1}, connection=conn)
        trans.rollback()
    assert durable.flush(timeout=10) and queue_depth(durable.app, "outbox-c") == 0
    with pytest.raises(RunNotFound):
        durable.get_run(run_id)
    engine.dispose()
    delete_queue(durable.app, "outbox-c")


@pytest.mark.parametrize("backend", BROKERS)
def test_start_inside_callers_transaction_runs_after_commit(pg_url, broker_url):
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    durable = make(pg_url, broker_url, "outbox-d")
    engine = create_engine(durable.db.url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id int primary key)"))
    with worker(durable):
        with engine.connect() as conn, conn.begin():
            conn.execute(text("INSERT INTO orders VALUES (1)"))
            in_conn = durable.start("ship", {"order": 1}, connection=conn)
            assert durable.flush(timeout=10)
            assert queue_depth(durable.app, "outbox-d") == 0  # nothing published before commit
            with pytest.raises(RunNotFound):
                durable.get_run(in_conn)
        with Session(engine) as session:
            session.execute(text("INSERT INTO orders VALUES (2)"))
            in_session = durable.start("ship", {"order": 2}, connection=session)
            with pytest.raises(RunNotFound):  # not visible outside the transaction yet
                durable.get_run(in_session)
            session.commit()
        assert wait_for(durable, in_conn).output == "sent 1"
        assert wait_for(durable, in_session).output == "sent 2"
    engine.dispose()


def test_pool_recovers_when_the_server_drops_its_connections(pg_url, redis_client):
    import time

    import psycopg

    from durable_celery.store.db import PING_AFTER_IDLE

    durable = make(pg_url, REDIS_URL, "outbox-e")
    with worker(durable):
        assert wait_for(durable, durable.start("ship", {"order": 1})).status == "completed"
        database = pg_url.rsplit("/", 1)[1]
        with psycopg.connect(pg_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            )
        time.sleep(PING_AFTER_IDLE + 0.5)  # rested connections are checked before use
        run_id = durable.start("ship", {"order": 2})
        assert wait_for(durable, run_id).output == "sent 2"
