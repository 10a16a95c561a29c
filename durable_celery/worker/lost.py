"""A prefork pool process that dies mid-step: the worker that forked it sees it at once
(Celery's ``WorkerLostError``) and records the attempt as used, instead of leaving the run
locked until the stale sweep."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.exceptions import WorkerLostError
from celery.worker.request import Request

log = logging.getLogger("durable_celery")


class StepRequest(Request):
    """Celery's request of a durable step task, which records a lost pool process."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        """Celery's failure handling, then: a step whose process died has used an attempt."""
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
            if isinstance(exc, WorkerLostError) and self.worker_pid:
                self._record_lost(str(exc))

    def _record_lost(self, reason: str) -> None:
        engine = getattr(self.task, "durable_engine", None)
        kwargs = self.kwargs or {}
        name = getattr(self.task, "durable_workflow", "")
        workflow = engine.rt.registry.workflows.get(name) if engine is not None else None
        index = kwargs.get("step", getattr(self.task, "durable_step", 0))
        if engine is None or workflow is None or not kwargs.get("run_id") or index >= len(workflow.steps):
            return
        reason = reason.removeprefix("Worker exited prematurely: ").rstrip(".")
        args = (workflow, workflow.steps[index], kwargs["run_id"], self.worker_pid)
        why = f"pool process {self.worker_pid} exited ({reason})"
        compensate = kwargs.get("phase") == "compensate"

        def record() -> None:
            try:
                engine.record_lost(*args, why, compensate=compensate)
            except Exception:  # the stale sweep recovers the run instead
                log.exception("durable: could not record the lost process of run %s", kwargs["run_id"])

        # Off the worker's event loop: the write waits out a database outage, if there is one.
        threading.Thread(target=record, name="durable-lost", daemon=True).start()
