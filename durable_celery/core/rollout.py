"""Rolling out new code: a worker may get a step message for code it does not have.

A worker that lacks the whole workflow (an older build) hands the run back: it is due again in
``missing_code_retry`` seconds (30 by default), and only the relay of a node that knows the workflow sends it
then, so the run waits for a worker with the code until its timeout or a cancel.

A worker that knows the workflow but not the run's current step asks the other nodes: every
worker node writes the workflows and steps its code has on its row in ``durable_nodes``. When a
live node (seen within ``stale_lock_timeout``, not draining) has the step, this worker is the
older build of a rolling deploy (the step was added) or the newer one while old nodes still run
(the step was renamed): it hands the run back the same way, for a node with the step. When no
live node has it, the step was renamed or removed: the run fails with ``definition_changed``
(no compensation), and ``retry`` resumes it once the step is back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import signals
from ..store import activity_rows, node_rows, queries
from .control import after_commit
from .keys import end_run_txn

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("durable_celery")

PREFIX = "durable."


def definition_changed(workflow: str, step: str) -> dict[str, Any]:
    """The error a run gets when its current step is not in the workflow any more."""
    return {
        "type": "definition_changed",
        "message": f"workflow {workflow!r} has no step {step!r} any more; retry once it is back",
        "traceback": None,
    }


def handle_unknown_step(rt: Runtime, task_name: str, kwargs: dict[str, Any]) -> str | None:
    """A step message this worker has no task for: hand the run back or fail it. Returns what
    was done ('deferred', 'definition_changed'), or None when it was not for a durable run."""
    run_id, index = kwargs.get("run_id"), kwargs.get("step")
    if not task_name.startswith(PREFIX) or not isinstance(run_id, str) or not isinstance(index, int):
        return None
    workflow, _, step = task_name[len(PREFIX) :].rpartition(".")
    if workflow in rt.registry.workflows and not known_elsewhere(rt, workflow, step):
        return "definition_changed" if fail_changed(rt, run_id, workflow, step, index) else None
    return "deferred" if defer(rt, run_id, workflow, step, index) else None


def known_elsewhere(rt: Runtime, workflow: str, step: str) -> bool:
    """Does a live worker node (seen within ``stale_lock_timeout``, not draining) have ``step``
    of ``workflow`` in its code?"""
    with rt.db.engine.connect() as conn:
        rows = node_rows.live_node_steps(rt.db, conn, rt.settings.stale_lock_timeout)
    return any(step in ((row.steps or {}).get(workflow) or ()) for row in rows)


def defer(rt: Runtime, run_id: str, workflow: str, step: str, index: int) -> bool:
    """Hand an unclaimed run back for a node with its code: due again in
    ``missing_code_retry`` seconds (activity ``code_missing``)."""
    retry_in = rt.settings.missing_code_retry
    with rt.db.begin() as conn:
        if not queries.defer_unclaimed_txn(rt.db, conn, run_id, index, retry_in):
            return False
        details = {"step": step, "retry_in": retry_in}
        activity_rows.record_txn(rt.db, conn, "code_missing", run_id, workflow, None, details)
    log.warning(
        "durable: no code for step %r of workflow %r here; run %s handed back", step, workflow, run_id
    )
    return True


def fail_changed(rt: Runtime, run_id: str, workflow: str, step: str, index: int) -> bool:
    """Fail a run whose current step (``index``, named ``step``) is gone from its workflow."""
    error = definition_changed(workflow, step)
    with rt.db.begin() as conn:
        run = queries.fetch_run(conn, run_id)
        if run is None or run.step_index != index:
            return False
        done, settled = end_run_txn(
            rt,
            conn,
            run,
            "failed",
            lambda c: queries.fail_unclaimed_txn(rt.db, c, run_id, index, error),
        )
    if done:
        log.warning("durable: run %s failed: %s", run_id, error["message"])
        signals.run_finished.send(sender=rt.sender, run_id=run_id, workflow=workflow, status="failed")
    if settled is not None:
        after_commit(rt, settled)
    return done
