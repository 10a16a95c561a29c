"""The app of tests/e2e/test_flow_control_workers.py: its workers run
`celery -A tests.e2e.flow_app worker`, configured by the environment the test gives
(``FLOW_BROKER``, ``FLOW_QUEUE``, ``FLOW_DB``, ``FLOW_STALE``); the test builds the same
workflows on its side with ``build`` (a producer, no upkeep).

Workflows, each with its flow-control option:

- ``sync``: concurrency 2 per ``t:{tenant}``, two steps of 50-150 ms;
- ``line``: concurrency 1 per ``t:{tenant}``, two short steps;
- ``hold``: concurrency 1 per ``{tenant}``; with ``block`` its step waits for the Redis key
  ``gate_key(queue, tenant)``, which the test sets;
- ``api``: throttle 2 per 2 s per ``c:{customer}``;
- ``remind``: rate limit 5 per hour per ``user:{user}``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import redis
from celery import Celery

from durable_celery import Durable, RateLimited

THROTTLE_PERIOD = 2.0
RATE_LIMIT = 5


def gate_key(queue: str, tenant: str) -> str:
    """The Redis key that lets a blocked ``hold`` step of ``tenant`` finish (the queue's name
    makes it the test's own)."""
    return f"{queue}:gate:{tenant}"


def build(broker: str, queue: str, db: str, **settings: Any) -> Durable:
    """A Celery app on ``queue`` and its Durable with the flow-control workflows."""
    app = Celery("flow_app", broker=broker)
    app.conf.task_default_queue = queue
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(app, db, **settings)
    gates = redis.Redis.from_url(broker)

    sync = durable.workflow("sync", concurrency={"limit": 2, "key": "t:{tenant}"})
    sync.step(_nap, name="fetch")
    sync.step(_nap, name="store")

    line = durable.workflow("line", concurrency={"limit": 1, "key": "t:{tenant}"})
    line.step(_blink, name="first")
    line.step(_blink, name="second")

    hold = durable.workflow("hold", concurrency={"limit": 1, "key": "{tenant}"})

    @hold.step
    def work(tenant: str, n: int, block: bool = False) -> int:
        while block and not gates.exists(gate_key(queue, tenant)):
            time.sleep(0.05)
        return n

    api = durable.workflow("api", throttle={"limit": 2, "period": THROTTLE_PERIOD, "key": "c:{customer}"})
    api.step(_blink, name="call")

    per_user = {"limit": RATE_LIMIT, "period": 3600, "key": "user:{user}"}
    remind = durable.workflow("remind", rate_limit=per_user)
    remind.step(_blink, name="send")
    return durable


def _nap(**data: Any) -> int:
    time.sleep(random.uniform(0.05, 0.15))
    return os.getpid()


def _blink(**data: Any) -> int:
    time.sleep(0.01)
    return os.getpid()


def race_starts(
    broker: str, queue: str, db: str, user: str, threads: int, barrier: Any, results: Any
) -> None:
    """In a process of its own: ``threads`` threads start ``remind`` for ``user`` at once, once
    every racing process is ready (``barrier``); puts (accepted run ids, retry_after of each
    refusal, other errors) on ``results``."""
    durable = build(broker, queue, db, upkeep=False)
    accepted: list[str] = []
    refused: list[float] = []
    errors: list[str] = []
    ready = threading.Barrier(threads)

    def start() -> None:
        ready.wait()
        try:
            accepted.append(durable.start("remind", {"user": user}))
        except RateLimited as exc:
            refused.append(exc.retry_after)
        except Exception as exc:  # reported to the test, which fails on it
            errors.append(repr(exc))

    racers = [threading.Thread(target=start) for _ in range(threads)]
    barrier.wait(60)
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(60)
    durable.db.dispose()
    results.put((accepted, refused, errors))


if os.environ.get("FLOW_DB"):  # a worker of the tests: everything comes from the environment
    durable = build(
        os.environ["FLOW_BROKER"],
        os.environ["FLOW_QUEUE"],
        os.environ["FLOW_DB"],
        poll_interval=0.2,
        heartbeat_interval=0.3,
        sweep_interval=0.5,
        stale_lock_timeout=float(os.environ.get("FLOW_STALE", "60")),
        relay_after=30.0,
        shutdown_grace_period=2.0,
    )
    app = durable.app
