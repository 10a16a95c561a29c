"""``fork``: a new run of a finished run's workflow that begins at a chosen step, on today's
definition, with the context the original's step found (or a given one).

Nothing is replayed: the steps before ``from_step`` are not run again, and the fork starts
from the step as it is defined now, so forking is safe whatever changed in the code since.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import InvalidStart, NotFinished
from ..inputs import check_input
from ..store import activity_rows, control_rows
from ..store.schema import FINISHED
from .control import _run, after_commit
from .keys import start_run
from .queues import queue_of
from .runs import new_run

if TYPE_CHECKING:
    from ..definition import Step, Workflow
    from .runtime import Runtime

KEEP: Any = type("Keep", (), {"__repr__": lambda self: "KEEP"})()  # fork's key: the original's


def fork(
    rt: Runtime,
    run_id: str,
    from_step: str | int,
    *,
    input: Mapping[str, Any] | None = None,
    context: Mapping[str, Any] | None = None,
    key: Any = KEEP,
    by: str | None = None,
    origin: str | None = None,
) -> str:
    """Start a run at ``from_step`` of finished run ``run_id``'s workflow; its id. The fork takes
    the original's key (``key=KEEP``) only if it is free (else KeyTaken), another key, or none
    (``key=None``); it keeps the original's tags and names it in ``forked_from``."""
    with rt.db.engine.connect() as conn:
        run = _run(conn, run_id)
        if run.status not in FINISHED:
            raise NotFinished(f"run {run_id} is {run.status}: fork a run once it has ended (cancel it first)")
        workflow = rt.registry.resolve(run.workflow)
        step = step_of(workflow, from_step)
        data = check_input(run.input if input is None else input, rt.settings.max_input_bytes)
        found = None if context is not None else control_rows.context_found(conn, run_id, step.index)
    begin = _begin_context(run, step, context, found)
    # The original's key as it was, none, or the one given (checked as a start's).
    fork_key = run.key if key is KEEP else None if key is None else workflow.derive_key(data, key)
    fresh = new_run(
        rt.default_queue(), workflow, data, fork_key, run.tags, run.priority, rt.settings.priority_aging
    )
    fresh.update(
        step_index=step.index,
        step_name=step.name,
        context=begin,
        forked_from=run_id,
        queue=queue_of(rt.default_queue(), workflow, step.index),
    )
    rt.instrumentation.stamp_run(workflow, fresh)
    decision = start_run(rt, workflow, fresh, "error", fold=False)
    if decision.created:
        with rt.db.begin() as conn:
            details = {"fork": decision.run_id, "from_step": step.name, "by": by, "origin": origin}
            activity_rows.record_txn(rt.db, conn, "forked", run_id, run.workflow, run.key, details)
    after_commit(rt, decision)
    return decision.run_id


def step_of(workflow: Workflow, from_step: Any) -> Step:
    """The step named (or at the index) ``from_step`` in today's definition; InvalidStart if none."""
    for step in workflow.steps:
        if from_step in (step.name, step.index) and not isinstance(from_step, bool):
            return step
    names = ", ".join(repr(s.name) for s in workflow.steps)
    raise InvalidStart(f"workflow {workflow.name!r} has no step {from_step!r} now (its steps: {names})")


def _begin_context(run: Any, step: Step, given: Mapping[str, Any] | None, found: Any) -> dict[str, Any]:
    """The fork's context: the one given; else the one the original's last attempt of the step
    found; else, for the step it stopped at or the first, the run's context or none."""
    if given is not None:
        if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
            raise InvalidStart("context must be a mapping with str keys")
        return dict(check_input(given))
    if found is not None:
        return dict(found[0] or {})
    if step.index == run.step_index:
        return dict(run.context or {})
    if step.index == 0:
        return {}
    raise InvalidStart(
        f"run {run.id} never ran step {step.name!r}, so the context it would have found is not "
        "known: give context="
    )
