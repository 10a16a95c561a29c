"""Which runs a filter names (``list_runs``, ``bulk``): one place turns it into conditions, and
bulk actions walk the matches by run id in pages (keyset: no OFFSET, no long transaction)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, func, literal, select
from sqlalchemy.dialects.postgresql import JSONB

from .db import Database
from .schema import runs


@dataclass(frozen=True)
class RunFilter:
    """Runs of a workflow, in some statuses, by key or key prefix, carrying tags, created in a
    time window, or failed with an error type; unset fields match every run."""

    workflow: str | None = None
    statuses: tuple[str, ...] | None = None
    key: str | None = None
    key_prefix: str | None = None
    tags: dict[str, str] | None = None
    since: datetime | None = None
    until: datetime | None = None
    error_type: str | None = None

    def conditions(self, db: Database) -> list[Any]:
        """The filter as SQL conditions on ``durable_runs``."""
        found: list[Any] = []
        if self.workflow is not None:
            found.append(runs.c.workflow == self.workflow)
        if self.statuses is not None:
            found.append(runs.c.status.in_(self.statuses))
        if self.key is not None:
            found.append(runs.c.key == self.key)
        if self.key_prefix is not None:
            escaped = self.key_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            found.append(runs.c.key.like(escaped + "%", escape="\\"))
        if self.since is not None:
            found.append(runs.c.created_at >= self.since)
        if self.until is not None:
            found.append(runs.c.created_at < self.until)
        if self.tags:
            found.append(_tagged(db, self.tags))
        if self.error_type is not None:
            found.append(runs.c.error["type"].as_string() == self.error_type)
        return found


def _tagged(db: Database, tags: dict[str, str]) -> Any:
    """Runs carrying every one of ``tags``: containment on PostgreSQL (its GIN index)."""
    if db.is_postgres:
        return runs.c.tags.op("@>")(literal(tags, type_=JSONB()))
    return and_(*(runs.c.tags[name].as_string() == value for name, value in tags.items()))


def conditions_at_volume(db: Database, conn: Connection, where: RunFilter) -> list[Any]:
    """``where``'s conditions, and for a key without a workflow the workflows that have runs
    (a loose scan of a few index pages): ix_durable_runs_workflow_key leads with the workflow,
    so a key alone would read the whole index."""
    found = where.conditions(db)
    if where.key is not None and where.workflow is None:
        from .dashboard_rows import workflow_names

        found.append(runs.c.workflow.in_(workflow_names(conn) or [""]))
    return found


def matching_ids(
    db: Database, conn: Connection, where: RunFilter, after: str | None, limit: int
) -> Sequence[str]:
    """The next ``limit`` ids of runs matching ``where`` past ``after``, in id (start) order."""
    query = select(runs.c.id).where(*where.conditions(db))
    if after is not None:
        query = query.where(runs.c.id > after)
    return list(conn.execute(query.order_by(runs.c.id).limit(limit)).scalars())


def count_matching(db: Database, conn: Connection, where: RunFilter, cap: int) -> int:
    """How many runs match, counted up to ``cap`` (``cap + 1`` means more)."""
    inner = select(runs.c.id).where(*where.conditions(db)).limit(cap + 1).subquery()
    return int(conn.execute(select(func.count()).select_from(inner)).scalar() or 0)


def newest_matching(db: Database, conn: Connection, where: RunFilter) -> str | None:
    """The id of the newest run matching ``where``, or None."""
    query = select(runs.c.id).where(*where.conditions(db)).order_by(runs.c.id.desc()).limit(1)
    return conn.execute(query).scalar()
