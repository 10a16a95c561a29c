"""Statements on durable_nodes: worker nodes announce themselves, heartbeat, drain, are forgotten."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from .db import Database
from .schema import nodes


def register_node_txn(
    db: Database,
    conn: Connection,
    name: str,
    queues: Sequence[str],
    pid: int,
    steps: dict[str, list[str]] | None = None,
) -> None:
    """Announce a node that just started (a restarted node of the same name starts afresh)."""
    values = {
        "queues": list(queues),
        "steps": steps,
        "pid": pid,
        "draining": False,
        "started_at": db.now(),
        "seen_at": db.now(),
    }
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as upsert
    else:
        from sqlalchemy.dialects.sqlite import insert as upsert  # type: ignore[assignment]
    query = upsert(nodes).values(name=name, **values)
    conn.execute(query.on_conflict_do_update(index_elements=[nodes.c.name], set_=values))


def beat_node_txn(
    db: Database,
    conn: Connection,
    name: str,
    queues: Sequence[str],
    pid: int,
    steps: dict[str, list[str]] | None = None,
) -> bool:
    """Mark a node seen now, with the queues it consumes and (when given) the steps its code
    has; False if it is not registered."""
    values: dict[str, Any] = {"queues": list(queues), "pid": pid, "seen_at": db.now()}
    if steps is not None:
        values["steps"] = steps
    query = update(nodes).where(nodes.c.name == name).values(**values)
    return bool(conn.execute(query).rowcount == 1)


def live_node_steps(db: Database, conn: Connection, seen_within: float) -> Sequence[Any]:
    """The steps of nodes seen within ``seen_within`` seconds and not draining."""
    query = select(nodes.c.name, nodes.c.steps).where(
        nodes.c.seen_at >= db.later(-seen_within), nodes.c.draining.is_(False)
    )
    return conn.execute(query).all()


def live_queues(db: Database, conn: Connection, seen_within: float) -> set[str]:
    """The queues consumed by nodes seen within ``seen_within`` seconds and not draining."""
    query = select(nodes.c.queues).where(
        nodes.c.seen_at >= db.later(-seen_within), nodes.c.draining.is_(False)
    )
    return {queue for row in conn.execute(query) for queue in (row.queues or [])}


def mark_draining(conn: Connection, node: str) -> bool:
    """Flag a node as draining (it stops claiming and hands its runs back); False if unknown."""
    return bool(conn.execute(update(nodes).where(nodes.c.name == node).values(draining=True)).rowcount == 1)


def forget_nodes_txn(conn: Connection, unseen_since: datetime) -> int:
    """Delete nodes not seen since ``unseen_since``; returns how many."""
    return int(conn.execute(delete(nodes).where(nodes.c.seen_at < unseen_since)).rowcount)


def list_nodes(conn: Connection) -> Sequence[Any]:
    """Every known node, most recently seen first."""
    return conn.execute(select(nodes).order_by(nodes.c.seen_at.desc(), nodes.c.name)).all()


def insert_node_txn(conn: Connection, values: dict[str, Any]) -> None:
    """Insert one node row as given (tests and tools that replay a node's state)."""
    conn.execute(insert(nodes).values(**values))
