"""Statements on durable_keys: claiming, locking, handing over and releasing a key."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    case,
    delete,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from . import direct
from .bounded import COUNT_CAP, capped_count
from .dashboard_rows import KEY_ORDER, keys_after
from .db import Clock, Database, constant, one_of
from .schema import UNFINISHED, activity, keys, runs


def claim_key_txn(db: Database, conn: Connection, workflow: str, key: str, run_id: str) -> bool:
    """Insert the key row naming ``run_id`` as holder; False if the key already has a row."""
    dialect_insert = postgresql.insert if db.is_postgres else sqlite.insert
    values = {"workflow": workflow, "key": key, "holder_id": run_id, "taken_at": Clock()}

    def build(set_values: dict[str, Any]) -> Any:
        return (
            dialect_insert(keys)
            .values(**set_values)
            .on_conflict_do_nothing(index_elements=["workflow", "key"])
            .returning(keys.c.holder_id)
        )

    stmt, params = db.bind("claim_key", keys.c, values, build)
    return conn.execute(stmt, params).first() is not None


def insert_run_with_key(db: Database, conn: Connection, run: dict[str, Any]) -> bool:
    """PostgreSQL only: take a free key and insert its run in one statement; False (and
    nothing written) when the key is held."""

    def build(set_values: dict[str, Any]) -> Any:
        taken = (
            postgresql.insert(keys)
            .values(
                workflow=set_values["workflow"],
                key=set_values["key"],
                holder_id=set_values["id"],
                taken_at=func.now(),
            )
            .on_conflict_do_nothing(index_elements=["workflow", "key"])
            .returning(keys.c.holder_id)
            .cte("taken")
        )
        columns = list(set_values)
        chosen = select(*(set_values[c] for c in columns)).select_from(taken)
        return insert(runs).from_select(columns, chosen).returning(runs.c.id)

    stmt, params = db.bind("insert_run_with_key", runs.c, run, build)
    return direct.first(db, conn, stmt, params) is not None


def start_or_answer(
    db: Database, conn: Connection, run: dict[str, Any], kept: dict[str, Any]
) -> tuple[bool, str | None]:
    """PostgreSQL only, for ``use_existing`` without debounce: take a free key and insert its
    run, or record the duplicate on the key's unfinished holder, in one statement and without
    locks. Returns (created, holder id); (False, None) when neither held: decide under locks.
    ``kept`` is what the duplicate's entry keeps of the run's input (keys.dropped_input)."""

    def build(set_values: dict[str, Any]) -> Any:
        wf, k = set_values["workflow"], set_values["key"]
        taken = (
            postgresql.insert(keys)
            .values(workflow=wf, key=k, holder_id=set_values["id"], taken_at=func.now())
            .on_conflict_do_nothing(index_elements=["workflow", "key"])
            .returning(keys.c.holder_id)
            .cte("taken")
        )
        columns = list(set_values)
        created = (
            insert(runs)
            .from_select(columns, select(*(set_values[c] for c in columns)).select_from(taken))
            .returning(runs.c.id)
            .cte("created")
        )
        # Read in the statement's snapshot: a key taken by a start that committed after it
        # began is not seen here, and the caller decides under locks. The key row ``taken``
        # inserts is not seen here either (a statement's CTEs share one snapshot): the holder is
        # found only when there was one before, and then ``taken`` inserted nothing.
        holder = (
            select(keys.c.holder_id, runs.c.status, (runs.c.input == set_values["input"]).label("same"))
            .join(runs, runs.c.id == keys.c.holder_id)
            .where(
                keys.c.workflow == wf,
                keys.c.key == k,
                one_of(runs.c.status, UNFINISHED),
            )
            .cte("holder")
        )
        details = func.jsonb_build_object(
            constant("key"),
            k,
            constant("workflow"),
            wf,
            constant("outcome"),
            constant("use_existing"),
            constant("policy"),
            constant("use_existing"),
            constant("input_changed"),
            ~holder.c.same,
            constant("holder_status"),
            holder.c.status,
        ).op("||")(bindparam("p_kept", type_=postgresql.JSONB()))
        chosen = select(constant("key_duplicate"), holder.c.holder_id, wf, k, details, func.now())
        answered = (
            insert(activity)
            .from_select(["kind", "run_id", "workflow", "key", "details", "at"], chosen.select_from(holder))
            .returning(activity.c.run_id)
            .cte("answered")
        )
        return select(
            select(created.c.id).scalar_subquery().label("created"),
            select(answered.c.run_id).scalar_subquery().label("holder"),
        )

    stmt, params = db.bind("start_or_answer", runs.c, run, build)
    row = direct.first(db, conn, stmt, {**params, "p_kept": kept})
    return row.created is not None, row.holder


def lock_key_txn(db: Database, conn: Connection, workflow: str, key: str) -> Any:
    """Lock a key row and its holder's row, and read the holder (and waiting run); None when
    the key row is gone."""

    def build() -> Any:
        holder = runs.alias("holder")
        return (
            select(
                keys.c.holder_id,
                keys.c.waiting_id,
                holder.c.status,
                holder.c.started_at,
                holder.c.input,
            )
            .join(holder, holder.c.id == keys.c.holder_id)
            .where(keys.c.workflow == bindparam("p_workflow"), keys.c.key == bindparam("p_key"))
            # The holder's row is locked too: a start that waited for a finishing holder then
            # reads the status that holder committed, not the one from before the wait.
            .with_for_update(of=[keys, holder])
        )

    params = {"p_workflow": workflow, "p_key": key}
    return conn.execute(db.statement("lock_key", build), params).first()


def drop_orphan_key_txn(conn: Connection, workflow: str, key: str) -> None:
    """Delete the key's row if its holder's run does not exist (it holds nothing)."""
    conn.execute(
        delete(keys).where(
            keys.c.workflow == workflow,
            keys.c.key == key,
            ~select(runs.c.id).where(runs.c.id == keys.c.holder_id).exists(),
        )
    )


def hand_key_txn(db: Database, conn: Connection, workflow: str, key: str, new_holder: str) -> None:
    """Give the key to ``new_holder``, with no run waiting behind it."""
    conn.execute(
        update(keys)
        .where(keys.c.workflow == workflow, keys.c.key == key)
        .values(holder_id=new_holder, waiting_id=None, taken_at=db.now())
    )


def set_waiting_txn(conn: Connection, workflow: str, key: str, waiting_id: str | None) -> None:
    """Record the run waiting behind the holder (or none)."""
    conn.execute(
        update(keys).where(keys.c.workflow == workflow, keys.c.key == key).values(waiting_id=waiting_id)
    )


def forget_waiting_txn(conn: Connection, run_id: str) -> None:
    """A waiting run that was cancelled no longer waits behind anyone."""
    conn.execute(update(keys).where(keys.c.waiting_id == run_id).values(waiting_id=None))


def key_of_holder_txn(conn: Connection, run_id: str) -> Any:
    """The key row ``run_id`` holds, locked; None if it holds none."""
    query = select(keys).where(keys.c.holder_id == run_id).with_for_update()
    return conn.execute(query).first()


def release_key_txn(conn: Connection, run_id: str) -> bool:
    """Delete the key row held by ``run_id``; False if it held none."""
    return conn.execute(delete(keys).where(keys.c.holder_id == run_id)).rowcount == 1


def list_keys(
    conn: Connection,
    workflow: str | None,
    limit: int,
    prefix: str | None = None,
    after: tuple[datetime, str, str] | None = None,
) -> Sequence[Any]:
    """Key rows with their holder's status, newest taken first; ``prefix`` keeps keys starting
    with it (``%`` and ``_`` in it are plain characters); ``after``: the keys past that
    (taken_at, workflow, key), the last of the page before."""
    query = (
        select(
            keys.c.workflow, keys.c.key, keys.c.holder_id, runs.c.status, keys.c.waiting_id, keys.c.taken_at
        )
        .join(runs, runs.c.id == keys.c.holder_id)
        .where(*keys_after(after))
        .order_by(*KEY_ORDER)
        .limit(limit)
    )
    if workflow is not None:
        query = query.where(keys.c.workflow == workflow)
    if prefix:
        # SQLite's LIKE ignores ASCII case; the substr test keeps the match exact on both.
        query = query.where(
            keys.c.key.startswith(prefix, autoescape=True),
            func.substr(keys.c.key, 1, len(prefix)) == prefix,
            *_prefix_range(conn, workflow, prefix),
        )
    return conn.execute(query).all()


def _prefix_range(conn: Connection, workflow: str | None, prefix: str) -> list[Any]:
    """PostgreSQL whose keys sort by code point (a C collation): the prefix as a range of the
    primary key (workflow, key), per workflow with runs, so that a prefix reads its keys only
    (LIKE cannot use the index). Other collations may not sort a prefix's keys together: none."""
    if conn.dialect.name != "postgresql" or not _bytewise(conn):
        return []
    found = [keys.c.key >= prefix, keys.c.key < prefix + "\U0010ffff"]
    if workflow is None:
        from .dashboard_rows import workflow_names

        found.append(keys.c.workflow.in_(workflow_names(conn) or [""]))
    return found


