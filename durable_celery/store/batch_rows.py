"""Statements on durable_batches (a batch workflow's open batches) and on the runs gathering them."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Interval,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    literal,
    select,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import JSONB

from .db import Database
from .schema import batches, runs


def join_txn(
    db: Database,
    conn: Connection,
    workflow: str,
    batch_key: str,
    run_id: str,
    batch: tuple[float, int],
    item: dict[str, Any],
) -> tuple[str, int, bool]:
    """Join the batch key's open batch, or open one gathered by ``run_id``: the run gathering
    it, its items counting this start, and whether ``item`` was added to that run (when it is
    not ``run_id``: False if it began, or ended, meanwhile). ``batch``: (period, max). A batch
    past ``closes_at`` or at ``max`` items is replaced. The batch's row stays locked until the
    transaction ends: starts of one batch key go one after another, and a start that rolls back
    leaves the batch as it found it. On PostgreSQL one statement, on SQLite two."""
    params: dict[str, Any] = {"b_workflow": workflow, "b_key": batch_key, "b_run": run_id, "b_max": batch[1]}
    if not db.is_postgres:
        row = conn.execute(_joined(False, db.now(), db.later(batch[0])), params).one()
        joined = row.run_id != run_id
        return row.run_id, int(row.items), joined and add_item_txn(db, conn, row.run_id, item)
    params.update(b_period=timedelta(seconds=batch[0]), b_item=item)
    row = conn.execute(db.statement("batch_join", _join_and_add), params).one()
    return row.run_id, int(row.items), bool(row.added)


def _joined(is_postgres: bool, now: Any, closes: Any) -> Any:
    """The upsert of a batch's row: joined (one more item) while open, else opened again."""
    dialect_insert = postgresql.insert if is_postgres else sqlite.insert
    opening = dialect_insert(batches).values(
        workflow=bindparam("b_workflow"),
        batch_key=bindparam("b_key"),
        run_id=bindparam("b_run"),
        items=1,
        opened_at=now,
        closes_at=closes,
    )
    still_open = and_(batches.c.closes_at > now, batches.c["items"] < bindparam("b_max"))
    new = opening.excluded
    return opening.on_conflict_do_update(
        index_elements=["workflow", "batch_key"],
        set_={
            "run_id": case((still_open, batches.c.run_id), else_=new.run_id),
            "items": case((still_open, batches.c["items"] + 1), else_=new["items"]),
            "opened_at": case((still_open, batches.c.opened_at), else_=new.opened_at),
            "closes_at": case((still_open, batches.c.closes_at), else_=new.closes_at),
        },
    ).returning(batches.c.run_id, batches.c["items"])


def _join_and_add() -> Any:
    """PostgreSQL: the upsert, and the item appended to the run of the batch it joined."""
    now = func.now()
    joined = _joined(True, now, now + bindparam("b_period", type_=Interval())).cte("joined")
    added = (
        update(runs)
        .where(
            runs.c.id == joined.c.run_id,
            joined.c.run_id != bindparam("b_run"),
            runs.c.status == "pending",
            runs.c.started_at.is_(None),
        )
        .values(input=_appended(bindparam("b_item", type_=JSONB)))
        .returning(runs.c.id)
        .cte("added")
    )
    return select(joined.c.run_id, joined.c["items"], exists(select(added.c.id)).label("added"))


def _appended(item: Any) -> Any:
    """PostgreSQL: the run's input with ``item`` appended to its ``items``."""
    items = runs.c.input.op("->")(literal("items")).op("||")(func.jsonb_build_array(item))
    return type_coerce(func.jsonb_build_object(literal("items"), items), JSONB)


def add_item_txn(db: Database, conn: Connection, run_id: str, item: dict[str, Any]) -> bool:
    """Append ``item`` to the gathering run's ``items``; False if the run has begun (or ended)."""
    gathered: Any
    if db.is_postgres:
        gathered = _appended(bindparam("item", item, type_=JSONB))
    else:
        gathered = func.json_insert(runs.c.input, literal("$.items[#]"), func.json(json.dumps(item)))
    query = (
        update(runs)
        .where(runs.c.id == run_id, runs.c.status == "pending", runs.c.started_at.is_(None))
        .values(input=gathered)
    )
    return bool(conn.execute(query).rowcount == 1)


def close_txn(db: Database, conn: Connection, workflow: str, batch_key: str, run_id: str) -> None:
    """The batch is full: no start joins it any more, and its run is due now (its message sent
    after commit)."""
    drop_txn(conn, workflow, batch_key, run_id)
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.status == "pending", runs.c.started_at.is_(None))
        .values(due_at=db.now(), published=True)
    )


def drop_txn(conn: Connection, workflow: str, batch_key: str, run_id: str) -> None:
    """Forget the batch ``run_id`` gathers (it has begun, or ended, before its time)."""
    conn.execute(
        delete(batches).where(
            batches.c.workflow == workflow, batches.c.batch_key == batch_key, batches.c.run_id == run_id
        )
    )


def open_batches(db: Database, conn: Connection, workflow: str | None = None, limit: int = 100) -> list[Any]:
    """The open batches (those closing soonest first): workflow, batch key, run, items, when
    opened and when they close; at most ``limit``."""
    query = select(batches).where(batches.c.closes_at > db.now())
    if workflow is not None:
        query = query.where(batches.c.workflow == workflow)
    return list(conn.execute(query.order_by(batches.c.closes_at, batches.c.batch_key).limit(limit)))


def open_counts(db: Database, conn: Connection) -> dict[str, tuple[int, int]]:
    """Per workflow: its open batches and the items they hold."""
    query = (
        select(batches.c.workflow, func.count(), func.coalesce(func.sum(batches.c["items"]), 0))
        .where(batches.c.closes_at > db.now())
        .group_by(batches.c.workflow)
    )
    return {row[0]: (int(row[1]), int(row[2])) for row in conn.execute(query)}


def drop_closed(db: Database, conn: Connection) -> int:
    """Delete the rows of batches that closed by time (their runs are due or done); how many."""
    return int(conn.execute(delete(batches).where(batches.c.closes_at <= db.now())).rowcount or 0)
