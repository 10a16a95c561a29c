"""What wraps every step attempt for watching it: its span (tracing.py) and its log capture
(logs.py). The engine calls :func:`observe_step` around the step and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from . import logs, tracing

if TYPE_CHECKING:
    from .app import Durable


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


@contextmanager
def observe_step(durable: Durable, workflow: Any, ctx: Any, row: Any) -> Iterator[Observed]:
    """Span and log capture around one step attempt, in the step's own context."""
    settings = durable.log_capture
    metadata = (
        logs.step_metadata(workflow, ctx.id, ctx.step, ctx.attempt, ctx.input) if settings.enabled else {}
    )
    with (
        tracing.step_span(durable, ctx, getattr(row, "trace_parent", None)) as span,
        logs.capture(settings, metadata) as attempt,
    ):
        yield Observed(span, attempt)
