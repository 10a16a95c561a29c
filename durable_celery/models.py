"""Plain records returned to users: runs and recorded step attempts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

from .store.schema import FINISHED


def aware(value: datetime | None) -> datetime | None:
    """``value`` with UTC attached if naive (SQLite hands back naive datetimes; all are UTC)."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


@dataclass(frozen=True)
class Run:
    """One run of a workflow, as stored."""

    id: str
    workflow: str
    status: str
    input: dict[str, Any]
    context: dict[str, Any]
    output: Any
    error: dict[str, Any] | None
    key: str | None
    holds_key: bool
    runs_after_id: str | None
    parent_id: str | None
    attempt: int
    step_index: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # What the running step last said of its progress (current_run().set_progress), or None.
    progress: Any = None
    # Its tags (str to str; copied to its children and to the runs rerun and fork make), and
    # the run it was forked from (durable.fork).
    tags: dict[str, str] = field(default_factory=dict)
    forked_from: str | None = None
    # Among runs waiting for the same flow limit, higher goes first (0 the default).
    priority: int = 0
    # A batch workflow's run: the batch key its starts were gathered by (input ``{"items": [...]}``).
    batch_key: str | None = None

    @property
    def finished(self) -> bool:
        """True once the run has reached a final status."""
        return self.status in FINISHED

    @classmethod
    def from_row(cls, row: Any) -> Run:
        """Build from a ``durable_runs`` row."""
        data = row._mapping
        values = {f.name: data[f.name] for f in fields(cls)}
        values["tags"] = values["tags"] or {}
        values["priority"] = values["priority"] or 0
        for name in ("created_at", "started_at", "finished_at"):
            values[name] = aware(values[name])
        return cls(**values)


@dataclass(frozen=True)
class StepRecord:
    """One recorded attempt of one step."""

    run_id: str
    step_index: int
    name: str
    attempt: int
    status: str
    input: dict[str, Any] | None
    output: Any
    error: dict[str, Any] | None
    worker: str | None
    started_at: datetime
    finished_at: datetime
    # "step" for the step's own attempts, "compensate" for its compensation's.
    phase: str = "step"
    # Lines the attempt logged at a captured level (see logs.py); None when capture was off.
    logs: list[dict[str, Any]] | None = None
    # The step row's id: ``list_steps(run_id, after=step.id)`` goes on past it.
    id: int | None = None

    @classmethod
    def from_row(cls, row: Any, run_input: dict[str, Any] | None = None) -> StepRecord:
        """Build from a ``durable_steps`` row; ``input`` is ``run_input`` (the run's, which
        never changes during an attempt) unless the row kept its own (written by older versions)."""
        data = row._mapping
        values = {f.name: data[f.name] for f in fields(cls)}
        if values["input"] is None:
            values["input"] = run_input
        for name in ("started_at", "finished_at"):
            values[name] = aware(values[name])
        return cls(**values)
