"""Steps run in the calling thread: ``testing.Fake.run_until_idle()`` and eager mode.

The runner takes due runs from the database, as a worker takes messages, and hands each to
``Engine.execute``: the same claim, fencing, recording and key rules as a worker, minus the
broker. Nothing is published while it runs (``Durable.inline``); each step's record makes the
next one due, and the runner picks it up on its next pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DurableError
from ..store import queries
from .flow import wake_slots_once
from .sweeps import cancel_orphans_once, fail_overdue_once, wake_missed_once

if TYPE_CHECKING:
    from .engine import Engine
    from .runtime import Runtime

MAX_STEPS = 10_000  # a workflow that never goes idle (a step snoozing 0 s forever) is stopped
BATCH = 100


def run_due(engine: Engine, *, only: list[str] | None = None, max_steps: int = MAX_STEPS) -> int:
    """Run every due step until none is due; returns how many ran.

    With ``only``, just those runs and the children they start; else every run, with the
    upkeep sweeps (workflow timeouts, missed wake-ups, children of cancelled parents) between
    passes. DurableError after ``max_steps`` steps.
    """
    rt = engine.rt
    tracked = set(only) if only is not None else None
    ran = 0
    while True:
        swept = sweep(rt) if tracked is None else 0
        with rt.db.engine.connect() as conn:
            due = queries.due_now(rt.db, conn, BATCH, list(rt.registry.workflows), tracked)
        if not due and not swept:
            return ran
        for row in due:
            if tracked is not None:
                tracked.add(row.id)
            if ran >= max_steps:
                raise DurableError(f"still not idle after {max_steps} steps (run {row.id} is due again)")
            workflow = rt.registry.workflows[row.workflow]
            step = workflow.steps[row.step_index]
            engine.execute(workflow, step, row.id, compensate=row.status == "compensating")
            ran += 1


def sweep(rt: Runtime) -> int:
    """One pass of the upkeep sweeps a worker makes: workflow timeouts, missed wake-ups,
    children of cancelled parents; returns how many runs they changed."""
    changed = len(fail_overdue_once(rt)) + wake_missed_once(rt) + wake_slots_once(rt)
    return changed + len(cancel_orphans_once(rt))


def run_eagerly(engine: Engine, run_id: str) -> int:
    """Eager mode (``task_always_eager``): run this run's steps, and its children's, until it
    finishes or waits; returns how many steps ran."""
    return run_due(engine, only=[run_id])
