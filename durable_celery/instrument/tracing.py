"""Tracing with OpenTelemetry (the ``[otel]`` extra): a run is one trace, each step attempt a span.

A start opens a short ``durable.start`` span (a child of the caller's current span, if any) and
stores its W3C ``traceparent`` on the run row (``durable_runs.trace_parent``). Every attempt of
every step, on whichever worker, after sleeps and retries, is a span whose parent is that
context, so a run and everything under it are one trace. A run started without tracing gets
its trace at its first traced step. Spans use the global tracer provider unless the
``tracer_provider`` setting names one.

Without ``opentelemetry-api`` installed every function here does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the [otel] extra is not installed: tracing is off, at no cost
    otel_trace = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ..store.db import Database

_W3C: Any = TraceContextTextMapPropagator() if otel_trace is not None else None
TRACER_NAME = "durable_celery"


def available() -> bool:
    """Is OpenTelemetry importable?"""
    return otel_trace is not None


def _tracer(provider: Any) -> Any:
    """The tracer spans are made with (from ``provider``, else the global one), or None while no
    SDK provider is set: its spans would record nothing and only carry their parent's context,
    which callers then use as it is."""
    provider = provider or otel_trace.get_tracer_provider()
    if isinstance(provider, (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer(TRACER_NAME)


def traceparent_of(span: Any) -> str | None:
    """The W3C traceparent of a span, or None when it is not a valid (sampled or not) span."""
    if otel_trace is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=otel_trace.set_span_in_context(span))
    return carrier.get("traceparent")


def context_of(trace_parent: str | None) -> Any:
    """The OpenTelemetry context a traceparent names (None for none)."""
    if otel_trace is None or not trace_parent:
        return None
    return _W3C.extract({"traceparent": trace_parent})


def current_ids() -> tuple[str | None, str | None]:
    """The trace and span ids (hex) of the current span, or (None, None)."""
    if otel_trace is None:
        return None, None
    ctx = otel_trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def caller_context() -> Any:
    """The current OpenTelemetry context when a span is active in it, else None: carried to the
    background publisher so that a message sent there is sent under the caller's span."""
    if otel_trace is None or not otel_trace.get_current_span().get_span_context().is_valid:
        return None
    return otel_context.get_current()


@contextmanager
def attached(context: Any) -> Iterator[None]:
    """Make ``context`` (from ``caller_context``) current in this thread while the block runs."""
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def _attributes(workflow: str | None, run_id: str, key: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {"durable.workflow": workflow or "", "durable.run_id": run_id}
    if key is not None:
        attributes["durable.key"] = key
    return attributes


def stamp_run(provider: Any, workflow: Any, run: dict[str, Any]) -> None:
    """Open and close the run's ``durable.start`` span; its traceparent goes on the new run."""
    if otel_trace is None:
        return
    tracer = _tracer(provider)
    if tracer is None:  # the run joins the caller's trace, if there is one
        trace_parent = traceparent_of(otel_trace.get_current_span())
    else:
        attributes = _attributes(workflow.name, run["id"], run.get("key"))
        with tracer.start_as_current_span(
            f"durable.start {workflow.name}", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            trace_parent = traceparent_of(span)
    if trace_parent is not None:
        run["trace_parent"] = trace_parent


@contextmanager
def step_span(provider: Any, db: Database, ctx: Any, trace_parent: str | None) -> Iterator[Any]:
    """The span of one step attempt, current while the block runs (None without OpenTelemetry).

    Its parent is the run's trace; a run without one gets this span's context as its trace.
    """
    if otel_trace is None:
        yield None
        return
    tracer = _tracer(provider)
    if tracer is None:  # the run's trace is current, as a span of a no-op tracer would leave it
        with attached(context_of(trace_parent)):
            yield None
        return
    attributes = _attributes(ctx.workflow, ctx.id, ctx.key)
    attributes.update({"durable.step": ctx.step, "durable.attempt": ctx.attempt})
    with tracer.start_as_current_span(
        f"durable.step {ctx.workflow}.{ctx.step}",
        context=context_of(trace_parent),
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span
    if trace_parent is None:
        _adopt_trace(db, ctx.id, traceparent_of(span))


def _adopt_trace(db: Database, run_id: str, trace_parent: str | None) -> None:
    if trace_parent is None:
        return
    from ..store import observe_rows

    with db.single() as conn:
        observe_rows.set_trace_parent_if_unset(conn, run_id, trace_parent)


def end_step_span(span: Any, outcome: Any) -> None:
    """Mark a step attempt's span with what it came to; an error sets the ERROR status."""
    if span is None:
        return
    if outcome.error is not None:
        span.record_exception(outcome.error)
        span.set_status(Status(StatusCode.ERROR, f"{type(outcome.error).__name__}: {outcome.error}"))
        result = "failed"
    elif outcome.stopped is not None:
        result = outcome.stopped
    elif outcome.parked is not None:
        result = "parked"
    elif outcome.snoozed is not None:
        result = "snoozed"
    else:
        result = "completed"
    span.set_attribute("durable.outcome", result)
