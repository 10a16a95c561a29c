"""Statements that delete finished runs (steps, events and held keys go with them by cascade)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, any_, delete, exists, func, literal_column, or_, select

from .db import Database
from .schema import FINISHED, UNFINISHED, events, keys, runs, steps


def _old_finished(db: Database, statuses: Sequence[str], older_than: float) -> Any:
    # Only finished statuses ever reach here (the caller checks), and finished_at < cutoff
    # implies finished_at IS NOT NULL, so PostgreSQL uses the partial ix_durable_runs_finished.
    assert set(statuses) <= set(FINISHED), statuses
    # A child whose parent is still going stays: the parent's step finds it again on replay.
    parent = runs.alias("parent")
    live_parent = exists().where(parent.c.id == runs.c.parent_id, parent.c.status.in_(UNFINISHED))
    return (
        runs.c.status.in_(list(statuses)),
        runs.c.finished_at < db.later(-older_than),
        or_(runs.c.parent_id.is_(None), ~live_parent),
    )


def _no_jit(conn: Connection) -> None:
    """Turn JIT off for this transaction. A batch's estimated cost is far above
    ``jit_above_cost`` (a scan of every old run, the cascade), so PostgreSQL compiles it anew
    for every batch, the last (empty) one too: about 0.14 s each on a 2-core VM, a third of a
    20,000-run batch, for a plan that is a few index scans."""
    conn.exec_driver_sql("SET LOCAL jit = off")


def delete_finished_batch_txn(
    db: Database, conn: Connection, statuses: Sequence[str], older_than: float, limit: int
) -> tuple[int, int]:
    """Delete up to ``limit`` runs in ``statuses`` finished over ``older_than`` seconds ago.

    Returns (deleted, picked). On PostgreSQL rows another transaction holds are skipped, so
    several nodes prune at once, and the batch never waits for a lock: a start holds a key row
    before it locks the holder's row, so the pruner locks its runs, then their key rows, both
    with SKIP LOCKED, and leaves a run whose key row is busy for a later batch. SQLite
    serializes writers, so there one statement takes the first ``limit``.
    """
    if conn.dialect.name != "postgresql":
        chosen = select(runs.c.id).where(*_old_finished(db, statuses, older_than)).limit(limit)
        deleted = int(conn.execute(delete(runs).where(runs.c.id.in_(chosen.scalar_subquery()))).rowcount)
        return deleted, deleted
    _no_jit(conn)
    # One statement, so no id travels to the client and back: pick and lock the runs, lock the
    # key rows of those holding keys, delete the runs that hold none or whose key row is locked.
    # The delete finds its rows by their physical address (a TID scan), not by 20,000 lookups
    # in the primary key: they are locked, so no other transaction can move them meanwhile (a
    # row updated between this statement's snapshot and its lock is not visible at that
    # address to the delete, and waits for a later batch).
    holds = exists().where(keys.c.holder_id == runs.c.id).label("holds")
    tid: Any = literal_column("durable_runs.ctid")
    picked = (
        select(runs.c.id, tid.label("tid"), holds)
        .where(*_old_finished(db, statuses, older_than))
        .limit(limit)
        .with_for_update(of=runs, skip_locked=True)
        .cte("picked")
    )
    locked = (
        select(keys.c.holder_id)
        .where(keys.c.holder_id.in_(select(picked.c.id).where(picked.c.holds)))
        .with_for_update(skip_locked=True)
        .cte("locked")
    )
    chosen = select(picked.c.tid).where(or_(~picked.c.holds, picked.c.id.in_(select(locked.c.holder_id))))
    addresses = func.array(chosen.scalar_subquery())  # ARRAY(SELECT ...): one TID scan
    gone = delete(runs).where(tid == any_(addresses)).returning(runs.c.id).cte("gone")
    row = conn.execute(
        select(
            select(func.count()).select_from(gone).scalar_subquery(),
            select(func.count()).select_from(picked).scalar_subquery(),
        )
    ).one()
    return int(row[0]), int(row[1])


def count_finished(
    db: Database, conn: Connection, statuses: Sequence[str], older_than: float
) -> dict[str, int]:
    """How many runs, step rows and events a delete of these runs would remove (writes nothing)."""
    if conn.dialect.name == "postgresql":
        _no_jit(conn)
    where = _old_finished(db, statuses, older_than)
    chosen = select(runs.c.id).where(*where)
    n_runs = conn.execute(select(func.count()).select_from(runs).where(*where)).scalar() or 0
    n_steps = conn.execute(select(func.count()).select_from(steps).where(steps.c.run_id.in_(chosen))).scalar()
    n_events = conn.execute(
        select(func.count()).select_from(events).where(events.c.run_id.in_(chosen))
    ).scalar()
    return {"runs": int(n_runs), "steps": int(n_steps or 0), "events": int(n_events or 0)}
