"""The Celery state of a step task, from what its message came to, so Flower, task events and
``task_failure`` show what really happened (docs/schedules.md has the table).

The database outcome is written before any of this runs: the exceptions raised here only set
the task's state. None of them makes Celery send the message again: durable's own retry
stays in the database, and every message is acked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from billiard.einfo import ExceptionWithTraceback
from celery import states
from celery.exceptions import Ignore, Retry
from kombu.utils.encoding import safe_repr

from .lost import StepRequest

if TYPE_CHECKING:
    from .definition import Step, Workflow
    from .engine import MessageResult

# What a recorded attempt came to, by the status the engine returns; any other status (dropped,
# fenced, cancelled, handed_back, snoozed, waiting, deferred) is a message that came to nothing.
WENT_ON = frozenset({"running", "completed", "compensating", "compensated"})
NO_ATTEMPT_LEFT = frozenset({"failed", "compensating", "compensation_failed", "definition_changed"})

_STEP_FAILED = "durable_step_failed"  # set on the Celery request of a FAILURE raised here


class Ignored(Ignore):
    """A step message that came to nothing to show (duplicate, late, fenced, handed back,
    snoozed, parked): the task ends ``IGNORED``; its argument is the summary Flower shows."""


def celery_state(result: MessageResult, compensate: bool) -> str:
    """SUCCESS, RETRY, FAILURE or IGNORED: the Celery state of a step task that came to ``result``."""
    status, failed = result.status, result.error is not None
    if not failed:
        return states.SUCCESS if status in WENT_ON else states.IGNORED
    # A failed compensation with an attempt left keeps the run "compensating"; a failed step
    # with none left starts compensating.
    if status == "retrying" or (compensate and status == "compensating"):
        return states.RETRY
    return states.FAILURE if status in NO_ATTEMPT_LEFT else states.IGNORED


def task_result(
    result: MessageResult,
    request: Any,
    run_id: str,
    workflow: Workflow,
    step: Step,
    compensate: bool,
    backoff: Callable[[Step, int], float],
) -> dict[str, Any]:
    """The SUCCESS summary of a step task (run id, step, next step or run status), or raise
    what gives the task its state: ``Retry`` (no message is sent), the step's exception, or
    ``Ignored``."""
    summary: dict[str, Any] = {"run_id": run_id, "step": step.name}
    if compensate:
        summary["phase"] = "compensate"
    state = celery_state(result, compensate)
    if state == states.SUCCESS:
        following = _following(workflow, step, compensate, result.status)
        summary.update({"next": following} if following else {"run": result.status})
        return summary
    if state == states.RETRY:
        raise Retry(exc=result.error, when=backoff(step, result.attempt)) from result.error
    if state == states.FAILURE and result.error is not None:
        setattr(request, _STEP_FAILED, True)  # a step that failed, not a message the engine lost
        raise result.error
    raise Ignored(safe_repr({**summary, "outcome": result.status}))


def _following(workflow: Workflow, step: Step, compensate: bool, status: str) -> str | None:
    """The step (or compensation) the run goes on to, as the engine chose it; None when it ended."""
    if status == "running":
        return workflow.steps[step.index + 1].name
    before = workflow.compensation_before(step.index) if compensate and status == "compensating" else None
    return before.name if before is not None else None


def step_failed(task: Any) -> bool:
    """Did this step task fail because its step failed (recorded), not because the engine raised?"""
    return bool(getattr(task.request, _STEP_FAILED, False))


class StateRequest(StepRequest):
    """Celery's request of a durable step task: a lost pool process is recorded (``StepRequest``)
    and an ignored message is announced with a ``task-ignored`` event, so Flower shows it
    ``IGNORED`` instead of ``STARTED`` forever (Celery sends no event for ``Ignore``)."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        """Celery's failure handling, then the ``task-ignored`` event of an ignored message."""
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            exc = exc_info.exception
            if isinstance(exc, ExceptionWithTraceback):
                exc = exc.exc
            if isinstance(exc, Ignored):
                self.send_event("task-ignored", result=str(exc))
