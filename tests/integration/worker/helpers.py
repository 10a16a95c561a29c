"""Helpers of the upkeep tests: its threads, run in this process, and the nodes they register."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from durable_celery.worker import upkeep

THREADS = {"durable-relay", "durable-sweeper", "durable-housekeeping"}


def until(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.02)


@contextmanager
def running_upkeep(keeper: upkeep.Upkeep) -> Iterator[upkeep.Upkeep]:
    keeper.start()
    try:
        yield keeper
    finally:
        keeper.stop()


def find_node(durable: Any, name: str) -> dict[str, Any] | None:
    return next((n for n in durable.list_nodes() if n["name"] == name), None)


def upkeep_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name in THREADS}
