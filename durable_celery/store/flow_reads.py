"""Reads for people about flow control (observe/flow.py): per key of a workflow, the slots in
use and the runs parked, the throttle's begins and the rate limit's starts in their windows; for
one parked run, its key's use and the runs in line ahead of it; per queue, the runs flow control
holds and those waiting (status ``waiting``), for the dashboard's overview.

Each statement reads a bounded number of rows (``LIMIT``) over the partial indexes of
schema.py, so a page costs the same with 10 or 10,000 runs parked; past the bound a count is
"at least" (``ROWS_READ``), and keys are listed most waiting first up to the caller's limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, case, func, literal, or_, select, union_all

from . import flow_rows
from .db import Database
from .flow_rows import SLOT, THROTTLE
from .schema import UNFINISHED, runs

# Rows a read of one workflow's keys looks at, at most: 10,000 parked runs are all counted.
ROWS_READ = 20_000
IN_USE = "in_use"  # flow_gauges: steps holding a concurrency slot


def _counted(condition: Any) -> Any:
    return func.sum(case((condition, 1), else_=0))


def slot_use(conn: Connection, workflow: str, keys: int, rows: int = ROWS_READ) -> Sequence[Any]:
    """Per slot key of ``workflow`` with unfinished runs: ``in_use`` (steps executing),
    ``waiting`` (parked for a slot), ``oldest_waiting`` (the start of the one parked longest);
    at most ``keys`` keys, most waiting first, over at most ``rows`` runs."""
    unfinished = (
        select(runs.c.slot_key, runs.c.status, runs.c.locked_by, runs.c.flow_wait, runs.c.created_at)
        .where(runs.c.workflow == workflow, runs.c.slot_key.is_not(None), runs.c.finished_at.is_(None))
        .order_by(runs.c.slot_key, runs.c.created_at)  # as ix_durable_runs_slot is: stops at rows
        .limit(rows)
        .subquery()
    )
    parked = unfinished.c.flow_wait == SLOT
    waiting = _counted(parked)
    query = (
        select(
            unfinished.c.slot_key.label("key"),
            _counted(and_(unfinished.c.status == "running", unfinished.c.locked_by.is_not(None))).label(
                "in_use"
            ),
            waiting.label("waiting"),
            func.min(case((parked, unfinished.c.created_at), else_=None)).label("oldest_waiting"),
        )
        .group_by(unfinished.c.slot_key)
        .order_by(waiting.desc(), unfinished.c.slot_key)
        .limit(keys)
    )
    return conn.execute(query).all()


def fair_use(conn: Connection, workflow: str, keys: int, rows: int = ROWS_READ) -> Sequence[Any]:
    """Per fair key of ``workflow`` with unfinished runs: ``in_use`` (steps executing),
    ``waiting`` (parked for a slot), ``oldest_waiting`` (the start of the one parked longest);
    at most ``keys`` keys, most waiting first, over at most ``rows`` runs
    (ix_durable_runs_fair_line)."""
    unfinished = (
        select(runs.c.fair_key, runs.c.status, runs.c.locked_by, runs.c.flow_wait, runs.c.created_at)
        .where(runs.c.workflow == workflow, runs.c.fair_key.is_not(None), runs.c.finished_at.is_(None))
        .limit(rows)
        .subquery()
    )
    parked = unfinished.c.flow_wait == SLOT
    waiting = _counted(parked)
    running = and_(unfinished.c.status == "running", unfinished.c.locked_by.is_not(None))
    query = (
        select(
            unfinished.c.fair_key.label("key"),
            _counted(running).label("in_use"),
            waiting.label("waiting"),
            func.min(case((parked, unfinished.c.created_at), else_=None)).label("oldest_waiting"),
        )
        .group_by(unfinished.c.fair_key)
        .order_by(waiting.desc(), unfinished.c.fair_key)
        .limit(keys)
    )
    return conn.execute(query).all()


def parked_priorities(conn: Connection, workflow: str, rows: int = ROWS_READ) -> dict[int, int]:
    """Runs of ``workflow`` parked by flow control per priority (0 for none), over at most
    ``rows`` of them (ix_durable_runs_flow_wait)."""
    parked = (
        select(func.coalesce(runs.c.priority, 0).label("priority"))
        .where(runs.c.flow_wait.is_not(None), runs.c.workflow == workflow, runs.c.finished_at.is_(None))
        .limit(rows)
        .subquery()
    )
    query = select(parked.c.priority, func.count().label("n")).group_by(parked.c.priority)
    return {int(row.priority): int(row.n) for row in conn.execute(query)}


def throttled_keys(conn: Connection, workflow: str, keys: int, rows: int = ROWS_READ) -> Sequence[Any]:
    """Per throttle key of ``workflow`` with runs parked by the throttle: ``waiting``,
    ``next_look`` (the soonest one looks again), ``oldest_waiting`` (the earliest start); at
    most ``keys`` keys, most waiting first, over at most ``rows`` parked runs."""
    parked = (
        select(runs.c.throttle_key, runs.c.due_at, runs.c.created_at)
        .where(
            runs.c.flow_wait == THROTTLE,
            runs.c.workflow == workflow,
            runs.c.finished_at.is_(None),  # with flow_wait: ix_durable_runs_flow_wait's condition
        )
        .limit(rows)
        .subquery()
    )
    waiting = func.count()
    query = (
        select(
            parked.c.throttle_key.label("key"),
            waiting.label("waiting"),
            func.min(parked.c.due_at).label("next_look"),
            func.min(parked.c.created_at).label("oldest_waiting"),
        )
        .where(parked.c.throttle_key.is_not(None))
        .group_by(parked.c.throttle_key)
        .order_by(waiting.desc(), parked.c.throttle_key)
        .limit(keys)
    )
    return conn.execute(query).all()


def recent_throttle_keys(
    db: Database, conn: Connection, workflow: str, period: float, keys: int, rows: int = ROWS_READ
) -> list[str]:
    """Throttle keys of ``workflow``'s runs unfinished or created in the last ``period``
    seconds (the keys whose window may hold begins), at most ``keys``."""
    recent = (
        select(runs.c.throttle_key.label("key"))
        .where(runs.c.workflow == workflow, runs.c.created_at > db.later(-period))
        .order_by(runs.c.created_at.desc())
        .limit(rows)
    )
    going = (
        select(runs.c.throttle_key.label("key"))
        .where(runs.c.status.in_(UNFINISHED), runs.c.workflow == workflow)
        .limit(rows)  # unordered: any plan stops at the bound
    )
    both = union_all(recent.subquery().select(), going.subquery().select()).subquery()
    query = (
        select(both.c.key)
        .where(both.c.key.is_not(None))
        .group_by(both.c.key)
        .order_by(both.c.key)
        .limit(keys)
    )
    return [row.key for row in conn.execute(query)]


def begins_per_key(
    db: Database, conn: Connection, workflow: str, keys: Sequence[str], period: float, limit: int
) -> dict[str, int]:
    """How many runs of each throttle key began in the last ``period`` seconds, each counted up
    to ``limit`` (one range of ix_durable_runs_throttle per key, in one statement)."""
    return _per_key(conn, runs.c.throttle_key, runs.c.started_at, db.later(-period), workflow, keys, limit)


def starts_per_key(
    db: Database, conn: Connection, workflow: str, period: float, keys: int, rows: int = ROWS_READ
) -> Sequence[Any]:
    """Per rate key of ``workflow``: runs started (created) in the last ``period`` seconds, and
    the earliest of them (``oldest``, which leaves the window first); at most ``keys`` keys,
    busiest first, over at most ``rows`` runs."""
    recent = (
        select(runs.c.rate_key, runs.c.created_at)
        .where(runs.c.workflow == workflow, runs.c.created_at > db.later(-period))
        .order_by(runs.c.created_at.desc())  # ix_durable_runs_workflow_created, newest first
        .limit(rows)
        .subquery()
    )
    started = func.count()
    query = (
        select(
            recent.c.rate_key.label("key"),
            started.label("started"),
            func.min(recent.c.created_at).label("oldest"),
        )
        .where(recent.c.rate_key.is_not(None))
        .group_by(recent.c.rate_key)
        .order_by(started.desc(), recent.c.rate_key)
        .limit(keys)
    )
    return conn.execute(query).all()


def _per_key(
    conn: Connection, column: Any, at: Any, since: Any, workflow: str, keys: Sequence[str], limit: int
) -> dict[str, int]:
    if not keys:
        return {}
    parts = []
    for key in keys:
        capped = (
            select(literal(1).label("one"))
            .where(runs.c.workflow == workflow, column == key, at > since)
            .limit(limit)
            .subquery()
        )
        parts.append(select(literal(key).label("key"), func.count().label("n")).select_from(capped))
    return {row.key: int(row.n) for row in conn.execute(union_all(*parts))}


def run_flow(conn: Connection, run_id: str) -> Any:
    """A run's flow columns (``id``, ``workflow``, ``flow_wait``, ``slot_key``,
    ``throttle_key``, ``fair_key``, ``priority``, ``due_at``, ``created_at``, ``line_at``: its
    place in its keys' lines), or None."""
    query = select(
        runs.c.id,
        runs.c.workflow,
        runs.c.flow_wait,
        runs.c.slot_key,
        runs.c.throttle_key,
        runs.c.fair_key,
        runs.c.priority,
        runs.c.due_at,
        runs.c.created_at,
        runs.c.line_at,
    ).where(runs.c.id == run_id)
    return conn.execute(query).first()


