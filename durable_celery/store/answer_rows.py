"""What a caller waiting for runs reads (core/answers.py): which of them have ended, in one
statement for every run waited on in the process; and the progress a running step tells them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from .schema import FINISHED, runs


def ended_of(conn: Connection, run_ids: Sequence[str]) -> dict[str, str]:
    """Of ``run_ids``, those that have ended, with their status."""
    query = select(runs.c.id, runs.c.status).where(runs.c.id.in_(run_ids), runs.c.status.in_(FINISHED))
    return {row.id: row.status for row in conn.execute(query)}


def present_of(conn: Connection, run_ids: Sequence[str]) -> set[str]:
    """Of ``run_ids``, those that still exist (the others were pruned, or never were)."""
    return {row.id for row in conn.execute(select(runs.c.id).where(runs.c.id.in_(run_ids)))}


def set_progress(conn: Connection, run_id: str, fence: int, holder: str, value: Any) -> bool:
    """Keep ``value`` as the run's progress, if the step telling it still holds the run."""
    held = (runs.c.id == run_id, runs.c.fence == fence, runs.c.locked_by == holder)
    done = conn.execute(update(runs).where(*held).values(progress=value))
    return bool(done.rowcount)
