"""Log capture: the lines a step attempt logs carry its run's metadata and are saved on its row.

While a step runs, a context variable names the attempt. A filter on the root logger's
handlers gives every record made in that context the attributes ``workflow``, ``workflow_id``,
``step`` and ``attempt`` (and whatever the workflow's ``log_metadata`` returns), so a formatter
can show them with ``%(workflow_id)s``. A handler on the root logger keeps the records of the captured
levels, with OpenTelemetry's ``severity_number``, ``trace_id`` and ``span_id``, and the engine
writes them on the step row with the step's result (``StepRecord.logs``).

Setting ``log_capture`` (a ``Durable`` setting or ``app.conf.durable_log_capture``)::

    log_capture={"levels": ["WARNING", "ERROR"], "metadata_filter": ["account_id"], "console": True}

``levels`` defaults to WARNING and above: every INFO line in the database costs disk and vacuum
in production (list ``"DEBUG"`` and ``"INFO"`` to keep them). ``metadata_filter`` keeps only
the named metadata (besides the four above, which are always kept); the default keeps all of
it, so narrow it if your metadata can hold secrets. ``console=False`` keeps the captured lines
off the root logger's other handlers. ``log_capture=False`` turns capture off.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..errors import InvalidDefinition

DEFAULT_LEVELS = ("WARNING", "ERROR", "CRITICAL")
MAX_RECORDS = 1000  # per attempt: a step stuck in a logging loop must not bloat its row
MAX_MESSAGE = 8000
STANDARD_FIELDS = ("workflow", "workflow_id", "step", "attempt")

# Attributes every LogRecord has; anything else on a record came from ``extra`` or from us.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


@dataclass(frozen=True)
class LogCapture:
    """The validated ``log_capture`` setting."""

    enabled: bool = True
    levels: frozenset[int] | None = frozenset(logging.getLevelName(n) for n in DEFAULT_LEVELS)
    metadata_filter: frozenset[str] | None = None
    console: bool = True

    @classmethod
    def from_setting(cls, value: Any) -> LogCapture:
        """Validate a ``log_capture`` setting (None, False, True or a dict); InvalidDefinition."""
        if value is None or value is True:
            return cls()
        if value is False:
            return cls(enabled=False)
        if not isinstance(value, Mapping):
            raise InvalidDefinition(f"log_capture must be a dict, True or False, not {value!r}")
        unknown = set(value) - {"levels", "metadata_filter", "console"}
        if unknown:
            raise InvalidDefinition(f"unknown log_capture option(s): {', '.join(sorted(unknown))}")
        levels = cls().levels
        if "levels" in value:
            levels = None if value["levels"] == "all" else _levels(value["levels"])
        names = value.get("metadata_filter")
        if names is not None and (
            isinstance(names, str) or not all(isinstance(n, str) for n in _iterable(names, "metadata_filter"))
        ):
            raise InvalidDefinition(f"log_capture metadata_filter must be a list of names, not {names!r}")
        console = value.get("console", True)
        if not isinstance(console, bool):
            raise InvalidDefinition(f"log_capture console must be True or False, not {console!r}")
        return cls(
            levels=levels,
            metadata_filter=None if names is None else frozenset(names),
            console=console,
        )

    def keeps(self, levelno: int) -> bool:
        """Is a record of this level saved?"""
        return self.enabled and (self.levels is None or levelno in self.levels)


def _iterable(value: Any, what: str) -> Iterable[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidDefinition(f"log_capture {what} must be a list, not {value!r}")
    return list(value)


def _levels(value: Any) -> frozenset[int]:
    found = set()
    for level in _iterable(value, "levels"):
        if isinstance(level, str) and isinstance(logging.getLevelName(level.upper()), int):
            found.add(int(logging.getLevelName(level.upper())))
        elif isinstance(level, int) and not isinstance(level, bool) and level > 0:
            found.add(level)
        else:
            raise InvalidDefinition(f"log_capture levels: {level!r} is not a logging level")
    return frozenset(found)


@dataclass
class Attempt:
    """What is captured for one step attempt: its metadata and the records kept so far."""

    settings: LogCapture
    metadata: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0

    def saved(self) -> list[dict[str, Any]] | None:
        """The records to write on the step row (None when capture is off)."""
        if not self.settings.enabled:
            return None
        if self.dropped:
            return [*self.records, {"body": f"{self.dropped} more line(s) not saved", "dropped": True}]
        return self.records


_attempt: ContextVar[Attempt | None] = ContextVar("durable_log_attempt", default=None)


def severity_number(levelno: int) -> int:
    """OpenTelemetry's SeverityNumber for a Python logging level (DEBUG 5, INFO 9, ... CRITICAL 21)."""
    if levelno < logging.DEBUG:
        return 1
    band = min(levelno // 10, 5)
    return 1 + 4 * band + min(3, (levelno - band * 10) * 4 // 10)


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _trace_ids() -> tuple[str | None, str | None]:
    from .tracing import current_ids

    return current_ids()


class CaptureHandler(logging.Handler):
    """Keeps the records of the current step attempt (installed on the root logger)."""

    def emit(self, record: logging.LogRecord) -> None:
        """Add the record to the attempt running in this context, if it is a captured level."""
        attempt = _attempt.get()
        if attempt is None or not attempt.settings.keeps(record.levelno):
            return
        if len(attempt.records) >= MAX_RECORDS:
            attempt.dropped += 1
            return
        try:
            attempt.records.append(_entry(record, attempt))
        except Exception:  # capture must never break the step
            self.handleError(record)


def _entry(record: logging.LogRecord, attempt: Attempt) -> dict[str, Any]:
    allowed = attempt.settings.metadata_filter
    metadata = {
        k: _json_safe(v)
        for k, v in record.__dict__.items()
        if k not in _RECORD_ATTRS and (allowed is None or k in allowed or k in STANDARD_FIELDS)
    }
    for name, value in attempt.metadata.items():  # the workflow's log_metadata, then ours
        if allowed is None or name in allowed or name in STANDARD_FIELDS:
            metadata.setdefault(name, value)
    for name in STANDARD_FIELDS:
        metadata[name] = attempt.metadata[name]
    trace_id, span_id = _trace_ids()
    entry: dict[str, Any] = {
        "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
        "severity_text": record.levelname,
        "severity_number": severity_number(record.levelno),
        "body": record.getMessage()[:MAX_MESSAGE],
        "logger": record.name,
        "trace_id": trace_id,
        "span_id": span_id,
        "metadata": metadata,
    }
    if record.exc_info and record.exc_info[0] is not None:
        entry["exception"] = logging.Formatter().formatException(record.exc_info)[:MAX_MESSAGE]
    return entry


class StepRecords(logging.Filter):
    """On the root logger's handlers: gives records made inside a step the attempt's metadata
    as attributes, and keeps the captured ones off the handler with ``console=False``."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the metadata (never overwriting an ``extra``); False for a hidden record."""
        attempt = _attempt.get()
        if attempt is None:
            return True
        for name, value in attempt.metadata.items():
            if name not in record.__dict__:
                setattr(record, name, value)
        return attempt.settings.console or not attempt.settings.keeps(record.levelno)


_handler = CaptureHandler(level=logging.NOTSET)
_step_records = StepRecords()


def _install_handlers() -> None:
    # Checked at every attempt: a Celery worker replaces the root logger's handlers at boot.
    # A filter on the handlers, not a record factory, adds the metadata: a factory's attributes
    # would make ``extra={"step": ...}`` in users' own calls raise KeyError.
    root = logging.getLogger()
    if _handler not in root.handlers:
        root.addHandler(_handler)
    for handler in root.handlers:
        if handler is not _handler and _step_records not in handler.filters:
            handler.addFilter(_step_records)


def step_metadata(
    workflow: Any, run_id: str, step: str, attempt: int, data: dict[str, Any]
) -> dict[str, Any]:
    """The metadata of an attempt's records: the four standard fields and ``log_metadata``."""
    extra: dict[str, Any] = {}
    make: Callable[[dict[str, Any]], Any] | None = getattr(workflow, "log_metadata", None)
    if make is not None:
        try:
            given = make(dict(data))
            if isinstance(given, Mapping):
                extra = {str(k): _json_safe(v) for k, v in given.items()}
        except Exception:  # a broken log_metadata must not fail the step
            logging.getLogger("durable_celery").exception("durable: log_metadata of %s failed", workflow.name)
    return {**extra, "workflow": workflow.name, "workflow_id": run_id, "step": step, "attempt": attempt}


@contextmanager
def capture(settings: LogCapture, metadata: dict[str, Any]) -> Iterator[Attempt]:
    """Capture the records logged in this context while the block runs."""
    attempt = Attempt(settings, metadata)
    if settings.enabled:
        _install_handlers()
    token = _attempt.set(attempt)
    try:
        yield attempt
    finally:
        _attempt.reset(token)


def bind(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so a thread you start inside a step logs (and is captured) as that step."""
    context = copy_context()

    def bound(*args: Any, **kwargs: Any) -> Any:
        return context.copy().run(fn, *args, **kwargs)

    return bound
