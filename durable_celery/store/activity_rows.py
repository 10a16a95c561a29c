"""Statements on durable_activity: recording, listing, trimming and the key statistics."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, union_all

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


def key_activity(
    conn: Connection, workflow: str | None, since: datetime, cap: int = COUNT_CAP
) -> Sequence[Any]:
    """The newest ``cap + 1`` entries of each key kind since ``since`` (``kind``, ``workflow``,
    ``key``, ``outcome``, ``input_changed``, ``at``), for the key statistics: each kind an
    index range of (kind, at), read newest first and stopped at the cap."""
    parts = []
    for kind in KEY_KINDS:
        query = select(
            activity.c.kind,
            activity.c.workflow,
            activity.c.key,
            activity.c.details["outcome"].as_string().label("outcome"),
            activity.c.details["input_changed"].as_boolean().label("input_changed"),
            activity.c.at,
        ).where(activity.c.kind == kind, activity.c.at >= since)
        if workflow is not None:
            query = query.where(activity.c.workflow == workflow)
        parts.append(query.order_by(activity.c.at.desc()).limit(cap + 1).subquery().select())
    return conn.execute(union_all(*parts)).all()


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
