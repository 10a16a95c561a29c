"""What watches a start and every step attempt: the start's span, and around each attempt its
span (tracing.py) and its log capture (logs.py). The core calls ``Instrumentation`` only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from . import logs, tracing

if TYPE_CHECKING:
    from ..settings import Settings
    from ..store.db import Database


class Observed:
    """One attempt being watched: hand it the outcome, then read the lines to save."""

    def __init__(self, span: Any, attempt: logs.Attempt) -> None:
        self.span = span
        self.attempt = attempt
        self.logs: list[dict[str, Any]] | None = None

    def finish(self, outcome: Any) -> None:
        """Mark the span with the outcome and take the captured lines."""
        tracing.end_step_span(self.span, outcome)
        self.logs = self.attempt.saved()


class Instrumentation:
    """Spans and log capture for one Durable, as its settings ask."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db = db
        self.tracer_provider = getattr(settings, "tracer_provider", None)
        self.log_capture = logs.LogCapture.from_setting(settings.log_capture)

    def stamp_run(self, workflow: Any, run: dict[str, Any]) -> None:
        """The new run's ``durable.start`` span; its traceparent goes on ``run``."""
        tracing.stamp_run(self.tracer_provider, workflow, run)

    @contextmanager
    def observe_step(self, workflow: Any, ctx: Any, row: Any) -> Iterator[Observed]:
        """Span and log capture around one step attempt, in the step's own context."""
        capture = self.log_capture
        metadata = (
            logs.step_metadata(workflow, ctx.id, ctx.step, ctx.attempt, ctx.input) if capture.enabled else {}
        )
        trace_parent = getattr(row, "trace_parent", None)
        with (
            tracing.step_span(self.tracer_provider, self.db, ctx, trace_parent) as span,
            logs.capture(capture, metadata) as attempt,
        ):
            yield Observed(span, attempt)
