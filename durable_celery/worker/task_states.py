"""The Celery state of a step task, from what its message came to, so Flower, task events and
``task_failure`` show what really happened (docs/schedules.md has the table).

The database outcome is written before any of this runs: the exceptions raised here only set
the task's state. None of them makes Celery send the message again: durable's own retry
stays in the database, and every message is acked.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from billiard.einfo import ExceptionWithTraceback
from celery import states
from celery.exceptions import Ignore, Retry
from kombu.utils.encoding import safe_repr

from .lost import StepRequest

log = logging.getLogger("durable_celery")

if TYPE_CHECKING:
    from ..core.engine import MessageResult
    from ..definition import Step, Workflow

# What a recorded attempt came to, by the status the engine returns; any other status (dropped,
# fenced, cancelled, handed_back, snoozed, waiting, deferred) is a message that came to nothing.
WENT_ON = frozenset({"running", "completed", "compensating", "compensated"})
NO_ATTEMPT_LEFT = frozenset({"failed", "compensating", "compensation_failed", "definition_changed"})

_STEP_FAILED = "durable_step_failed"  # set on the Celery request of a FAILURE raised here


class Ignored(Ignore):
    """A step message that came to nothing to show (duplicate, late, fenced, handed back,
    snoozed, parked): the task ends ``IGNORED``; its argument is the summary Flower shows."""


class StepSummary(Mapping[str, Any]):
    """What a step task returns: its summary, read like a dict, shown as the dict's ``repr``.

    Celery makes a ``saferepr`` of every task's return value for its log and the
    ``task-succeeded`` event (what Flower shows); it walks a ``dict`` item by item, which took
    about 3 % of a pool process's time per step. Any other object gives its ``repr``: the same
    text, made once.
    """

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)


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
) -> StepSummary:
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
        return StepSummary(summary)
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


def shown_kwargs(run_id: str, key: str | None, step: str, attempt: int, compensate: bool = False) -> str:
    """A step task's kwargs as Flower shows them (``kwargsrepr``): the run, its key, the step."""
    shown = f"{{run_id: {run_id}, key: {key!r}, step: {step}, attempt: {attempt}"
    return shown + (", phase: compensate}" if compensate else "}")


class InlineEvents:
    """Task events for the steps a message runs inline (continuation.py), so each appears in
    Flower as a task of its own, named and shown like a published one, with its true state.
    Made only while the worker sends task events."""

    def __init__(self, task: Any) -> None:
        self.app = task.app
        request = task.request
        self.hostname = request.hostname
        self.parent_id = request.id
        self.root_id = request.root_id or request.id
        self._dispatcher: Any = None

    def _send(self, type_: str, **fields: Any) -> None:
        try:
            if self._dispatcher is None:
                self._dispatcher = self.app.events.Dispatcher(
                    self.app.connection_for_write(), hostname=self.hostname, enabled=True
                )
            self._dispatcher.send(type_, **fields)
        except Exception as exc:  # events are for watching: never fail a step over one
            log.warning("durable: could not send the %s event of an inline step: %r", type_, exc)
            self.close()

    def started(self, step: Step, row: Any) -> tuple[str, float, str]:
        """Announce an inline step as received and started; returns its task id, start time
        and run id."""
        task_id = str(uuid.uuid4())
        self._send(
            "task-received",
            uuid=task_id,
            name=step.task_name,
            args="()",
            kwargs=shown_kwargs(row.id, row.key, step.name, row.attempt),
            root_id=self.root_id,
            parent_id=self.parent_id,
            retries=0,
            eta=None,
            expires=None,
        )
        self._send("task-started", uuid=task_id)
        return task_id, time.monotonic(), row.id

    def finished(
        self, shown: tuple[str, float, str], workflow: Workflow, step: Step, result: MessageResult
    ) -> None:
        """Announce what the inline step came to: succeeded, retried, failed or ignored."""
        task_id, began, run_id = shown
        state = celery_state(result, False)
        summary: dict[str, Any] = {"run_id": run_id, "step": step.name}
        if state == states.SUCCESS:
            following = _following(workflow, step, False, result.status)
            summary.update({"next": following} if following else {"run": result.status})
            runtime = time.monotonic() - began
            self._send("task-succeeded", uuid=task_id, result=safe_repr(summary), runtime=runtime)
        elif state in (states.RETRY, states.FAILURE) and result.error is not None:
            error = result.error
            kind = "task-retried" if state == states.RETRY else "task-failed"
            trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self._send(kind, uuid=task_id, exception=safe_repr(error), traceback=trace)
        else:
            self._send("task-ignored", uuid=task_id, result=safe_repr({**summary, "outcome": result.status}))

    def close(self) -> None:
        """Release the events connection."""
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            try:
                dispatcher.close()
                dispatcher.connection.release()
            except Exception:
                pass
