"""Statements on durable_activity: recording, listing, trimming and the key statistics."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Integer, cast, delete, func, insert, select

from .bounded import COUNT_CAP
from .db import Clock, Database
from .schema import activity, runs


def record_txn(
    db: Database,
    conn: Connection,
    kind: str,
    run_id: str | None,
    workflow: str | None,
    key: str | None,
    details: dict[str, Any],
) -> None:
    """Write one activity entry; ``details`` always carries the key and workflow."""
    values = {
        "kind": kind,
        "run_id": run_id,
        "workflow": workflow,
        "key": key,
        "details": {"key": key, "workflow": workflow, **details},
        "at": Clock(),
    }
    stmt, params = db.bind("activity", activity.c, values, lambda sv: insert(activity).values(**sv))
    conn.execute(stmt, params)


def list_activity(
    conn: Connection,
    kinds: Sequence[str] | None,
    run_id: str | None,
    workflow: str | None,
    limit: int,
    after: int | None = None,
) -> Sequence[Any]:
    """Activity entries, newest first (by id: the primary key's order); ``after``: past that id."""
    query = select(activity)
    if after is not None:
        query = query.where(activity.c.id < after)
    if kinds:
        query = query.where(activity.c.kind.in_(list(kinds)))
    if run_id is not None:
        query = query.where(activity.c.run_id == run_id)
    if workflow is not None:
        query = query.where(activity.c.workflow == workflow)
    return conn.execute(query.order_by(activity.c.id.desc()).limit(limit)).all()


def trim_txn(conn: Connection, before: datetime) -> int:
    """Delete activity older than ``before``."""
    return conn.execute(delete(activity).where(activity.c.at < before)).rowcount


def counts_by_key(
    conn: Connection, kind: str, workflow: str | None, since: datetime | None, limit: int | None
) -> Sequence[Any]:
    """(workflow, key, count) of one kind of activity per key, most first."""
    n = func.count().label("n")
    query = select(activity.c.workflow, activity.c.key, n).where(activity.c.kind == kind)
    if workflow is not None:
        query = query.where(activity.c.workflow == workflow)
    if since is not None:
        query = query.where(activity.c.at >= since)
    query = query.group_by(activity.c.workflow, activity.c.key).order_by(n.desc(), activity.c.key)
    return conn.execute(query.limit(limit) if limit else query).all()


KEY_KINDS = ("key_duplicate", "key_handed_off", "key_released", "key_retaken")


def _of_kind(kind: str, workflow: str | None, since: datetime, until: datetime | None = None) -> Any:
    """Entries of ``kind`` (of ``workflow``) from ``since`` (to ``until``): an index range of
    (kind, at), or of (workflow, kind, at) for one workflow."""
    query = select(activity.c.at).where(activity.c.kind == kind, activity.c.at >= since)
    if until is not None:
        query = query.where(activity.c.at < until)
    return query if workflow is None else query.where(activity.c.workflow == workflow)


def _capped(query: Any, cap: int) -> Any:
    """SQL: how many rows ``query`` gives, counting at most ``cap + 1``: read newest first from
    its index alone (in that order, no plan reads the table hoping to meet the cap early)."""
    newest = query.order_by(activity.c.at.desc()).limit(cap + 1).subquery()
    return select(func.count()).select_from(newest).scalar_subquery()


def key_counts(
    conn: Connection, workflow: str | None, since: datetime, cap: int = COUNT_CAP
) -> dict[str, int]:
    """Entries of each key kind since ``since``, each counted up to ``cap + 1``, in one statement
    that reads index entries only: the same few pages at any volume past the cap."""
    counts = [_capped(_of_kind(kind, workflow, since), cap).label(kind) for kind in KEY_KINDS]
    row = conn.execute(select(*counts)).one()
    return {kind: int(n or 0) for kind, n in zip(KEY_KINDS, row, strict=True)}


def readds_per_hour(
    conn: Connection, workflow: str | None, since: datetime, cap: int = COUNT_CAP
) -> dict[int, int]:
    """Re-adds since ``since`` per hour (hours since the epoch, UTC), of the newest ``cap + 1``:
    one index range read newest first, grouped."""
    newest = (
        _of_kind("key_duplicate", workflow, since).order_by(activity.c.at.desc()).limit(cap + 1).subquery()
    )
    if conn.dialect.name == "postgresql":
        hour: Any = func.floor(func.extract("epoch", newest.c.at) / 3600)
    else:  # SQLite keeps the time as UTC text
        hour = cast(func.strftime("%s", newest.c.at), Integer) // 3600
    query = select(hour.label("hour"), func.count().label("n")).group_by(hour)
    return {int(row.hour): int(row.n) for row in conn.execute(query)}


def newest_readds(conn: Connection, workflow: str | None, since: datetime, count: int) -> Sequence[Any]:
    """The newest ``count`` re-adds since ``since`` (``workflow``, ``key``, ``outcome``,
    ``input_changed``): what the statistics break down by outcome and key."""
    query = (
        select(
            activity.c.workflow,
            activity.c.key,
            activity.c.details["outcome"].as_string().label("outcome"),
            activity.c.details["input_changed"].as_boolean().label("input_changed"),
        )
        .where(activity.c.kind == "key_duplicate", activity.c.at >= since)
        .order_by(activity.c.at.desc())
        .limit(count)
    )
    if workflow is not None:
        query = query.where(activity.c.workflow == workflow)
    return conn.execute(query).all()


def runs_per_key(conn: Connection, workflow: str | None, pairs: Sequence[tuple[str, str]]) -> dict[Any, int]:
    """How many runs each (workflow, key) was used by."""
    if not pairs:
        return {}
    names = sorted({w for w, _ in pairs})
    query = (
        select(runs.c.workflow, runs.c.key, func.count())
        .where(runs.c.workflow.in_(names), runs.c.key.in_(sorted({k for _, k in pairs})))
        .group_by(runs.c.workflow, runs.c.key)
    )
    return {(w, k): n for w, k, n in conn.execute(query)}
