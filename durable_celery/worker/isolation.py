"""A test session's messages, kept to itself on a shared broker.

A developer's own ``celery -A proj worker`` often runs on the broker the tests use. Without care
it takes the tests' step messages, finds no such run in its own database, drops them ("ignored"),
and the test waits in vain. ``isolate`` gives a Durable's messages a namespace of the test
session's own: on Redis a key prefix (kombu's ``global_keyprefix``) on every queue, so only the
session's own workers see them; on another broker it refuses, naming the queue and its
consumers, when a worker outside the session already consumes one of the Durable's queues.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from typing import Any

from ..definition import Registry
from ..errors import NotConfigured

log = logging.getLogger("durable_celery")

# This test process's namespace: one per process, so every test of a session shares it.
SESSION = f"durable-test-{uuid.uuid4().hex[:8]}-{os.getpid()}:"

# Brokers whose messages never leave this process or this test's own folder.
PRIVATE = ("memory", "filesystem", "durablefs")


def isolate(app: Any, queues: Iterable[str], reconnect: Any, namespace: str = SESSION) -> str | None:
    """Keep ``app``'s messages to this session: the namespace it now uses (Redis), or None where
    the broker needs none or cannot have one; NotConfigured when a worker outside the session
    consumes one of ``queues``. ``reconnect`` makes the app's sender use new connections."""
    scheme = str(app.conf.broker_url or "").split(":", 1)[0]
    if scheme in PRIVATE:
        return None
    if scheme.startswith("redis") or scheme == "rediss":
        options = dict(app.conf.broker_transport_options or {})
        if options.get("global_keyprefix") == namespace:
            return namespace
        options["global_keyprefix"] = namespace
        app.conf.broker_transport_options = options
        _drop_connections(app)
        reconnect()
        return namespace
    refuse_foreign_consumers(app, queues)
    return None


def isolate_durable(durable: Any) -> str | None:
    """``isolate`` a Durable's app, its workflows' queues and its publisher (the test kits')."""
    app = durable.app
    queues = queues_of(durable.registry, str(app.conf.task_default_queue))
    reconnect = getattr(getattr(durable.outbox, "publisher", None), "reconnect", lambda: None)
    return isolate(app, queues, reconnect)


def refuse_foreign_consumers(app: Any, queues: Iterable[str]) -> None:
    """NotConfigured naming the first of ``queues`` that already has a consumer on the broker."""
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1)
        for name in sorted(set(queues)):
            with conn.channel() as channel:
                try:
                    consumers = channel.queue_declare(queue=name, passive=True).consumer_count
                except conn.channel_errors:  # no such queue: nobody consumes it
                    continue
            if consumers:
                raise NotConfigured(
                    f"durable: a worker outside this test session consumes queue {name!r} on "
                    f"{conn.as_uri()} ({consumers} consumer(s)): it would take this session's "
                    "step messages and drop them; stop it, or give the tests a broker (or vhost) of "
                    "their own"
                )


def queues_of(registry: Registry, default: str) -> set[str]:
    """Every queue the registry's workflows send step messages to."""
    return {
        workflow.queue_for(step, default) or default
        for workflow in registry.workflows.values()
        for step in workflow.steps
    } | {default}


def _drop_connections(app: Any) -> None:
    """Close the app's pooled broker connections: the next ones are made with its options now."""
    pool = getattr(app, "_pool", None)
    if pool is not None:
        pool.force_close_all()
        app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
