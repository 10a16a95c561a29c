"""Statements that delete finished runs (steps, events and held keys go with them by cascade)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, select

from .db import Database
from .schema import FINISHED, events, runs, steps


def _old_finished(db: Database, statuses: Sequence[str], older_than: float) -> Any:
    # Only finished statuses ever reach here (the caller checks), and finished_at < cutoff
    # implies finished_at IS NOT NULL, so PostgreSQL uses the partial ix_durable_runs_finished.
    assert set(statuses) <= set(FINISHED), statuses
    return (runs.c.status.in_(list(statuses)), runs.c.finished_at < db.later(-older_than))


def delete_finished_batch_txn(
    db: Database, conn: Connection, statuses: Sequence[str], older_than: float, limit: int
) -> int:
    """Delete up to ``limit`` runs in ``statuses`` finished over ``older_than`` seconds ago.

    Rows another transaction has locked are skipped (PostgreSQL), so several nodes can prune at
    once; SQLite serializes writers, so there the batch simply takes the first ``limit``.
    """
    chosen = (
        select(runs.c.id)
        .where(*_old_finished(db, statuses, older_than))
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    query = delete(runs).where(runs.c.id.in_(chosen.scalar_subquery()))
    return int(conn.execute(query).rowcount)


def count_finished(
    db: Database, conn: Connection, statuses: Sequence[str], older_than: float
) -> dict[str, int]:
    """How many runs, step rows and events a delete of these runs would remove (writes nothing)."""
    where = _old_finished(db, statuses, older_than)
    chosen = select(runs.c.id).where(*where)
    n_runs = conn.execute(select(func.count()).select_from(runs).where(*where)).scalar() or 0
    n_steps = conn.execute(select(func.count()).select_from(steps).where(steps.c.run_id.in_(chosen))).scalar()
    n_events = conn.execute(
        select(func.count()).select_from(events).where(events.c.run_id.in_(chosen))
    ).scalar()
    return {"runs": int(n_runs), "steps": int(n_steps or 0), "events": int(n_events or 0)}
