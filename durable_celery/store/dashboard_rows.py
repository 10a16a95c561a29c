"""The dashboard's own statements: every one limited and served by an index of schema.py.

Reads the public API cannot answer (a capped count per status, a page of runs, keys by prefix,
a run's key decisions) live here, named, so the EXPLAIN test can check each of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select, tuple_

from .bounded import COUNT_CAP
from .schema import FINISHED, UNFINISHED, activity, events, keys, runs

STATUSES = UNFINISHED + FINISHED
KEY_KINDS = ("key_duplicate", "key_handed_off", "key_released", "key_retaken")
# Worker trouble the queues page reports (kinds other modules may record on the activity table).
RECOVERY_KINDS = ("stale_recovered", "worker_fenced", "handed_back", "code_missing")
HOLDS_KEY = select(keys.c.holder_id).where(keys.c.holder_id == runs.c.id).exists().label("holds_key")


def workflow_names(conn: Connection, limit: int = 200) -> list[str]:
    """Distinct workflow names of stored runs: a loose index scan of (workflow, created_at)."""
    first = select(func.min(runs.c.workflow).label("name")).cte("names", recursive=True)
    following = select(
        select(func.min(runs.c.workflow)).where(runs.c.workflow > first.c.name).scalar_subquery()
    ).where(first.c.name.is_not(None))
    names = first.union_all(following)
    query = select(names.c.name).where(names.c.name.is_not(None)).limit(limit)
    return [row.name for row in conn.execute(query)]


def failed_since(conn: Connection, since: datetime) -> dict[str, int]:
    """Per workflow: runs that ended failed (or compensation_failed) since ``since``."""
    query = (
        select(runs.c.workflow, func.count().label("n"))
        .where(
            runs.c.status.in_(["failed", "compensation_failed"]),
            runs.c.finished_at.is_not(None),
            runs.c.finished_at >= since,
        )
        .group_by(runs.c.workflow)
        .order_by(runs.c.workflow)
        .limit(200)
    )
    return {row.workflow: int(row.n) for row in conn.execute(query)}


def page_of_runs(
    conn: Connection,
    *where: Any,
    workflow: str | None,
    status: str | None,
    key: str | None,
    workflows: Sequence[str],
    limit: int,
    after: str | None = None,
    offset: int = 0,
) -> Sequence[Any]:
    """Runs matching the filters, newest first by their time-ordered id, one page: after the
    run ``after`` (keyset: the primary key's order, however deep), or past ``offset`` rows
    (the first few pages only).

    A key alone is looked up per known workflow (the key index leads with the workflow).
    """
    query = select(runs, HOLDS_KEY).where(*where)  # the page's other filters (run_filters.py)
    if workflow is not None:
        query = query.where(runs.c.workflow == workflow)
    elif key is not None:
        query = query.where(runs.c.workflow.in_(list(workflows) or [""]))
    if key is not None:
        query = query.where(runs.c.key == key)
    if status is not None:
        query = query.where(runs.c.status == status)
    if after is not None:
        query = query.where(runs.c.id < after)
    query = query.order_by(runs.c.id.desc())  # ids grow with time
    return conn.execute(query.limit(limit).offset(offset)).all()


# Keys newest taken first; ties (keys taken in one transaction share its time) by workflow and key,
# so that the order is total and a page's last row says where the next page starts.
KEY_ORDER = (keys.c.taken_at.desc(), keys.c.workflow.desc(), keys.c.key.desc())


def keys_after(after: tuple[datetime, str, str] | None) -> list[Any]:
    """The condition of the keys past ``after`` (taken_at, workflow, key) in ``KEY_ORDER``: a row
    value comparison (keyset, however deep); none without it."""
    if after is None:
        return []
    # A Python tuple, not tuple_(*after): its values are bound with the columns' types.
    return [tuple_(keys.c.taken_at, keys.c.workflow, keys.c.key) < tuple(after)]


def page_of_keys(
    conn: Connection,
    workflow: str | None,
    prefix: str | None,
    limit: int,
    after: tuple[datetime, str, str] | None = None,
) -> Sequence[Any]:
    """Key rows with their holder's status, newest taken first; by workflow and key prefix;
    ``after``: past that (taken_at, workflow, key), the last row of the page before (keyset)."""
    query = (
        select(
            keys.c.workflow, keys.c.key, keys.c.holder_id, keys.c.waiting_id, keys.c.taken_at, runs.c.status
        )
        .join(runs, runs.c.id == keys.c.holder_id)
        .where(*keys_after(after))
    )
    if workflow is not None:
        query = query.where(keys.c.workflow == workflow)
    if prefix:
        query = query.where(keys.c.key.startswith(prefix, autoescape=True))
    return conn.execute(query.order_by(*KEY_ORDER).limit(limit)).all()


def readds_per_key(conn: Connection, pairs: Sequence[tuple[str, str]], since: datetime) -> dict[Any, int]:
    """Re-adds (``key_duplicate`` entries) since ``since`` of each (workflow, key) given."""
    if not pairs:
        return {}
    query = (
        select(activity.c.workflow, activity.c.key, func.count())
        .where(
            activity.c.workflow.in_(sorted({w for w, _ in pairs})),
            activity.c.key.in_(sorted({k for _, k in pairs})),
            activity.c.kind == "key_duplicate",
            activity.c.at >= since,
        )
        .group_by(activity.c.workflow, activity.c.key)
    )
    return {(w, k): int(n) for w, k, n in conn.execute(query)}


def top_readded(
    conn: Connection, workflow: str | None, since: datetime, limit: int = 10, cap: int = COUNT_CAP
) -> Sequence[Any]:
    """(workflow, key, n): the keys re-added most since ``since``, among the newest ``cap``
    re-adds (an index range of (kind, at) read newest first: never the whole week's)."""
    newest = select(activity.c.workflow, activity.c.key).where(
        activity.c.kind == "key_duplicate", activity.c.at >= since
    )
    if workflow is not None:
        newest = newest.where(activity.c.workflow == workflow)
    some = newest.order_by(activity.c.at.desc()).limit(cap).subquery()
    n = func.count().label("n")
    query = select(some.c.workflow, some.c.key, n).group_by(some.c.workflow, some.c.key)
    return conn.execute(query.order_by(n.desc(), some.c.key).limit(limit)).all()


def key_row(conn: Connection, workflow: str, key: str) -> Any:
    """The key row of (workflow, key) with its holder's status; None when the key is free."""
    query = (
        select(keys.c.holder_id, keys.c.waiting_id, keys.c.taken_at, runs.c.status)
        .join(runs, runs.c.id == keys.c.holder_id)
        .where(keys.c.workflow == workflow, keys.c.key == key)
    )
    return conn.execute(query).first()


def key_decisions_of_run(conn: Connection, run_id: str, limit: int = 200) -> Sequence[Any]:
    """Key entries recorded on a run (its re-adds land on the holder's id), newest first."""
    query = (
        select(activity)
        .where(activity.c.run_id == run_id, activity.c.kind.in_(KEY_KINDS))
        .order_by(activity.c.id.desc())
        .limit(limit)
    )
    return conn.execute(query).all()


def key_history(conn: Connection, workflow: str, key: str, limit: int = 50) -> Sequence[Any]:
    """Hand-offs, releases and take-backs of one key, newest first."""
    query = (
        select(activity)
        .where(
            activity.c.workflow == workflow,
            activity.c.key == key,
            activity.c.kind.in_(["key_handed_off", "key_released", "key_retaken"]),
        )
        .order_by(activity.c.id.desc())
        .limit(limit)
    )
    return conn.execute(query).all()


def runs_of_key(conn: Connection, workflow: str, key: str, limit: int = 50) -> Sequence[Any]:
    """The runs that carried one key (each held it, or waited behind its holder), newest first."""
    query = (
        select(runs.c.id, runs.c.status, runs.c.created_at, runs.c.finished_at, runs.c.runs_after_id)
        .where(runs.c.workflow == workflow, runs.c.key == key)
        .order_by(runs.c.created_at.desc(), runs.c.id.desc())
        .limit(limit)
    )
    return conn.execute(query).all()


def events_of_run(conn: Connection, run_id: str, limit: int = 200) -> Sequence[Any]:
    """Events sent to a run, oldest first."""
    query = select(events).where(events.c.run_id == run_id).order_by(events.c.id).limit(limit)
    return conn.execute(query).all()


def run_brief(conn: Connection, run_ids: Sequence[str]) -> dict[str, Any]:
    """id -> (id, workflow, status) of the runs given (for links to parents and waiting runs)."""
    ids = [i for i in run_ids if i]
    if not ids:
        return {}
    query = select(runs.c.id, runs.c.workflow, runs.c.status).where(runs.c.id.in_(ids))
    return {row.id: row for row in conn.execute(query)}


def recent_activity(
    conn: Connection, kinds: Sequence[str], since: datetime, limit: int = 50
) -> Sequence[Any]:
    """Entries of ``kinds`` since ``since``, newest first."""
    query = (
        select(activity)
        .where(activity.c.kind.in_(list(kinds)), activity.c.at >= since)
        .order_by(activity.c.at.desc())
        .limit(limit)
    )
    return conn.execute(query).all()


def count_activity(conn: Connection, kinds: Sequence[str], since: datetime) -> dict[str, int]:
    """How many entries of each of ``kinds`` since ``since``."""
    query = (
        select(activity.c.kind, func.count())
        .where(activity.c.kind.in_(list(kinds)), activity.c.at >= since)
        .group_by(activity.c.kind)
    )
    return {kind: int(n) for kind, n in conn.execute(query)}


def run_exists(conn: Connection, run_id: str) -> bool:
    """Whether a run with this id is stored."""
    return conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first() is not None


def wait_of_run(conn: Connection, run_id: str) -> Any:
    """A run's status and what it waits for (``wait_name``, ``wait_until``)."""
    query = select(runs.c.status, runs.c.wait_name, runs.c.wait_until).where(runs.c.id == run_id)
    return conn.execute(query).first()


def run_state(conn: Connection, run_id: str) -> Any:
    """What a run's page needs beyond ``Run``: the step's name, its queue, its lock and
    heartbeat, when it is due (and at the latest, for a debounce), its attempt base and what
    flow control parks it for (``flow_wait`` and its keys)."""
    query = select(
        runs.c.workflow,
        runs.c.step_name,
        runs.c.queue,
        runs.c.locked_by,
        runs.c.heartbeat_at,
        runs.c.due_at,
        runs.c.not_after,
        runs.c.attempt,
        runs.c.attempt_base,
        runs.c.flow_wait,
        runs.c.slot_key,
        runs.c.throttle_key,
    ).where(runs.c.id == run_id)
    return conn.execute(query).first()
