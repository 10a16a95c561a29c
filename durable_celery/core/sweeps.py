"""The sweeps, one pass each (``*_once``): stale locks, workflow timeouts, missed wake-ups,
children of cancelled parents, queue samples and the activity trim. A worker's upkeep runs them
on its threads; a Fake and eager mode between steps; ``durable doctor --fix`` once.

Each pass returns what it did, ends every run with an update that only matches while it is
still stale or overdue (so any number of nodes may run it), and keeps the key rules.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from .. import signals
from ..store import activity_rows, child_rows, doctor_rows, sweep_rows
from . import queues
from .control import after_commit, cancel
from .keys import end_run_txn

if TYPE_CHECKING:
    from ..store.db import Database
    from .runtime import Runtime

log = logging.getLogger("durable_celery")

BATCH = 500  # runs one pass takes at most
SAMPLE_INTERVAL = 60.0
ACTIVITY_KEPT = timedelta(days=7)  # activity entries older than this are trimmed


def sweep_stale_once(rt: Runtime) -> tuple[list[str], list[str]]:
    """Hand back runs whose worker vanished; fail those lost too often. Returns both lists."""
    s, db = rt.settings, rt.db
    error = {
        "type": "WorkerLost",
        "message": f"the run's worker was lost {s.max_losses} times during one step",
        "traceback": None,
    }
    handed_back: list[str] = []
    failed: list[str] = []
    with db.engine.connect() as conn:
        stale = sweep_rows.stale_runs(db, conn, s.stale_lock_timeout, BATCH)
    for run in stale:
        lost_for_good = run.losses + 1 >= s.max_losses
        fail_with = error if lost_for_good else None

        def take_back(conn: Connection, run: Any = run, fail_with: Any = fail_with) -> bool:
            if not sweep_rows.take_back_stale_txn(db, conn, run, s.stale_lock_timeout, fail_with):
                return False
            details = {"locked_by": run.locked_by, "losses": run.losses + 1, "failed": fail_with is not None}
            activity_rows.record_txn(db, conn, "stale_recovered", run.id, run.workflow, run.key, details)
            return True

        if lost_for_good:
            ended = "compensation_failed" if run.status == "compensating" else "failed"
            if _end(rt, run, ended, take_back):
                failed.append(run.id)
            continue
        with db.begin() as conn:
            if take_back(conn):
                handed_back.append(run.id)
    if handed_back or failed:  # the relay sends the handed-back runs at its next pass
        log.warning("durable: recovered %d stale run(s), failed %d", len(handed_back), len(failed))
        signals.stale_recovered.send(sender=rt.sender, run_ids=handed_back, failed_ids=failed)
    return handed_back, failed


def wake_missed_once(rt: Runtime) -> int:
    """Make due the waiting runs whose event is kept for them (or whose children all finished)
    but that were never woken; returns how many. A safety net: the wake-up is normally sent in
    the same transaction as the event."""
    db = rt.db
    with db.engine.connect() as conn:
        missed = doctor_rows.missed_wakeups(conn, BATCH)
    woken = 0
    for row in missed:
        with db.begin() as conn:
            woken += doctor_rows.wake_missed_txn(db, conn, row.id)
    if woken:
        log.warning("durable: woke %d waiting run(s) that missed their wake-up", woken)
    return woken


def cancel_orphans_once(rt: Runtime) -> list[str]:
    """Cancel unfinished children of cancelled parents (a cancel whose process died before it
    reached every child); returns their ids."""
    with rt.db.engine.connect() as conn:
        orphans = child_rows.orphans(conn, BATCH)
    cancelled = [row.id for row in orphans if cancel(rt, row.id)]
    if cancelled:
        log.warning("durable: cancelled %d child run(s) of cancelled parents", len(cancelled))
    return cancelled


def fail_overdue_once(rt: Runtime) -> list[str]:
    """Fail runs past their workflow timeout; returns their ids."""
    db = rt.db
    with db.engine.connect() as conn:
        overdue = sweep_rows.overdue_runs(db, conn, BATCH)
    failed = []
    for run in overdue:
        timeout = getattr(rt.registry.workflows.get(run.workflow), "timeout", None)
        error = {
            "type": "WorkflowTimeout",
            "traceback": None,
            "message": f"the run did not finish within its timeout of {timeout}s",
        }

        def fail(conn: Connection, run: Any = run, error: Any = error) -> bool:
            return sweep_rows.fail_overdue_txn(db, conn, run.id, error)

        if _end(rt, run, "failed", fail):
            failed.append(run.id)
    return failed


def _end(rt: Runtime, run: Any, status: str, end: Any) -> bool:
    """Finish one run in its own transaction, keeping the key rules; True if it was ended."""
    with rt.db.begin() as conn:
        done, settled = end_run_txn(rt, conn, run, status, end)
    if done:
        signals.run_finished.send(sender=rt.sender, run_id=run.id, workflow=run.workflow, status=status)
    if settled is not None:
        after_commit(rt, settled)
    return done


def sample_queues_once(rt: Runtime) -> bool:
    """Write this minute's per-queue sample unless another node did; True if this one wrote."""
    return queues.sample_once(rt, SAMPLE_INTERVAL)


def trim_activity_once(db: Database) -> int:
    """Delete activity entries older than a week; returns how many."""
    with db.begin() as conn:
        return activity_rows.trim_txn(conn, db.utcnow() - ACTIVITY_KEPT)
