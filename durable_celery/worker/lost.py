"""What Celery does to a step's process or message, told to the run at once, instead of leaving
it locked until the stale sweep or its message unsent until ``relay_after``:

- a prefork pool process that dies mid-step (Celery's ``WorkerLostError``): the attempt is used,
  recorded ``WorkerLost``;
- a step terminated by a control command (``celery control terminate``, ``revoke
  --terminate``, Flower's terminate): the attempt is used, recorded ``Terminated``;
- a step cancelled by a cold shutdown (SIGQUIT, a second Ctrl-C): the run is handed back,
  no attempt used, as a warm shutdown does;
- a step message revoked before it ran (a plain ``revoke``): Celery drops the message, so the
  run is flagged for the relay, which sends it again (activity ``message_revoked``).

Each is seen in the worker's main process (the request's ``on_failure``, Celery's
``task_revoked`` signal); the write runs on a thread of its own, off the worker's event loop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import signals as celery_signals
from celery.exceptions import Terminated as CeleryTerminated
from celery.exceptions import WorkerLostError
from celery.worker.request import Request
from kombu.utils.encoding import safe_repr

from ..errors import Terminated
from ..store import activity_rows, queries
from .app_argument import app_argument

log = logging.getLogger("durable_celery")

_pending: list[threading.Thread] = []  # writes not finished yet (a cold shutdown waits for them)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _in_background(what: str, run_id: str, write: Callable[[], Any]) -> None:
    """Run ``write`` on a thread of its own (it waits out a database outage, if there is one)."""

    def run() -> None:
        try:
            write()
        except Exception:  # the stale sweep (or the relay) recovers the run instead
            log.exception("durable: could not record %s of run %s", what, run_id)

    thread = threading.Thread(target=run, name="durable-lost", daemon=True)
    _pending[:] = [t for t in _pending if t.is_alive()] + [thread]
    thread.start()


def wait_recorded(timeout: float) -> None:
    """Wait (up to ``timeout`` seconds in all) for the writes started here: a worker that is
    leaving lets them land first."""
    deadline = time.monotonic() + timeout
    for thread in list(_pending):
        thread.join(max(0.0, deadline - time.monotonic()))


class StepRequest(Request):
    """Celery's request of a durable step task: records a lost or terminated pool process, and
    hands back a step a cold shutdown cancelled."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        """Celery's failure handling, then: a step whose process died or was terminated has used
        an attempt; one cancelled by a cold shutdown is handed back. A lost process whose step
        has an attempt left is shown as a retry (``task-retried``), not a failure."""
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
        retried = isinstance(exc, WorkerLostError) and bool(self.worker_pid) and self._attempt_left()
        try:
            return super().on_failure(
                exc_info, send_failed_event=send_failed_event and not retried, return_ok=return_ok
            )
        finally:
            if retried:
                self.send_event("task-retried", exception=safe_repr(exc), traceback=exc_info.traceback)
            if isinstance(exc, WorkerLostError) and self.worker_pid:
                reason = str(exc).removeprefix("Worker exited prematurely: ").rstrip(".")
                self._record_lost(f"pool process {self.worker_pid} exited ({reason})")
            elif isinstance(exc, CeleryTerminated) and self.worker_pid:
                signum = int(exc.args[0]) if exc.args and isinstance(exc.args[0], int) else 0
                if self._already_cancelled:  # the worker itself cancelled it
                    why = "a cold shutdown, or its broker connection was lost"
                    self._hand_back(f"{self.hostname} cancelled the step ({why})")
                else:
                    how = f"({_signal_name(signum)})" if signum > 0 else f"(exit code {-signum})"
                    self._record_lost(
                        f"pool process {self.worker_pid} terminated by a control command {how}", Terminated
                    )

    def _step(self) -> tuple[Any, Any, Any, dict[str, Any]] | None:
        """The engine, workflow and step of this request's run, and its kwargs; None if not ours."""
        engine = getattr(self.task, "durable_engine", None)
        kwargs = self.kwargs or {}
        name = getattr(self.task, "durable_workflow", "")
        workflow = engine.rt.registry.workflows.get(name) if engine is not None else None
        index = kwargs.get("step", getattr(self.task, "durable_step", 0))
        if engine is None or workflow is None or not kwargs.get("run_id") or index >= len(workflow.steps):
            return None
        return engine, workflow, workflow.steps[index], kwargs

    def _attempt_left(self) -> bool:
        """Whether the message's step has an attempt after this one (its ``retry=``): durable
        then tries it again, so Celery's state is a retry."""
        found = self._step()
        if found is None:
            return False
        step, kwargs = found[2], found[3]
        return kwargs.get("phase", "step") == "step" and int(kwargs.get("attempt", 1)) < step.retry

    def _record_lost(self, why: str, error: type[Exception] | None = None) -> None:
        found = self._step()
        if found is None:
            return
        engine, workflow, step, kwargs = found
        compensate = kwargs.get("phase") == "compensate"
        run_id, pid = kwargs["run_id"], self.worker_pid
        _in_background(
            "the lost process",
            run_id,
            lambda: engine.record_lost(workflow, step, run_id, pid, why, compensate=compensate, error=error),
        )

    def _hand_back(self, why: str) -> None:
        found = self._step()
        if found is None:
            return
        engine, kwargs = found[0], found[3]
        run_id, pid = kwargs["run_id"], self.worker_pid
        _in_background("the cancelled step", run_id, lambda: engine.hand_back_lost(run_id, pid, why))


def on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    """A durable step message that Celery dropped unrun (``revoke``, or expired): the run is
    still due, so flag it for the relay, which sends it again at its next pass, and say so in
    the activity. A terminated step is recorded by ``StepRequest`` instead."""
    engine = getattr(sender, "durable_engine", None)
    kwargs = getattr(request, "kwargs", None) or {}
    run_id = kwargs.get("run_id")
    if engine is None or terminated or not isinstance(run_id, str):
        return
    db = engine.rt.db
    details = {
        "step": kwargs.get("step", getattr(sender, "durable_step", 0)),
        "task_id": getattr(request, "id", None),
        "node": getattr(request, "hostname", None),
        "reason": "expired" if expired else "revoked",
        "hint": f"a revoke drops a message, not its run; `celery -A {app_argument()} durable cancel "
        f"{run_id}` stops the run",
    }

    def flag() -> None:
        with db.begin() as conn:
            row = queries.fetch_run(conn, run_id)
            if row is None or row.locked_by is not None or row.due_at is None or not row.published:
                return  # finished, running, or already flagged: nothing waits on this message
            queries.mark_unsent(conn, [run_id])
            activity_rows.record_txn(db, conn, "message_revoked", run_id, row.workflow, row.key, details)
        log.warning(
            "durable: step message %s of run %s was revoked; the run is sent again",
            details["task_id"],
            run_id,
        )

    _in_background("the revoked message", run_id, flag)


celery_signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="durable_celery.worker.lost")