def _bytewise(conn: Connection) -> bool:
    """Does the database sort text by code point (collation C, POSIX or C.UTF-8)?"""
    query = text("SELECT datcollate FROM pg_database WHERE datname = current_database()")
    collation = str(conn.execute(query).scalar() or "")
    return collation in ("C", "POSIX") or collation.upper().startswith("C.")


def count_keys(conn: Connection, workflow: str | None, cap: int = COUNT_CAP) -> int:
    """Key rows (of ``workflow``), counted up to ``cap + 1``: an index range, never every key."""
    query = select(keys.c.workflow)
    if workflow is not None:
        query = query.where(keys.c.workflow == workflow)
    return int(conn.execute(capped_count(query, cap)).scalar() or 0)


def keys_of_unfinished(conn: Connection, workflow: str | None) -> Sequence[Any]:
    """Per workflow, the keys held by unfinished runs (``workflow``, ``n``): read from the
    unfinished runs (a few, however many keys finished runs keep), each run's key row looked up
    by its holder index (a subquery per run: a join may be planned as a hash of every key)."""
    held = select(func.count()).where(keys.c.holder_id == runs.c.id).correlate(runs).scalar_subquery()
    query = (
        select(runs.c.workflow, func.sum(held).label("n"))
        .where(runs.c.status.in_(UNFINISHED), runs.c.key.is_not(None))
        .group_by(runs.c.workflow)
    )
    if workflow is not None:
        query = query.where(runs.c.workflow == workflow)
    return [row for row in conn.execute(query) if row.n]


