"""Guards issue 39: the test kits keep a session's step messages from a developer's worker on the
same broker. On Redis they go under a key prefix of the session's own (a worker outside it never
sees them); on RabbitMQ the kits refuse, naming the queue, while a worker outside the session
consumes one of the Durable's queues. Real PostgreSQL, Redis, RabbitMQ and Celery workers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery import signals as celery_signals

from durable_celery import Durable, NotConfigured
from durable_celery.testing import wait_for, worker
from durable_celery.worker.isolation import SESSION, isolate_durable

pytestmark = [pytest.mark.timeout(120), pytest.mark.postgres, pytest.mark.redis]


def _define(durable: Durable) -> None:
    hello = durable.workflow("hello")

    @hello.step
    def greet(name: str) -> dict[str, str]:
        return {"greeting": f"hello {name}"}


@pytest.fixture
def developers_worker(tmp_path: Any, broker_url: str) -> Iterator[Any]:
    """``start(queue)``: a developer's own worker on the test's broker, consuming ``queue``, on a
    database of its own (what a dev runs beside the tests); its received messages are counted."""
    received: list[str] = []
    started: list[Any] = []

    def start(queue: str) -> list[str]:
        app = Celery(f"dev-{uuid.uuid4().hex[:6]}", broker=broker_url, set_as_current=False)
        app.conf.task_default_queue = queue
        dev = Durable(app, f"sqlite:///{tmp_path}/dev.sqlite3", poll_interval=0.1)
        dev.migrate()
        _define(dev)

        def count(sender: Any = None, request: Any = None, **_: Any) -> None:
            if getattr(sender, "app", None) is app:
                received.append(request.id if request is not None else "?")

        celery_signals.task_received.connect(count, weak=False)
        started.append((count, dev))
        stack = worker(dev)
        stack.__enter__()
        started.append(stack)
        return received

    try:
        yield start
    finally:
        for item in reversed(started):
            if isinstance(item, tuple):
                celery_signals.task_received.disconnect(item[0])
                item[1].db.dispose()
            else:
                item.__exit__(None, None, None)


@pytest.mark.parametrize("backend", ["postgres"])
def test_on_redis_the_sessions_messages_go_where_a_developers_worker_never_looks(
    make_durable: Any, developers_worker: Any, redis_client: Any
) -> None:
    durable = make_durable()
    _define(durable)
    queue = durable.app.conf.task_default_queue
    received = developers_worker(queue)
    options = dict(durable.app.conf.broker_transport_options or {})
    try:
        assert isolate_durable(durable) == SESSION
        run_id = durable.start("hello", {"name": "ada"})
        assert durable.flush(timeout=10)
        # The message waits under the session's prefix, not in the queue the dev worker reads.
        assert redis_client.llen(f"{SESSION}{queue}") == 1
        assert redis_client.llen(queue) == 0
        with worker(durable):  # the session's own worker takes it from there
            run = wait_for(durable, run_id, timeout=30)
        assert run.status == "completed" and run.output == {"greeting": "hello ada"}
        assert received == []
    finally:
        durable.app.conf.broker_transport_options = options


@pytest.mark.parametrize("backend", ["rabbitmq"])
def test_on_rabbitmq_a_developers_worker_on_the_queue_is_refused_by_name(
    make_durable: Any, developers_worker: Any
) -> None:
    durable = make_durable()
    _define(durable)
    assert isolate_durable(durable) is None  # nobody else consumes its queues: nothing to say
    queue = durable.app.conf.task_default_queue
    developers_worker(queue)
    with pytest.raises(NotConfigured) as refused:
        isolate_durable(durable)
    message = str(refused.value)
    assert f"consumes queue {queue!r}" in message and "\n" not in message


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_pytest_plugins_worker_fixture_isolates_the_durable_it_runs(
    make_durable: Any, durable_worker: Any, developers_worker: Any
) -> None:
    durable = make_durable()
    _define(durable)
    received = developers_worker(durable.app.conf.task_default_queue)
    options = dict(durable.app.conf.broker_transport_options or {})
    try:
        durable_worker(durable)
        assert durable.app.conf.broker_transport_options["global_keyprefix"] == SESSION
        runs = [durable.start("hello", {"name": f"n{i}"}) for i in range(5)]
        for run_id in runs:
            assert wait_for(durable, run_id, timeout=30).status == "completed"
        assert received == []
    finally:
        durable.app.conf.broker_transport_options = options


def test_a_private_broker_needs_no_namespace() -> None:
    app = Celery("private", broker="memory://", set_as_current=False)
    durable = Durable(app, "memory://")
    try:
        assert isolate_durable(durable) is None
        assert "global_keyprefix" not in (app.conf.broker_transport_options or {})
    finally:
        durable.db.dispose()
