"""Inline continuation: a worker that finishes a step runs the run's next step itself.

When a step completes and the next one is due now, on the queue this message came from, and
the worker is not shutting down, the statement that records the step also claims the next one
for this worker (the fence moves, ``locked_by`` stays this worker's, unless the queue is
paused: then the run is left due for the resume, with no message). The next step then runs in
the same task execution: no publish, no delivery, no claim round trip. Everything else is as
for a published step: its own recorded attempt, span, log capture, signals, heartbeat,
timeout and retry, and its own task in Flower (task events are sent for it, task_states.py).

A failure, a wait, a snooze, a compensation, another queue, a paused queue or a shutdown ends
the chain: the next message is published as before. A budget keeps a worker slot fair: at
most ``inline_steps`` steps or ``inline_seconds`` seconds per message, then the next step is
published and waits its turn in the queue behind other runs. ``inline_steps=0`` turns it off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ..store.queries import GoOn


@dataclass
class Budget:
    """What one message may still run inline, and the step it claimed to run next."""

    node: str
    queue: str
    steps_left: int
    deadline: float  # time.monotonic()
    next_row: Any = None


_budget: ContextVar[Budget | None] = ContextVar("durable_inline_budget", default=None)


@contextmanager
def budget(node: str, queue: str | None, steps: int, seconds: float) -> Iterator[Budget | None]:
    """What the message handled in the block may run inline (None: nothing, with no queue or
    ``steps`` 0)."""
    given = Budget(node, queue, steps, time.monotonic() + seconds) if steps > 0 and queue else None
    token = _budget.set(given)
    try:
        yield given
    finally:
        _budget.reset(token)


def go_on(shutting_down: Callable[[], bool], status: str, run_values: dict[str, Any]) -> GoOn | None:
    """Whether recording this step should claim the next one for this worker."""
    budget = _budget.get()
    if budget is None or status != "running" or not run_values.get("published"):
        return None
    if budget.steps_left <= 0 or time.monotonic() >= budget.deadline or shutting_down():
        return None
    if run_values.get("queue") != budget.queue:
        return None  # its queue may be another worker's: send it there
    return GoOn(budget.node, budget.queue)


def claimed(row: Any, go_on: GoOn) -> None:
    """Keep the next step's claim when the record took it (not when its queue was paused)."""
    budget = _budget.get()
    if budget is not None and row is not None and getattr(row, "locked_by", None) == go_on.node:
        budget.next_row = row


def take_claimed() -> Any:
    """The next step this message claimed (once), or None."""
    budget = _budget.get()
    if budget is None or budget.next_row is None:
        return None
    row, budget.next_row = budget.next_row, None
    return row
