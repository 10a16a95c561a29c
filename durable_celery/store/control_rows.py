"""Statements of the operator's actions on one run (core/control.py) that no other module shares."""

from __future__ import annotations

from sqlalchemy import Connection, update

from .db import Database
from .schema import runs


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
