"""Helpers for users' own tests: a real Celery worker in this process, and waiting on runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery.contrib.testing.worker import start_worker

from .app import Durable
from .models import Run
from .store.schema import FINISHED


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
    if queues:
        options["queues"] = queues
    with start_worker(
        durable.app,
        concurrency=concurrency,
        pool=pool,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
        **options,
    ) as controller:
        yield controller


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
