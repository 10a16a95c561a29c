"""What the sweeps of the worker's upkeep (core/sweeps.py) read and write: runs whose worker
stopped beating, and runs past their workflow timeout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from .db import Database
from .queries import HELD
from .schema import runs


def stale_runs(db: Database, conn: Connection, stale_after: float, limit: int) -> Sequence[Any]:
    """Runs locked by a worker that has not heart-beaten for ``stale_after`` seconds."""
    query = (
        select(
            runs.c.id,
            runs.c.workflow,
            runs.c.key,
            runs.c.fence,
            runs.c.losses,
            runs.c.status,
            runs.c.parent_id,
            runs.c.locked_by,
        )
        .where(
            runs.c.locked_by.is_not(None),
            runs.c.heartbeat_at < db.later(-stale_after),
            runs.c.status.in_(HELD),
        )
        .limit(limit)
    )
    return conn.execute(query).all()


def take_back_stale_txn(
    db: Database, conn: Connection, run: Any, stale_after: float, fail_with: dict[str, Any] | None
) -> bool:
    """Hand a stale run back (or fail it with ``fail_with``), fencing out the lost worker.

    Conditional on the lock still being the stale one, so only one node wins.
    """
    values: dict[str, Any] = {
        "locked_by": None,
        "heartbeat_at": None,
        "fence": runs.c.fence + 1,
        "losses": runs.c.losses + 1,
    }
    if fail_with is None:
        values.update(due_at=db.now(), published=False)
    else:
        status = "compensation_failed" if run.status == "compensating" else "failed"
        values.update(status=status, error=fail_with, finished_at=db.now(), due_at=None)
    query = (
        update(runs)
        .where(
            runs.c.id == run.id,
            runs.c.fence == run.fence,
            runs.c.locked_by == run.locked_by,
            runs.c.heartbeat_at < db.later(-stale_after),
        )
        .values(**values)
    )
    return bool(conn.execute(query).rowcount == 1)


def overdue_runs(db: Database, conn: Connection, limit: int) -> Sequence[Any]:
    """Unfinished runs past their workflow timeout."""
    query = (
        select(runs.c.id, runs.c.workflow, runs.c.key, runs.c.parent_id)
        .where(
            runs.c.deadline_at < db.now(),
            runs.c.finished_at.is_(None),
            runs.c.status.in_(("pending", "running", "waiting")),
        )
        .limit(limit)
    )
    return conn.execute(query).all()


def fail_overdue_txn(db: Database, conn: Connection, run_id: str, error: dict[str, Any]) -> bool:
    """Fail a run past its workflow timeout (if it still is); a running step stops at its next
    heartbeat and cannot record."""
    query = (
        update(runs)
        .where(
            runs.c.id == run_id,
            runs.c.deadline_at < db.now(),
            runs.c.status.in_(("pending", "running", "waiting")),
        )
        .values(
            status="failed",
            error=error,
            finished_at=db.now(),
            due_at=None,
            locked_by=None,
            heartbeat_at=None,
        )
    )
    return bool(conn.execute(query).rowcount == 1)
