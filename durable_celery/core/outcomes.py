"""What a step attempt came to, and the run's next state as named transitions.

Each transition returns the run's new column values; the engine adds the queue of the step the
run is at and writes them with the step's row in one statement (``queries.record_step``).
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..definition import Step, Workflow
from ..store.db import Clock
from .runs import backoff
from .waits import Parked, Snoozed

if TYPE_CHECKING:
    from ..settings import Settings

# Statuses a step or compensation can end a run in.
ENDED = ("completed", "failed", "compensated", "compensation_failed")


def error_record(exc: BaseException) -> dict[str, Any]:
    """An exception as stored on a step or run: type, message and traceback."""
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


@dataclass
class Outcome:
    """What one step attempt came to."""

    value: Any = None
    error: BaseException | None = None
    stopped: str | None = None
    parked: Parked | None = None
    snoozed: Snoozed | None = None
    logs: list[dict[str, Any]] | None = None  # captured log lines, saved on the step row


@dataclass
class MessageResult:
    """What one step message came to: the status ``execute`` returns and, for an attempt that
    failed (already recorded), its exception and attempt number (task_states.py reads them)."""

    status: str
    error: BaseException | None = None
    attempt: int = 0
    # The run's next step, claimed by this worker in the statement that recorded this one
    # (continuation.py runs it in the same task execution).
    continued: Any = None


# -- transitions --------------------------------------------------------------------------------


def ended(status: str, error: BaseException | None = None) -> dict[str, Any]:
    """The run ends in ``status`` (losses count for the step in progress: an ended run has none)."""
    values: dict[str, Any] = {"status": status, "finished_at": Clock(), "due_at": None, "losses": 0}
    if error is not None:
        values["error"] = error_record(error)
    return values


def completed(output: Any, context: dict[str, Any]) -> dict[str, Any]:
    """The last step returned: the run completes with its output."""
    return {**ended("completed"), "output": output, "context": context}


def next_step(step: Step, context: dict[str, Any]) -> dict[str, Any]:
    """The run goes on to ``step``, due now, its first attempt."""
    return {
        "step_index": step.index,
        "step_name": step.name,
        "attempt": 1,
        "attempt_base": 0,
        "losses": 0,
        "context": context,
        "due_at": Clock(),
        "published": True,
    }


def retry_after(attempt: int, delay: float) -> dict[str, Any]:
    """The attempt failed and another is left: attempt ``attempt + 1`` is due in ``delay`` s."""
    return {"attempt": attempt + 1, "losses": 0, "due_at": Clock(delay), "published": False}


def compensate_from(undo: Step, error: BaseException, context: dict[str, Any]) -> dict[str, Any]:
    """The step failed for good: the run compensates, from ``undo`` backwards."""
    return {
        "status": "compensating",
        "error": error_record(error),
        "step_index": undo.index,
        "step_name": undo.name,
        "attempt": 1,  # compensations count from 1 against compensate_retry: no base
        "losses": 0,
        "context": context,
        "due_at": Clock(),
        "published": True,
    }


def compensate_next(undo: Step) -> dict[str, Any]:
    """A compensation completed: the one before it is due now."""
    return {
        "step_index": undo.index,
        "step_name": undo.name,
        "attempt": 1,
        "losses": 0,
        "due_at": Clock(),
        "published": True,
    }


def after_step(
    settings: Settings, workflow: Workflow, step: Step, row: Any, context: dict[str, Any], outcome: Outcome
) -> tuple[dict[str, Any], str]:
    """The run's next state after one attempt of ``step``, and its status: completed, running
    (the next step), retrying, compensating or failed."""
    if outcome.error is None and step.index == len(workflow.steps) - 1:
        return completed(outcome.value, context), "completed"
    if outcome.error is None:
        return next_step(workflow.steps[step.index + 1], context), "running"
    if row.attempt - row.attempt_base < step.retry:
        return retry_after(row.attempt, backoff(settings, step, row.attempt)), "retrying"
    undo = workflow.compensation_before(step.index)
    if undo is not None:
        return compensate_from(undo, outcome.error, context), "compensating"
    return ended("failed", outcome.error), "failed"


def after_compensation(
    settings: Settings, workflow: Workflow, step: Step, row: Any, outcome: Outcome
) -> dict[str, Any]:
    """The run's next state after one attempt of ``step``'s compensation: the compensation
    before it, a retry, or the end (compensated, compensation_failed)."""
    if outcome.error is None:
        before = workflow.compensation_before(step.index)
        return ended("compensated") if before is None else compensate_next(before)
    if row.attempt < step.compensate_retry:
        return retry_after(row.attempt, backoff(settings, step, row.attempt))
    return ended("compensation_failed")


# -- what a step returned -----------------------------------------------------------------------


def with_logs(details: dict[str, Any], logs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An activity entry's details, with the captured lines of the pass that ended there (a
    pass that snoozed or was handed back writes no step row)."""
    return {**details, "logs": logs} if logs else details


def json_or_none(value: Any) -> Any:
    """``value`` if JSON can hold it, else None (a compensation's return value is kept if it can)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return value


def check_json(outcome: Outcome, context: dict[str, Any]) -> Outcome:
    """Fail the attempt (in place) whose return value or context JSON cannot hold."""
    try:
        json.dumps(outcome.value, allow_nan=False)
        json.dumps(context, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # In place: the caller's outcome carries the error recorded (execute_with_result).
        outcome.value = None
        outcome.error = TypeError(f"a step's return value and context must be JSON: {exc}")
    return outcome
