"""Statements of the operator's actions on one run (core/control.py) that no other module shares."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update

from .db import Database
from .schema import activity, runs, steps


def resume_failed_txn(db: Database, conn: Connection, run_id: str, started: bool, attempt: int) -> bool:
    """A failed run goes on from its failed step as attempt ``attempt + 1``, due now (its message
    sent), its error and any wait of the failed attempt cleared; False if it is not failed (any
    more)."""
    resumed = conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.status == "failed")
        .values(
            status="running" if started else "pending",
            attempt=attempt + 1,
            attempt_base=attempt,
            deadline_at=None,
            losses=0,
            error=None,
            finished_at=None,
            due_at=db.now(),
            published=True,
            wait_name=None,  # the step starts afresh: no wait of the failed attempt is resumed
            wait_until=None,
        )
    )
    return bool(resumed.rowcount == 1)


def context_found(conn: Connection, run_id: str, step_index: int) -> tuple[Any] | None:
    """The context the run's last attempt of step ``step_index`` found, as a 1-tuple (its value
    None when it was empty), or None when the step never ran."""
    query = (
        select(steps.c.context)
        .where(steps.c.run_id == run_id, steps.c.step_index == step_index, steps.c.phase == "step")
        .order_by(steps.c.attempt.desc())
        .limit(1)
    )
    row = conn.execute(query).first()
    return None if row is None else (row.context,)


def acted_before(conn: Connection, run_id: str, kind: str, origin: str) -> bool:
    """Has an action from ``origin`` (a bulk action) already left a ``kind`` entry on the run?"""
    query = select(activity.c.id).where(
        activity.c.run_id == run_id,
        activity.c.kind == kind,
        activity.c.details["origin"].as_string() == origin,
    )
    return conn.execute(query.limit(1)).first() is not None
