"""Waiting inside a step: the run parks in the database and the worker slot is freed.

A step that waits is re-run from the top when the run resumes; every wait it already came
through returns what it returned the first time (the received event, or its timeout), so a
step resumes where it parked. Work before a wait is repeated on resume: keep it idempotent,
or put it in an earlier step.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .errors import DurableError, InvalidArgument
from .store import event_rows

if TYPE_CHECKING:
    from .context import RunContext

MISSING: Any = object()


class Parked(BaseException):
    """Unwinds a step that waits; the engine parks the run. Never catch it."""

    def __init__(self, name: str, timeout: float | None) -> None:
        super().__init__(name)
        self.name = name
        self.timeout = timeout


class EventTimeout(DurableError):
    """A wait for an event timed out and no ``timeout_value`` was given."""


def check_event(name: Any, payload: Any = None) -> None:
    """Raise InvalidArgument unless ``name`` is a non-empty str and ``payload`` is JSON."""
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidArgument(f"an event name must be a str of 1 to 200 characters, not {name!r}")
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"an event payload must be JSON: {exc}") from exc


def wait_for_event(run: RunContext, name: str, timeout: float | None, timeout_value: Any) -> Any:
    """The event ``name`` of this run: at once if kept, else after parking until it comes."""
    check_event(name)
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
    db = run._active.engine.db
    with db.begin() as conn:
        got = event_rows.receive_event_txn(conn, run.id, name)
        if got is None and run._resumed_wait == name:
            # Resumed with nothing kept: only the timeout makes a waiting run due.
            event_rows.record_timeout_txn(db, conn, run.id, name)
            return _timed_out(name, timeout_value)
    if got is None:
        raise Parked(name, timeout)
    if got.timed_out:
        return _timed_out(name, timeout_value)
    return got.payload


def _timed_out(name: str, timeout_value: Any) -> Any:
    if timeout_value is MISSING:
        raise EventTimeout(f"no event {name!r} came before the timeout")
    return timeout_value
