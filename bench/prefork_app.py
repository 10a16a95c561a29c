"""The app ``bench.prefork`` runs under ``celery worker``: plain no-op tasks and a durable workflow."""

from __future__ import annotations

import os

import redis
from celery import Celery

from durable_celery import Durable

app = Celery("bench_prefork", broker=os.environ["BENCH_BROKER"])
app.conf.update(
    task_serializer="json",
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery"),
)
durable = Durable(app, os.environ["BENCH_DB"], inline_steps=int(os.environ.get("BENCH_INLINE", "20")))
_done = redis.Redis.from_url(os.environ["BENCH_BROKER"])


@app.task(name="bench.noop", ignore_result=True, acks_late=True, typing=False)
def noop(*args: object, **kwargs: object) -> None:
    """Does nothing."""


@app.task(name="bench.last", ignore_result=True, acks_late=True, typing=False)
def last(*args: object, **kwargs: object) -> None:
    """The last task of a chain: counts the chain done."""
    _done.incr("bench:done")


bench3 = durable.workflow("bench3")
for _name in ("first", "second", "third"):
    bench3.step(lambda batch: None, name=_name)
