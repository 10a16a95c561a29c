"""``CeleryOutbox``: the core's step messages, sent as Celery task messages (now, or by the
background publisher), and the runs whose message could not be sent flagged for the relay."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..definition import Registry, Workflow
from ..instrument import tracing
from ..settings import Settings
from ..store import queries
from ..store.db import Database
from .publisher import Message, Publisher


class CeleryOutbox:
    """Sends step messages through one Celery app (the ``Outbox`` of ``core/runtime.py``)."""

    def __init__(self, app: Any, db: Database, registry: Registry, settings: Settings) -> None:
        self.app = app
        self.db = db
        self.registry = registry
        self.settings = settings
        self.inline = False
        self.publisher = Publisher(app, self.flag_unsent, settings.publish_retries, settings.publish_linger)

    @property
    def eager(self) -> bool:
        """``start()`` runs the run's steps in the calling thread (``task_always_eager``)."""
        return bool(self.app.conf.task_always_eager)

    @property
    def sends_ahead(self) -> bool:
        """A start may hand its first step's message over before its row commits: when messages
        go from the background publisher, and are sent at all."""
        return self.settings.publish_in_background and not (self.inline or self.eager)

    def send_named(
        self, workflow: str, run_id: str, step_index: int, attempt: int, key: str | None, soon: bool = False
    ) -> bool:
        """Send the message for one step of a run of the named workflow, if it is defined here;
        ``soon``: hand it to the background publisher (``publish_in_background``) and return."""
        wf = self.registry.workflows.get(workflow)
        if wf is None or step_index >= len(wf.steps):
            return False  # the relay of a node that knows the workflow sends it
        if soon and self.settings.publish_in_background and not (self.inline or self.eager):
            self.publisher.send_soon(self.message(wf, step_index, run_id, attempt, key, soon=True))
            return True
        return self.send(wf, step_index, run_id, attempt, key)

    def send(
        self,
        workflow: Workflow,
        step_index: int,
        run_id: str,
        attempt: int,
        key: str | None,
        compensate: bool = False,
    ) -> bool:
        """Send the message for one step (or its compensation) now; on failure flag the run for
        the relay. Inline (a Fake, eager mode) nothing is sent: the due run is taken from the
        database by whoever runs steps in the calling thread."""
        if self.inline or self.eager:
            return True
        return self.publisher.send_now(self.message(workflow, step_index, run_id, attempt, key, compensate))

    def message(
        self,
        workflow: Workflow,
        step_index: int,
        run_id: str,
        attempt: int,
        key: str | None,
        compensate: bool = False,
        soon: bool = False,
    ) -> Message:
        """The task message for one step of a run."""
        step = workflow.steps[step_index]
        queue = workflow.queue_for(step, None)
        # What send_task would read from this thread: the task sending it (Flower's parent and
        # root), and for the publisher's thread, the caller's OpenTelemetry context.
        parent = self.app.current_worker_task
        request = parent.request if parent is not None else None
        return Message(
            step.task_name,
            step.name,
            step_index,
            run_id,
            attempt,
            key,
            queue,
            compensate,
            parent_id=request.id if request is not None else None,
            root_id=(request.root_id or request.id) if request is not None else None,
            context=tracing.caller_context() if soon else None,
        )

    def flag_unsent(self, run_ids: Sequence[str]) -> None:
        """Mark runs whose message could not be sent: the relay sends them."""
        with self.db.begin() as conn:
            queries.mark_unsent(conn, run_ids, after_starts=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message queued here is sent (or flagged); False on time-out."""
        return self.publisher.flush(timeout)

    def gathering(self) -> AbstractContextManager[None]:
        """A block whose background sends go to the broker together when it ends."""
        return self.publisher.gathering()
