"""Waiting inside a step: the run parks in the database and the worker slot is freed.

A step that waits is re-run from the top when the run resumes; every wait it already came
through returns what it returned the first time (the received event, or its timeout), so a
step resumes where it parked. Work before a wait is repeated on resume: keep it idempotent,
or put it in an earlier step.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..errors import EventTimeout, InvalidArgument
from ..store import event_rows

if TYPE_CHECKING:
    from .run_state import RunState

MISSING: Any = object()


class Parked(BaseException):
    """Unwinds a step that waits; the engine parks the run. Never catch it."""

    def __init__(self, name: str, timeout: float | None, children: list[str] | None = None) -> None:
        super().__init__(name)
        self.name = name
        self.timeout = timeout
        self.children = children or []  # unfinished children the run waits for


class Snoozed(BaseException):
    """Unwinds a step that snoozes; the engine hands the run back. Never catch it."""

    def __init__(self, seconds: float, reason: str | None) -> None:
        super().__init__(reason)
        self.seconds = seconds
        self.reason = reason


INTERNAL = "durable:"  # names of waits the library keeps for itself (sleeps, inputs)
INPUT = INTERNAL + "input:"


def check_event(name: Any, payload: Any = None) -> None:
    """Raise InvalidArgument unless ``name`` is a non-empty str and ``payload`` is JSON."""
    if not isinstance(name, str) or not name or len(name) > 150:
        raise InvalidArgument(f"an event name must be a str of 1 to 150 characters, not {name!r}")
    if name.startswith(INTERNAL):
        raise InvalidArgument(f"event names starting with {INTERNAL!r} are reserved")
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"an event payload must be JSON: {exc}") from exc


def wait_for_event(run: RunState, name: str, timeout: float | None, timeout_value: Any) -> Any:
    """The event ``name`` of this run: at once if kept, else after parking until it comes."""
    check_event(name)
    return _wait(run, name, timeout, timeout_value)


def wait_for_input(run: RunState, name: str, timeout: float | None) -> Any:
    """The value provided for input ``name`` (``Durable.provide_input``), parking until then."""
    check_event(name)
    return _wait(run, INPUT + name, timeout, MISSING)


def sleep(run: RunState, seconds: float) -> None:
    """Park the run for ``seconds``; on resume this sleep (and every one before it) is done."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidArgument(f"seconds must be a number, not {seconds!r}")
    run._sleeps += 1
    if seconds > 0:
        name = f"{INTERNAL}sleep:{run._step_index}:{run.attempt}:{run._sleeps}"
        _wait(run, name, seconds, None)


def _wait(run: RunState, name: str, timeout: float | None, timeout_value: Any) -> Any:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
    db = run._active.engine.db
    with db.begin() as conn:
        got = event_rows.receive_event_txn(conn, run.id, name)
        if got is None and run._resumed_wait == name:
            left = event_rows.wait_left_txn(db, conn, run.id)
            if left is not None and left <= 0:  # resumed by its timeout
                event_rows.record_timeout_txn(db, conn, run.id, name)
                return _timed_out(name, timeout_value)
            timeout = left  # resumed early with nothing kept: wait on, until the same deadline
    if got is None:
        raise Parked(name, timeout)
    if got.timed_out:
        return _timed_out(name, timeout_value)
    return got.payload


def _timed_out(name: str, timeout_value: Any) -> Any:
    if timeout_value is MISSING:
        raise EventTimeout(f"no event {name!r} came before the timeout")
    return timeout_value