def slot_line(db: Database, conn: Connection, run: Any, bound: int) -> tuple[int, int]:
    """For a run of a slot key (a row with ``id``, ``workflow``, ``slot_key``, ``line_at``):
    the key's steps holding a slot, and the runs ahead of it in line that wait for one (parked,
    or due and not yet claimed), each counted up to ``bound``: the counts its claim makes."""
    return flow_rows.slot_line_txn(db, conn, run, bound)


def throttle_line(
    db: Database, conn: Connection, run: Any, period: float, begun_bound: int, ahead_bound: int
) -> tuple[int, int]:
    """For a run of a throttle key (a row with ``id``, ``workflow``, ``throttle_key``,
    ``line_at``): the key's runs that began (their first step claimed) in the last
    ``period`` seconds, up to ``begun_bound``, and the runs ahead of it in line that wait to
    begin, up to ``ahead_bound``: the counts its claim makes."""
    key = run.throttle_key
    begun = flow_rows.begins_in_window_txn(db, conn, run.workflow, key, period, begun_bound)
    return len(begun), flow_rows.throttle_line_ahead_txn(db, conn, run, ahead_bound)


def held_by_queue(db: Database, conn: Connection) -> Sequence[Any]:
    """Per queue of unfinished runs neither due nor running (``count_by_queue``'s "waiting"):
    ``held``, those flow control parks, and ``waiting``, the others whose status is
    ``waiting`` (parked on a sleep, an event, an input or children)."""
    parked = and_(runs.c.locked_by.is_(None), or_(runs.c.due_at.is_(None), runs.c.due_at > db.now()))
    held = runs.c.flow_wait.is_not(None)
    query = (
        select(
            runs.c.queue,
            _counted(and_(parked, held)).label("held"),
            _counted(and_(parked, ~held, runs.c.status == "waiting")).label("waiting"),
        )
        .where(runs.c.status.in_(UNFINISHED))
        .group_by(runs.c.queue)
    )
    return conn.execute(query).all()


