"""Statements for watching: the ready backlog, recent outcomes, nodes, schedules and traces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, case, func, literal, or_, select, union_all, update

from .db import Database
from .queries import RELAYED
from .schema import FINISHED, UNFINISHED, nodes, runs, schedules


def ready_by_workflow(db: Database, conn: Connection) -> Sequence[Any]:
    """Per workflow: runs due and unlocked (the ready backlog), and since when the oldest waits.

    A run no worker has started waits since it was created; a started one since its current
    step was last sent (``due_at``; the relay moves it on each re-send, so it only grows past
    ``relay_after`` when no upkeep runs).
    """
    waiting_since = case((runs.c.started_at.is_(None), runs.c.created_at), else_=runs.c.due_at)
    query = (
        select(runs.c.workflow, func.count().label("ready"), func.min(waiting_since).label("oldest"))
        .where(runs.c.due_at <= db.now(), runs.c.locked_by.is_(None), runs.c.status.in_(RELAYED))
        .group_by(runs.c.workflow)
    )
    return conn.execute(query).all()


def unfinished_by_workflow(conn: Connection) -> Sequence[Any]:
    """Per workflow and unfinished status: how many runs."""
    query = (
        select(runs.c.workflow, runs.c.status, func.count().label("n"))
        .where(runs.c.status.in_(UNFINISHED))
        .group_by(runs.c.workflow, runs.c.status)
    )
    return conn.execute(query).all()


def finished_since(db: Database, conn: Connection, seconds: float) -> Sequence[Any]:
    """Per workflow and final status: runs that finished in the last ``seconds``."""
    query = (
        select(runs.c.workflow, runs.c.status, func.count().label("n"))
        .where(
            runs.c.status.in_(FINISHED),  # lets ix_durable_runs_finished (status, finished_at) serve it
            runs.c.finished_at.is_not(None),
            runs.c.finished_at >= db.later(-seconds),
        )
        .group_by(runs.c.workflow, runs.c.status)
    )
    return conn.execute(query).all()


def stale_lock_count(db: Database, conn: Connection, stale_after: float) -> int:
    """How many runs are locked by a worker silent for ``stale_after`` seconds."""
    return int(conn.execute(_stale_locks(db, stale_after)).scalar() or 0)


def _stale_locks(db: Database, stale_after: float) -> Any:
    return select(func.count()).where(
        runs.c.locked_by.is_not(None),
        or_(runs.c.heartbeat_at.is_(None), runs.c.heartbeat_at < db.later(-stale_after)),
    )


def disabled_schedules(conn: Connection) -> Sequence[Any]:
    """Schedules turned off (by failures in a row, or by hand), by name."""
    query = (
        select(
            schedules.c.name,
            schedules.c.workflow,
            schedules.c.key,
            schedules.c.failures,
            schedules.c.last_outcome,
            schedules.c.disabled_at,
        )
        .where(schedules.c.enabled.is_(False))
        .order_by(schedules.c.name)
    )
    return conn.execute(query).all()


def stale_and_draining(db: Database, conn: Connection, stale_after: float) -> tuple[int, int]:
    """In one statement: runs locked by a worker silent for ``stale_after`` seconds, and worker
    nodes seen within that time that are shutting down gracefully (draining)."""
    stale = _stale_locks(db, stale_after).scalar_subquery()
    draining = select(func.count()).where(
        nodes.c.draining.is_(True), nodes.c.seen_at >= db.later(-stale_after)
    )
    row = conn.execute(select(stale, draining.scalar_subquery())).one()
    return int(row[0] or 0), int(row[1] or 0)


def list_nodes(conn: Connection) -> Sequence[Any]:
    """Worker nodes seen by their heartbeats, most recently seen first."""
    return conn.execute(select(nodes).order_by(nodes.c.seen_at.desc())).all()


COUNT_CAP = 10_000  # runs counted per status at most, by status_counts


def status_counts(conn: Connection, cap: int = COUNT_CAP) -> dict[str, int]:
    """Runs per status, each count stopping at ``cap`` (an index range per status, never a
    scan of every run: finished runs may be millions)."""
    parts = []
    for status in (*UNFINISHED, *FINISHED):
        # Ordered as ix_durable_runs_status_created is: else a status most runs have would be
        # counted by a sequential scan that stops at the cap.
        capped = (
            select(literal(1).label("one"))
            .where(runs.c.status == status)
            .order_by(runs.c.created_at)
            .limit(cap)
            .subquery()
        )
        parts.append(select(literal(status).label("status"), func.count().label("n")).select_from(capped))
    return {row.status: int(row.n) for row in conn.execute(union_all(*parts))}


def set_trace_parent_if_unset(conn: Connection, run_id: str, trace_parent: str) -> None:
    """Give a run its trace (W3C traceparent), unless it has one."""
    conn.execute(
        update(runs)
        .where(and_(runs.c.id == run_id, runs.c.trace_parent.is_(None)))
        .values(trace_parent=trace_parent)
    )


def trace_parent_of(conn: Connection, run_id: str) -> str | None:
    """The W3C traceparent stored on a run, or None."""
    return conn.execute(select(runs.c.trace_parent).where(runs.c.id == run_id)).scalar()
