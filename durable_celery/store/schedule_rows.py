"""Statements on durable_schedules: the state every beat and worker shares about a schedule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Integer, case, delete, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite

from .db import Database
from .schema import schedules


def fetch_schedule(conn: Connection, name: str) -> Any:
    """One schedule row by name, or None."""
    return conn.execute(select(schedules).where(schedules.c.name == name)).first()


def fetch_schedules(conn: Connection, names: Sequence[str] | None = None) -> Sequence[Any]:
    """Schedule rows (those named, or all), by name."""
    query = select(schedules)
    if names is not None:
        query = query.where(schedules.c.name.in_(list(names)))
    return conn.execute(query.order_by(schedules.c.name)).all()


def disabled_schedules(conn: Connection) -> Sequence[Any]:
    """Rows of the schedules that are switched off, newest first."""
    query = select(schedules).where(schedules.c.enabled.is_(False))
    return conn.execute(query.order_by(schedules.c.disabled_at.desc())).all()


def upsert_schedule_txn(db: Database, conn: Connection, values: dict[str, Any], *, replace: bool) -> bool:
    """Insert a schedule's definition; with ``replace`` an existing one takes the new definition
    (its failures and outcomes stay). Returns whether a row was written."""
    dialect_insert = postgresql.insert if db.is_postgres else sqlite.insert
    now = db.now()
    stmt = dialect_insert(schedules).values(**values, created_at=now, updated_at=now)
    if replace:
        definition = {c: stmt.excluded[c] for c in ("workflow", "key", "schedule", "input")}
        stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={**definition, "updated_at": now})
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=["name"])
    return bool(conn.execute(stmt.returning(schedules.c.name)).first() is not None)


def update_definition_txn(db: Database, conn: Connection, name: str, values: dict[str, Any]) -> bool:
    """Change a schedule's workflow, key, schedule text or input; False if there is none."""
    query = update(schedules).where(schedules.c.name == name).values(**values, updated_at=db.now())
    return bool(conn.execute(query).rowcount == 1)


def set_enabled_txn(db: Database, conn: Connection, name: str, enabled: bool) -> bool:
    """Switch a schedule on (its failure count starts again) or off; False if there is none."""
    values: dict[str, Any] = {"enabled": enabled, "updated_at": db.now()}
    values.update({"failures": 0, "disabled_at": None} if enabled else {"disabled_at": db.now()})
    query = update(schedules).where(schedules.c.name == name).values(**values)
    return bool(conn.execute(query).rowcount == 1)


def delete_schedule_txn(conn: Connection, name: str) -> bool:
    """Forget a schedule's state; False if there was none."""
    return bool(conn.execute(delete(schedules).where(schedules.c.name == name)).rowcount == 1)


def record_fire_txn(
    db: Database,
    conn: Connection,
    name: str,
    *,
    outcome: str,
    run_id: str | None,
    add_failures: int,
    reset: bool,
    max_failures: int,
    seen: tuple[str | None, str | None] | None = None,
) -> Any:
    """Record one fire of an enabled schedule in one statement: its outcome and run, and the
    failure count (reset first on a success, then ``add_failures`` added); at ``max_failures``
    the schedule is switched off. With ``seen`` (last run id, last outcome) the row is only
    changed if another fire has not recorded meanwhile. Returns (failures, enabled) or None."""
    base = literal(0, Integer) if reset else schedules.c.failures
    failures = base + add_failures
    now = db.now()
    query = (
        update(schedules)
        .where(schedules.c.name == name, schedules.c.enabled.is_(True))
        .values(
            failures=failures,
            enabled=failures < max_failures,
            disabled_at=case((failures >= max_failures, now), else_=schedules.c.disabled_at),
            last_outcome=outcome,
            last_run_id=run_id if run_id is not None else schedules.c.last_run_id,
            last_fire_at=now,
            updated_at=now,
        )
        .returning(schedules.c.failures, schedules.c.enabled, schedules.c.last_run_id)
    )
    if seen is not None:
        query = query.where(
            schedules.c.last_run_id.is_not_distinct_from(seen[0]),
            schedules.c.last_outcome.is_not_distinct_from(seen[1]),
        )
    return conn.execute(query).first()
