"""Statements on durable_events and on the wait columns of durable_runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from .db import Database
from .schema import events, runs


def insert_event_txn(db: Database, conn: Connection, run_id: str, name: str, payload: Any) -> None:
    """Keep an event for a run."""
    conn.execute(insert(events).values(run_id=run_id, name=name, payload=payload, created_at=db.now()))


def wake_if_waiting_txn(db: Database, conn: Connection, run_id: str, name: str) -> Any:
    """Make a run that waits for ``name`` due now; returns what to publish, or None."""
    query = (
        update(runs)
        .where(runs.c.id == run_id, runs.c.status == "waiting", runs.c.wait_name == name)
        .values(due_at=db.now(), published=True)
        .returning(runs.c.workflow, runs.c.id, runs.c.step_index, runs.c.attempt, runs.c.key)
    )
    return conn.execute(query).first()


def receive_event_txn(conn: Connection, run_id: str, name: str) -> Any:
    """The event the run got for ``name``: the one received before, else the newest kept one,
    which becomes the received one. None when there is none."""
    received = conn.execute(
        select(events.c.payload, events.c.timed_out).where(
            events.c.run_id == run_id, events.c.name == name, events.c.received.is_(True)
        )
    ).first()
    if received is not None:
        return received
    newest = conn.execute(
        select(events.c.id, events.c.payload, events.c.timed_out)
        .where(events.c.run_id == run_id, events.c.name == name)
        .order_by(events.c.id.desc())
        .limit(1)
    ).first()
    if newest is None:
        return None
    conn.execute(update(events).where(events.c.id == newest.id).values(received=True))
    return newest


def record_timeout_txn(db: Database, conn: Connection, run_id: str, name: str) -> None:
    """Remember that the wait for ``name`` timed out, so a replay of the step sees the same."""
    conn.execute(
        insert(events).values(
            run_id=run_id,
            name=name,
            payload=None,
            received=True,
            timed_out=True,
            created_at=db.now(),
        )
    )


def has_event_txn(conn: Connection, run_id: str, name: str) -> bool:
    """Is an event of that name kept for the run?"""
    query = select(events.c.id).where(events.c.run_id == run_id, events.c.name == name).limit(1)
    return conn.execute(query).first() is not None


def park_txn(
    db: Database,
    conn: Connection,
    run_id: str,
    fence: int,
    holder: str,
    name: str,
    until_seconds: float | None,
) -> bool:
    """Park a running step's run until event ``name`` (or the timeout); False if fenced out.

    The kept-event check comes after the update, so an event sent meanwhile is never missed.
    """
    due = db.later(until_seconds) if until_seconds is not None else None
    parked = conn.execute(
        update(runs)
        .where(
            runs.c.id == run_id,
            runs.c.fence == fence,
            runs.c.locked_by == holder,
            runs.c.status == "running",
        )
        .values(
            status="waiting",
            wait_name=name,
            wait_until=due,
            due_at=due,
            published=False,
            locked_by=None,
            heartbeat_at=None,
        )
    ).rowcount
    if parked != 1:
        return False
    if has_event_txn(conn, run_id, name):
        conn.execute(update(runs).where(runs.c.id == run_id).values(due_at=db.now()))
    return True


def wait_left_txn(db: Database, conn: Connection, run_id: str) -> float | None:
    """Seconds before the run's current wait times out (0 or less: it has), on the database's
    clock; None when the wait has no timeout."""
    if db.is_postgres:
        query = select(func.extract("epoch", runs.c.wait_until - func.now())).where(runs.c.id == run_id)
        left = conn.execute(query).scalar()
        return None if left is None else float(left)
    until = conn.execute(select(runs.c.wait_until).where(runs.c.id == run_id)).scalar()
    if until is None:
        return None
    if until.tzinfo is None:  # SQLite hands back naive UTC
        from datetime import timezone

        until = until.replace(tzinfo=timezone.utc)
    return float((until - db.utcnow()).total_seconds())
