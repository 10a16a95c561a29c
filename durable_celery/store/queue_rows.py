"""Statements on durable_queues and durable_queue_samples, and the per-queue counts of runs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, case, delete, exists, func, insert, literal, or_, select, update

from .db import Database
from .schema import UNFINISHED, queue_samples, queues, runs

# Statuses of a run that is ready once due and unlocked: a worker may claim it for a step
# (queries.CLAIMABLE) or for its next compensation (status compensating), and the relay sends
# both (queries.RELAYED). Spelled out here because queries imports this module.
_READY_STATUSES = ("pending", "running", "waiting", "compensating")
# Any fixed number: the transaction-scoped advisory lock that lets one node write a sample.
_SAMPLE_LOCK = 7_340_001


def paused_exists() -> Any:
    """SQL: the run's current queue is paused (used by the claim and the relay to skip it)."""
    return exists().where(queues.c.name == runs.c.queue, queues.c.paused.is_(True))


def set_paused_txn(db: Database, conn: Connection, name: str, paused: bool) -> None:
    """Record that queue ``name`` is paused or not."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as upsert
    else:
        from sqlalchemy.dialects.sqlite import insert as upsert  # type: ignore[assignment]
    query = upsert(queues).values(name=name, paused=paused, updated_at=db.now())
    conn.execute(
        query.on_conflict_do_update(
            index_elements=[queues.c.name], set_={"paused": paused, "updated_at": db.now()}
        )
    )


def paused_queues(conn: Connection) -> set[str]:
    """Names of the paused queues."""
    return set(conn.execute(select(queues.c.name).where(queues.c.paused.is_(True))).scalars())


def rearm_ready_txn(db: Database, conn: Connection, name: str) -> int:
    """Flag the ready runs of queue ``name`` (a step or a compensation to run) for the relay,
    which sends them at its next pass.

    Used on resume: their messages were dropped (or skipped by the relay) while it was paused.
    """
    query = (
        update(runs)
        .where(
            runs.c.queue == name,
            runs.c.due_at <= db.now(),
            runs.c.locked_by.is_(None),
            runs.c.status.in_(_READY_STATUSES),
        )
        .values(published=False)
    )
    return int(conn.execute(query).rowcount)


def count_by_queue(db: Database, conn: Connection) -> Sequence[Any]:
    """Per queue of unfinished runs: ready (due and unlocked, for a step or a compensation),
    running, waiting and the oldest ready time."""
    now = db.now()
    ready = and_(runs.c.locked_by.is_(None), runs.c.due_at <= now, runs.c.status.in_(_READY_STATUSES))
    running = runs.c.locked_by.is_not(None)
    query = (
        select(
            runs.c.queue,
            func.sum(case((ready, 1), else_=0)).label("ready"),
            func.sum(case((running, 1), else_=0)).label("running"),
            func.sum(case((or_(ready, running), 0), else_=1)).label("waiting"),
            func.min(case((ready, runs.c.due_at), else_=None)).label("oldest_ready_at"),
        )
        .where(runs.c.status.in_(UNFINISHED))
        .group_by(runs.c.queue)
    )
    return conn.execute(query).all()


def take_sample_turn_txn(conn: Connection, since: datetime) -> bool:
    """True if this transaction may write the samples: no other node is writing them and none
    were written since ``since``. On SQLite the write transaction already excludes others."""
    if conn.dialect.name == "postgresql":
        locked = conn.execute(select(func.pg_try_advisory_xact_lock(literal(_SAMPLE_LOCK)))).scalar()
        if not locked:
            return False
    return not sample_written_since(conn, since)


def sample_written_since(conn: Connection, since: datetime) -> bool:
    """Whether any node wrote a sample since ``since``."""
    return conn.execute(select(literal(1)).where(queue_samples.c.at >= since).limit(1)).first() is not None


def insert_samples_txn(db: Database, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Write one sample per queue, all stamped now."""
    if rows:
        conn.execute(insert(queue_samples).values(at=db.now()), [dict(r) for r in rows])


def trim_samples_txn(conn: Connection, before: datetime) -> int:
    """Delete samples older than ``before``; returns how many."""
    return int(conn.execute(delete(queue_samples).where(queue_samples.c.at < before)).rowcount)


def list_samples(conn: Connection, queue: str | None, since: datetime) -> Sequence[Any]:
    """Samples since ``since``, oldest first, of one queue or all."""
    query = select(queue_samples).where(queue_samples.c.at >= since)
    if queue is not None:
        query = query.where(queue_samples.c.queue == queue)
    return conn.execute(query.order_by(queue_samples.c.at, queue_samples.c.queue)).all()


def list_queue_rows(conn: Connection) -> Sequence[Any]:
    """Every queue an operator paused or resumed, by name."""
    return conn.execute(select(queues).order_by(queues.c.name)).all()
