"""Statements of ``durable doctor``: stuck state, each kind found by one named query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, or_, select, update

from .bounded import no_jit
from .child_rows import CHILDREN_WAIT
from .db import Database, constant
from .queries import RELAYED
from .schema import UNFINISHED, events, runs

_RUN_COLUMNS = (runs.c.id, runs.c.workflow, runs.c.key, runs.c.status, runs.c.step_index)
SLEEP_PREFIX = "durable:sleep:"


def _kept_event() -> Any:
    return (
        select(events.c.id)
        .where(events.c.run_id == runs.c.id, events.c.name == runs.c.wait_name, events.c.received.is_(False))
        .exists()
    )


def _woken_by_now() -> Any:
    """The run's wait is over: its event is kept, or it waits for children and none is left."""
    child = runs.alias("child")
    # ix_durable_runs_unfinished_children's condition: a probe per waiting parent, not a hash of
    # every unfinished run.
    of_run = (child.c.parent_id == runs.c.id, child.c.parent_id.is_not(None))
    unfinished = (*of_run, child.c.finished_at.is_(None))
    unfinished_child = select(child.c.id).where(*unfinished).exists()
    return or_(_kept_event(), and_(runs.c.wait_name == CHILDREN_WAIT, ~unfinished_child))


def _behind_unfinished_holder() -> Any:
    """The run is a ``run_again`` run waiting behind its key's holder, which has not finished:
    the holder's end hands it the key and makes it due (keys.settle_waiting_txn)."""
    holder = runs.alias("holder")
    return (
        select(holder.c.id)
        .where(holder.c.id == runs.c.runs_after_id, holder.c.status.in_(UNFINISHED))
        .exists()
    )


def _unwoken() -> tuple[Any, ...]:
    """Waiting runs no worker holds and with no wake-up set: ix_durable_runs_unwoken's condition,
    its status a constant in the SQL so that a prepared statement's generic plan uses it too."""
    return (runs.c.status == constant("waiting"), runs.c.due_at.is_(None), runs.c.locked_by.is_(None))


def unwakeable_waiting(conn: Connection, limit: int) -> Sequence[Any]:
    """Waiting runs with no timer and nothing to wait for: no event name, or a sleep without end.

    A ``run_again`` run waiting behind an unfinished holder is not one: the holder wakes it.
    """
    query = (
        select(*_RUN_COLUMNS, runs.c.wait_name)
        .where(
            *_unwoken(),
            runs.c.flow_wait.is_(None),  # parked for a concurrency slot (flow.py): a slot wakes it
            runs.c.wait_until.is_(None),
            or_(runs.c.wait_name.is_(None), runs.c.wait_name.startswith(SLEEP_PREFIX, autoescape=True)),
            ~_behind_unfinished_holder(),
        )
        .order_by(runs.c.created_at)
        .limit(limit)
    )
    return conn.execute(query).all()


def missed_wakeups(conn: Connection, limit: int) -> Sequence[Any]:
    """Waiting runs not due although the event they wait for is kept for them, or all the
    children they wait for have finished."""
    query = (
        select(*_RUN_COLUMNS, runs.c.wait_name)
        .where(
            *_unwoken(),
            runs.c.flow_wait.is_(None),  # parked for a concurrency slot (flow.py): a slot wakes it
            runs.c.wait_name.is_not(None),
            _woken_by_now(),
        )
        .order_by(runs.c.created_at)
        .limit(limit)
    )
    no_jit(conn)  # every worker's upkeep runs it every few seconds
    return conn.execute(query).all()


def wake_missed_txn(db: Database, conn: Connection, run_id: str) -> bool:
    """Make a run that missed its wake-up due now (the relay then sends it)."""
    query = (
        update(runs)
        .where(
            runs.c.id == run_id,
            runs.c.status == "waiting",
            runs.c.locked_by.is_(None),
            runs.c.due_at.is_(None),
            runs.c.flow_wait.is_(None),  # parked for a concurrency slot (flow.py): a slot wakes it
            _woken_by_now(),
        )
        .values(due_at=db.now(), published=False)
    )
    return bool(conn.execute(query).rowcount == 1)


def stale_locks(db: Database, conn: Connection, stale_after: float, limit: int) -> Sequence[Any]:
    """Runs locked by a worker that has not heart-beaten for ``stale_after`` seconds."""
    query = (
        select(*_RUN_COLUMNS, runs.c.locked_by, runs.c.heartbeat_at)
        .where(
            runs.c.locked_by.is_not(None),
            or_(runs.c.heartbeat_at.is_(None), runs.c.heartbeat_at < db.later(-stale_after)),
        )
        .order_by(runs.c.heartbeat_at)
        .limit(limit)
    )
    return conn.execute(query).all()


def stalled_compensations(conn: Connection, limit: int) -> Sequence[Any]:
    """Compensating runs that nobody holds and that are not due: their compensation stopped."""
    query = (
        select(*_RUN_COLUMNS)
        .where(runs.c.status == "compensating", runs.c.locked_by.is_(None), runs.c.due_at.is_(None))
        .order_by(runs.c.created_at)
        .limit(limit)
    )
    return conn.execute(query).all()


def unsent_due_runs(
    db: Database, conn: Connection, unsent_after: float, relay_after: float, limit: int
) -> Sequence[Any]:
    """Runs due for a while whose message was never sent, or sent, never claimed, and overdue
    for the relay's look at them (no worker's upkeep is running)."""
    never_sent = and_(runs.c.published.is_(False), runs.c.due_at < db.later(-unsent_after))
    first_look = and_(runs.c.resend_at.is_(None), runs.c.due_at < db.later(-(relay_after + unsent_after)))
    lost = and_(runs.c.published.is_(True), or_(first_look, runs.c.resend_at < db.later(-unsent_after)))
    query = (
        select(*_RUN_COLUMNS, runs.c.due_at, runs.c.published)
        .where(
            runs.c.due_at.is_not(None),
            runs.c.locked_by.is_(None),
            runs.c.status.in_(RELAYED),
            or_(never_sent, lost),
        )
        .order_by(runs.c.due_at)
        .limit(limit)
    )
    return conn.execute(query).all()