def count_finished_holders(
    conn: Connection, workflow: str, statuses: Sequence[str], cap: int = COUNT_CAP
) -> int:
    """Keys of ``workflow`` whose holder finished in one of ``statuses``, among its first
    ``cap + 1`` keys (a bounded read: past the cap the count is at least this)."""
    some = select(keys.c.holder_id).where(keys.c.workflow == workflow).limit(cap + 1).subquery()
    query = (
        select(func.count())
        .select_from(some)
        .join(runs, runs.c.id == some.c.holder_id)
        .where(runs.c.status.in_(list(statuses)))
    )
    return int(conn.execute(query).scalar() or 0)


def give_input_txn(conn: Connection, run_id: str, data: Any) -> None:
    """The run (waiting behind a key's holder) runs with ``data``, the newest start's input."""
    conn.execute(update(runs).where(runs.c.id == run_id).values(input=data))


def take_input_txn(db: Database, conn: Connection, run_id: str, data: Any, debounce: float | None) -> bool:
    """An unclaimed pending holder takes the newer input (``debounce``: and is due that many
    seconds from now, never past its ``not_after``, its message to be sent again then); False
    if it was claimed meanwhile."""
    values: dict[str, Any] = {"input": data}
    if debounce is not None:
        wanted = db.later(debounce)
        values["due_at"] = case(
            (runs.c.not_after.is_not(None) & (runs.c.not_after < wanted), runs.c.not_after), else_=wanted
        )
        values["published"] = False
    query = (
        update(runs)
        .where(runs.c.id == run_id, runs.c.status == "pending", runs.c.started_at.is_(None))
        .values(**values)
    )
    return bool(conn.execute(query).rowcount == 1)


def let_waiting_run_go_txn(db: Database, conn: Connection, run_id: str) -> None:
    """The run waiting behind a finished holder took its key: it is due now (its message sent)."""
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.status == "waiting")
        .values(status="pending", due_at=db.now(), published=True)
    )
