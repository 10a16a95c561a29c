"""Answers for callers: ``result`` waits for a run to end and gives its output (or why not).

A waiter holds no worker and no database connection. Every run waited on in a process is
watched by one thread (``Answers``), which asks the database which of them have ended in one
statement per ``POLL`` seconds, however many callers wait (threads, or tasks on event loops),
and wakes theirs. The database stays the truth: nothing can be missed, only seen a poll later.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import (
    DatabaseUnavailable,
    InvalidArgument,
    ResultTimeout,
    RunCancelled,
    RunFailed,
    RunNotFound,
)
from ..store import answer_rows, queries
from ..store.db import Database
from ..store.schema import FINISHED
from .context import _current

log = logging.getLogger("durable_celery")

POLL = 0.05  # seconds between looks while anyone waits: a run's end is seen within this
GONE_EVERY = 20  # every this many looks, also look for runs that are gone (pruned)
GONE = ""  # the status a run that is gone is answered with


class Answers:
    """The callers of one process waiting for runs to end, and the thread that looks for them."""

    def __init__(self, db: Database, poll: float = POLL) -> None:
        self.db = db
        self.poll = poll
        self._lock = threading.Lock()
        self._waiting: dict[str, list[Callable[[str], None]]] = {}
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._failing = False

    def wait(self, run_id: str, timeout: float | None) -> str | None:
        """Block until the run ends: its status (``GONE`` if it went), or None after ``timeout``."""
        ended = threading.Event()
        said: list[str] = []

        def tell(status: str) -> None:
            said.append(status)
            ended.set()

        self._add(run_id, tell)
        try:
            return said[0] if ended.wait(timeout) else None
        finally:
            self._remove(run_id, tell)

    async def wait_async(self, run_id: str, timeout: float | None) -> str | None:
        """``wait`` for an event loop: the loop stays free while the run goes on."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()

        def settle(status: str) -> None:
            if not future.done():
                future.set_result(status)

        def tell(status: str) -> None:
            loop.call_soon_threadsafe(settle, status)

        self._add(run_id, tell)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._remove(run_id, tell)

    def waiting(self) -> int:
        """How many runs are waited on now."""
        with self._lock:
            return len(self._waiting)

    def _add(self, run_id: str, tell: Callable[[str], None]) -> None:
        with self._lock:
            self._waiting.setdefault(run_id, []).append(tell)
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._pid, self._thread = os.getpid(), None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._look, name="durable-answers", daemon=True)
                self._thread.start()

    def _remove(self, run_id: str, tell: Callable[[str], None]) -> None:
        with self._lock:
            waiters = self._waiting.get(run_id)
            if waiters is not None and tell in waiters:
                waiters.remove(tell)
                if not waiters:
                    del self._waiting[run_id]

    def _look(self) -> None:
        """Look while anyone waits; the thread ends when nobody does (a new waiter starts one)."""
        looks = 0
        while True:
            with self._lock:
                run_ids = list(self._waiting)
                if not run_ids:
                    self._thread = None
                    return
            looks += 1
            ended = self._ended(run_ids, gone_too=looks % GONE_EVERY == 0)
            for run_id, status in ended.items():
                with self._lock:
                    waiters = list(self._waiting.get(run_id, ()))
                for tell in waiters:
                    try:
                        tell(status)
                    except RuntimeError:  # the waiter's event loop closed meanwhile
                        log.debug("durable: a waiter of run %s is gone", run_id)
            time.sleep(self.poll)

    def _ended(self, run_ids: list[str], gone_too: bool) -> dict[str, str]:
        """Which of ``run_ids`` ended (or are gone); none while the database is away."""
        try:
            with self.db.engine.connect() as conn:
                ended = answer_rows.ended_of(conn, run_ids)
                if gone_too:
                    present = answer_rows.present_of(conn, run_ids)
                    ended.update({run_id: GONE for run_id in run_ids if run_id not in present})
        except DatabaseUnavailable as exc:  # the waits go on; the runs' ends are seen once it is back
            if not self._failing:
                log.warning("durable: waiting for runs: %s", exc)
            self._failing = True
            return {}
        if self._failing:
            log.warning("durable: waiting for runs: the database answers again")
            self._failing = False
        return ended


def refuse_inside_step(what: str) -> None:
    """InvalidArgument when called from a step: waiting there would hold a worker."""
    if _current.get() is not None:
        raise InvalidArgument(
            f"{what}() inside a step would hold a worker while the other run goes on: use "
            "current_run().call_workflow(...) for a child's output (the worker is freed meanwhile), "
            "or current_run().wait_for_event(...)"
        )


def read_run(db: Database, run_id: Any) -> Any:
    """The run's row; RunNotFound if there is none."""
    if not isinstance(run_id, str):
        raise RunNotFound(run_id)
    with db.engine.connect() as conn:
        row = queries.fetch_run(conn, run_id)
    if row is None:
        raise RunNotFound(run_id)
    return row


def answer(row: Any) -> Any:
    """A run that ended: its output, or RunFailed / RunCancelled."""
    if row.status == "completed":
        return row.output
    if row.status == "cancelled":
        raise RunCancelled(row.id, str((row.error or {}).get("message") or ""))
    raise RunFailed(row.id, row.status, row.error)


def check_timeout(timeout: float | None) -> None:
    """InvalidArgument unless ``timeout`` is None or a number of seconds >= 0."""
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
    ):
        raise InvalidArgument(f"timeout must be None or a number of seconds >= 0, not {timeout!r}")


def result(db: Database, answers: Answers, run_id: Any, timeout: float | None) -> Any:
    """Wait for the run to end and give its output; RunFailed, RunCancelled, ResultTimeout,
    RunNotFound (also for a run pruned while waited on)."""
    refuse_inside_step("result")
    check_timeout(timeout)
    row = read_run(db, run_id)
    if row.status not in FINISHED:
        status = answers.wait(run_id, timeout)
        if status is None:
            raise ResultTimeout(run_id, timeout or 0.0, read_run(db, run_id).status)
        row = read_run(db, run_id)  # RunNotFound when it is gone
    return answer(row)


async def result_async(db: Database, answers: Answers, run_id: Any, timeout: float | None) -> Any:
    """``result`` for an event loop: its reads run in a thread, its wait on the loop."""
    refuse_inside_step("aresult")
    check_timeout(timeout)
    row = await asyncio.to_thread(read_run, db, run_id)
    if row.status not in FINISHED:
        status = await answers.wait_async(run_id, timeout)
        if status is None:
            now = await asyncio.to_thread(read_run, db, run_id)
            raise ResultTimeout(run_id, timeout or 0.0, now.status)
        row = await asyncio.to_thread(read_run, db, run_id)
    return answer(row)
