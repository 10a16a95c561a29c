"""pytest fixtures for testing code that uses durable_celery (docs/testing.md).

Loaded by its ``pytest11`` entry point once durable_celery is installed (``-p no:durable_celery``
turns it off), or by name: ``-p durable_celery.pytest_plugin`` or
``pytest_plugins = ["durable_celery.pytest_plugin"]`` in a conftest. Nothing is written to the
working directory: every store here lives in memory.

* ``durable_fake``: a ``testing.Fake`` (steps run when the test calls ``run_until_idle()``);
* ``durable_memory``: a ``Durable`` on the in-memory store with a real Celery worker thread;
* ``durable_worker``: ``durable_worker(durable)`` starts a real in-process worker for any
  ``Durable`` (stopped when the test ends).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from celery import Celery

from .app import Durable
from .testing import Fake, worker
from .worker.isolation import isolate_durable


@pytest.fixture
def durable_fake() -> Iterator[Fake]:
    """A ``testing.Fake`` with every capability, its own store and a clock the test moves."""
    fake = Fake()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def durable_worker() -> Iterator[Callable[..., Any]]:
    """``durable_worker(durable, **options)``: a real Celery worker in this process, for the
    rest of the test (options as ``testing.worker``: concurrency, pool, queues...). On a shared
    Redis, the Durable's messages go under a key prefix of this test session's own from then on,
    so no other worker on the broker takes them; on another broker it refuses (NotConfigured)
    when a worker outside the session consumes one of the Durable's queues."""
    with ExitStack() as stack:

        def start(durable: Durable, **options: Any) -> Any:
            isolate_durable(durable)
            return stack.enter_context(worker(durable, **options))

        yield start


@pytest.fixture
def durable_memory(durable_worker: Callable[..., Any]) -> Iterator[Durable]:
    """A ``Durable`` on its own in-memory store and memory broker, with a worker thread running."""
    name = f"durable-memory-{uuid.uuid4().hex[:8]}"
    app = Celery(name, broker="memory://localhost/", set_as_current=False)
    app.conf.task_default_queue = name
    app.conf.broker_transport_options = {"polling_interval": 0.05}
    durable = Durable(app, "memory://")
    durable_worker(durable)
    try:
        yield durable
    finally:
        durable.db.dispose()