def flow_gauges(conn: Connection) -> Sequence[Any]:
    """In one statement, per workflow: runs parked by flow control (``what`` 'slot' or
    'throttle') and steps holding a concurrency slot (``what`` 'in_use'), as ``n``."""
    parked = (
        select(runs.c.workflow, runs.c.flow_wait.label("what"), func.count().label("n"))
        .where(runs.c.flow_wait.is_not(None), runs.c.finished_at.is_(None))
        .group_by(runs.c.workflow, runs.c.flow_wait)
    )
    holding = (
        select(runs.c.workflow, literal(IN_USE).label("what"), func.count().label("n"))
        .where(
            runs.c.slot_key.is_not(None),
            runs.c.finished_at.is_(None),
            runs.c.status == "running",
            runs.c.locked_by.is_not(None),
        )
        .group_by(runs.c.workflow)
    )
    return conn.execute(union_all(parked, holding)).all()


def slots_in_use(conn: Connection, workflow: str, key: str, bound: int) -> int:
    """Steps of the slot key's runs executing now, counted up to ``bound``."""
    held = (
        select(literal(1).label("one"))
        .where(
            runs.c.workflow == workflow,
            runs.c.slot_key == key,
            runs.c.finished_at.is_(None),
            runs.c.status == "running",
            runs.c.locked_by.is_not(None),
        )
        .limit(bound)
        .subquery()
    )
    return int(conn.execute(select(func.count()).select_from(held)).scalar_one())
