"""Helpers for users' own tests: a real Celery worker in this process, and waiting on runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.contrib.testing.worker import start_worker
from celery.worker import state as worker_state
from kombu.asynchronous import set_event_loop

from .app import Durable
from .models import Run
from .store.schema import FINISHED

WAKE_TASK = "durable.testing.wake"


@contextmanager
def worker(
    durable: Durable,
    *,
    concurrency: int = 2,
    pool: str = "threads",
    queues: list[str] | None = None,
    **options: Any,
) -> Iterator[Any]:
    """Run a real Celery worker (thread pool) for ``durable.app`` inside this process."""
    # Celery's worker reuses the process's current kombu event loop when one is set; two
    # workers running at once in one process would then drive one hub from two threads (and
    # block on each other's sockets). Each worker started here gets a hub of its own.
    set_event_loop(None)
    if queues:
        options["queues"] = queues
    if WAKE_TASK not in durable.app.tasks:
        durable.app.task(name=WAKE_TASK, shared=False, ignore_result=True)(_noop)
    with start_worker(
        durable.app,
        concurrency=concurrency,
        pool=pool,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
        **options,
    ) as controller:
        try:
            yield controller
        finally:
            worker_state.should_terminate = 0  # what start_worker sets on exit, set first
            _wake(durable, queues)


def _wake(durable: Durable, queues: list[str] | None) -> None:
    # Transports without push (memory, filesystem) poll with a 2 s timeout, and the consumer
    # loop drains once more after it notices the stop: two messages end both waits at once.
    if durable.app.conf.broker_url.split(":", 1)[0] in ("memory", "filesystem", "durablefs"):
        for queue in queues or [durable.app.conf.task_default_queue]:
            for _ in range(2):
                durable.app.send_task(WAKE_TASK, queue=queue, ignore_result=True)


def _noop() -> None:
    """Does nothing; its message wakes a polling consumer."""


def wait_for(
    durable: Durable, run_id: str, *, statuses: tuple[str, ...] = FINISHED, timeout: float = 30.0
) -> Run:
    """Poll the database until the run reaches one of ``statuses``; raise TimeoutError if not."""
    deadline = time.monotonic() + timeout
    while True:
        run = durable.get_run(run_id)
        if run.status in statuses:
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} is {run.status} after {timeout}s, not {statuses}")
        time.sleep(0.05)
