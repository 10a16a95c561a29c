"""Statements on child runs: finding a parent's children and waking a parent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from .bounded import no_jit
from .db import Database
from .schema import UNFINISHED, runs

# The wait a parent parks in while its children (or branches) run.
CHILDREN_WAIT = "durable:children"

_CHILD_COLUMNS = (runs.c.id, runs.c.status, runs.c.output, runs.c.error, runs.c.parent_ref)


def child_by_ref_txn(conn: Connection, parent_id: str, ref: str) -> Any:
    """The child a parent started at ``ref``, or None."""
    query = select(*_CHILD_COLUMNS).where(runs.c.parent_id == parent_id, runs.c.parent_ref == ref)
    return conn.execute(query).first()


def children_by_refs_txn(conn: Connection, parent_id: str, refs: Sequence[str]) -> dict[str, Any]:
    """The children a parent started at any of ``refs``, by ref."""
    query = select(*_CHILD_COLUMNS).where(runs.c.parent_id == parent_id, runs.c.parent_ref.in_(list(refs)))
    return {row.parent_ref: row for row in conn.execute(query)}


def unfinished_children(conn: Connection, parent_id: str) -> Sequence[str]:
    """Ids of a run's children that have not finished."""
    query = select(runs.c.id).where(runs.c.parent_id == parent_id, runs.c.status.in_(UNFINISHED))
    return list(conn.execute(query).scalars())


def parent_state_txn(conn: Connection, parent_id: str) -> Any:
    """The parent's status, fence and ``locked_by``, share-locked until the end of the
    transaction: a cancel committed first is seen, and one coming after waits for the children
    started here."""
    columns = (runs.c.status, runs.c.fence, runs.c.locked_by)
    query = select(*columns).where(runs.c.id == parent_id).with_for_update(read=True)
    return conn.execute(query).first()


def orphans(conn: Connection, limit: int) -> Sequence[Any]:
    """Unfinished children of cancelled parents (a cancel cut short before reaching them).

    Read from the unfinished children (ix_durable_runs_unfinished_children: a few, however many
    runs are kept), each joined to its parent by id; not from the cancelled runs, which grow
    with history."""
    parent = runs.alias("parent")
    query = (
        select(runs.c.id, runs.c.workflow, runs.c.key, runs.c.status, runs.c.step_index, runs.c.parent_id)
        .join(parent, parent.c.id == runs.c.parent_id)
        .where(
            runs.c.parent_id.is_not(None),
            runs.c.finished_at.is_(None),
            runs.c.status.in_(UNFINISHED),
            parent.c.status == "cancelled",
        )
        .order_by(runs.c.id)
        .limit(limit)
    )
    no_jit(conn)
    return conn.execute(query).all()


def wake_parent_txn(db: Database, conn: Connection, child_id: str) -> Any:
    """A child finished: make its parent due now if it waits for its children; returns what
    to publish (workflow, id, step index, attempt, key), or None."""
    parent_id = select(runs.c.parent_id).where(runs.c.id == child_id).scalar_subquery()
    query = (
        update(runs)
        .where(runs.c.id == parent_id, runs.c.status == "waiting", runs.c.wait_name == CHILDREN_WAIT)
        .values(due_at=db.now(), published=True)
        .returning(runs.c.workflow, runs.c.id, runs.c.step_index, runs.c.attempt, runs.c.key)
    )
    return conn.execute(query).first()


def due_if_any_finished_txn(db: Database, conn: Connection, run_id: str, child_ids: Sequence[str]) -> None:
    """Right after parking a parent: make it due at once if one of ``child_ids`` has finished
    meanwhile (its wake-up found the parent not yet waiting), or may be finishing right now.

    A child whose finishing transaction is still open has its row locked: it is skipped (never
    waited for, so this cannot deadlock with that transaction, which waits for the parent's
    row) and counted as possibly finished. Its own wake-up, or this one, then wakes the parent;
    at worst the parent's step runs once more and parks again.
    """
    wanted = set(child_ids)
    query = (
        select(runs.c.id, runs.c.finished_at)
        .where(runs.c.id.in_(list(wanted)))
        .with_for_update(read=True, skip_locked=True)
    )
    seen = conn.execute(query).all()
    if len(seen) < len(wanted) or any(row.finished_at is not None for row in seen):
        conn.execute(update(runs).where(runs.c.id == run_id).values(due_at=db.now()))


def tags_of(conn: Connection, run_id: str) -> dict[str, str] | None:
    """The run's tags (None for none): what its children are started with."""
    return conn.execute(select(runs.c.tags).where(runs.c.id == run_id)).scalar()
