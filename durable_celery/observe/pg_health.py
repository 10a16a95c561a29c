"""PostgreSQL upkeep, seen from ``durable status`` and ``durable doctor``, and the autovacuum
settings ``durable tune-vacuum`` recommends.

Findings (``kind``), none fixable by ``--fix``:

* ``dead_tuples``: a busy table whose dead rows are past ``DEAD_RATIO`` of its rows, and at
  least ``DEAD_MIN_ROWS``. Autovacuum is not keeping up, or a long transaction stops it.
* ``vacuum_overdue``: a busy table with dead rows past the point where autovacuum starts on it,
  not vacuumed (by hand or by autovacuum) for ``VACUUM_OVERDUE_AFTER``, or never.
* ``long_transaction``: a session of this database whose transaction has been open (running, or
  idle in it) for longer than ``LONG_TRANSACTION_AFTER``: vacuum keeps every row it may still
  see, in every table.

On SQLite there are no such figures: every function here returns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from ..errors import DurableError
from ..store import health_rows
from ..store.db import Database
from ..store.schema import activity, events, keys, runs, steps

# The tables written for every run or step: status and doctor look at these.
BUSY_TABLES = (runs.name, steps.name, keys.name, events.name, activity.name)
DEAD_RATIO = 0.20  # dead rows as a share of all rows past which a table is a finding
DEAD_MIN_ROWS = 10_000  # ... and only with at least this many dead rows (small tables churn)
VACUUM_OVERDUE_AFTER = 86_400.0  # seconds since the last (auto)vacuum of a table due for one
VACUUM_OVERDUE_MIN_ROWS = 1_000  # dead rows below which an unvacuumed table is not a finding
LONG_TRANSACTION_AFTER = 60.0  # seconds a transaction may stay open before it is a finding
LIMIT = 100  # long transactions reported at most

# ``tune-vacuum``: the two tables that change most (a run's row gets a new version at every
# claim, record and heartbeat; step rows are deleted in bulk by pruning), and what to set.
TUNED_TABLES = (runs.name, steps.name)
RECOMMENDED: dict[str, Any] = {
    # Vacuum at 2% dead rows, not PostgreSQL's 20%: on a million runs, 20,000 dead rows rather
    # than 200,000 before vacuum comes, so the claim's index scans skip few dead entries.
    "autovacuum_vacuum_scale_factor": 0.02,
    # Analyze at 1%, not 10%: the share of runs per status moves fast, and the planner picks
    # the partial indexes (due, locked, finished) by those estimates.
    "autovacuum_analyze_scale_factor": 0.01,
    # Five times the default budget (200) for these two tables only, so the frequent small
    # vacuums above end quickly; tables with their own cost limit are left out of balancing.
    "autovacuum_vacuum_cost_limit": 1000,
}
LOCK_TIMEOUT = 5.0  # seconds ``tune-vacuum --apply`` waits for a table's lock


@dataclass
class HealthIssue:
    """One finding about PostgreSQL's upkeep: its kind, what it says, and its figures."""

    kind: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def table_figures(db: Database, conn: Connection) -> list[dict[str, Any]]:
    """Per busy table: rows live and dead, the dead share, sizes, last vacuum and analyze
    (largest table first); empty on SQLite."""
    if not db.is_postgres:
        return []
    return [_figures(row) for row in health_rows.table_health(conn, BUSY_TABLES)]


def _figures(row: Any) -> dict[str, Any]:
    vacuumed, vacuum_kind = _latest(row.last_vacuum, row.last_autovacuum)
    analyzed, _ = _latest(row.last_analyze, row.last_autoanalyze)
    total_rows = row.live_rows + row.dead_rows
    return {
        "table": row.table_name,
        "live_rows": int(row.live_rows),
        "dead_rows": int(row.dead_rows),
        "dead_ratio": round(row.dead_rows / total_rows, 4) if total_rows else 0.0,
        "heap_bytes": int(row.heap_bytes),
        "index_bytes": int(row.index_bytes),
        "total_bytes": int(row.total_bytes),
        "last_vacuum": vacuumed.isoformat() if vacuumed else None,
        "last_vacuum_by": vacuum_kind,
        "last_vacuum_seconds": _seconds_since(vacuumed, row.checked_at),
        "last_analyze_seconds": _seconds_since(analyzed, row.checked_at),
        "autovacuum_on": bool(row.server_autovacuum and row.table_autovacuum),
        "autovacuum_off_by": "server"
        if not row.server_autovacuum
        else (None if row.table_autovacuum else "table"),
        "autovacuum_at": int(row.autovacuum_at),
    }


def _latest(manual: datetime | None, auto: datetime | None) -> tuple[datetime | None, str | None]:
    """The later of a manual and an automatic run, and which it was."""
    if manual is None and auto is None:
        return None, None
    if auto is None or (manual is not None and manual > auto):
        return manual, "manual"
    return auto, "autovacuum"


def _seconds_since(at: datetime | None, now: datetime) -> float | None:
    return None if at is None else max(0.0, (now - at).total_seconds())


def findings(db: Database, conn: Connection) -> list[HealthIssue]:
    """``dead_tuples``, ``vacuum_overdue`` and ``long_transaction`` issues; none on SQLite."""
    if not db.is_postgres:
        return []
    found: list[HealthIssue] = []
    for table in table_figures(db, conn):
        found += _table_issues(table)
    found += [
        _long_transaction(row) for row in health_rows.long_transactions(conn, LONG_TRANSACTION_AFTER, LIMIT)
    ]
    return found


def _table_issues(t: dict[str, Any]) -> list[HealthIssue]:
    issues = []
    name, dead = t["table"], t["dead_rows"]
    shown = (
        "table",
        "dead_rows",
        "live_rows",
        "dead_ratio",
        "last_vacuum",
        "autovacuum_on",
        "autovacuum_off_by",
    )
    facts = {k: t[k] for k in shown}
    if dead >= DEAD_MIN_ROWS and t["dead_ratio"] > DEAD_RATIO:
        issues.append(
            HealthIssue(
                "dead_tuples",
                f"{name}: {dead:,} dead rows, {t['dead_ratio']:.0%} of its rows (over {DEAD_RATIO:.0%}): "
                f"{_why_not_vacuumed(t)}",
                facts,
            )
        )
    age = t["last_vacuum_seconds"]
    overdue = age is None or age > VACUUM_OVERDUE_AFTER
    if overdue and dead >= max(VACUUM_OVERDUE_MIN_ROWS, t["autovacuum_at"]):
        since = (
            "never vacuumed (since its statistics began)"
            if age is None
            else f"last vacuumed {age_text(age)} ago"
        )
        issues.append(
            HealthIssue(
                "vacuum_overdue",
                f"{name}: {dead:,} dead rows, past the {t['autovacuum_at']:,} at which autovacuum "
                f"starts on it, and {since}: {_why_not_vacuumed(t)}",
                {**facts, "autovacuum_at": t["autovacuum_at"], "last_vacuum_seconds": age},
            )
        )
    return issues


def _why_not_vacuumed(t: dict[str, Any]) -> str:
    if t["autovacuum_off_by"] == "server":
        return f"autovacuum is off on this server (autovacuum = off); run VACUUM (ANALYZE) {t['table']}"
    if t["autovacuum_off_by"] == "table":
        return (
            f"autovacuum is off for the table (autovacuum_enabled = false); run VACUUM (ANALYZE) {t['table']}"
        )
    return (
        "autovacuum is not keeping up: look for long transactions, see `durable tune-vacuum`, "
        f"or run VACUUM (ANALYZE) {t['table']}"
    )


def _long_transaction(row: Any) -> HealthIssue:
    app = f"application {row.application_name!r}" if row.application_name else "no application name"
    if row.state and row.state.startswith("idle in transaction"):
        doing = f"{row.state} for {age_text(row.state_seconds)}"
    elif row.state == "active":
        doing = f"running a statement for {age_text(row.state_seconds)}"
    else:
        doing = row.state or "its state hidden from this role"
    return HealthIssue(
        "long_transaction",
        f"pid {row.pid} ({app}, user {row.user_name}) has had a transaction open for "
        f"{age_text(row.open_seconds)}, {doing}: vacuum cannot remove rows it may still see; "
        "end it (pg_terminate_backend) or set idle_in_transaction_session_timeout",
        {
            "pid": row.pid,
            "application_name": row.application_name,
            "user": row.user_name,
            "client_addr": row.client_addr,
            "state": row.state,
            "open_seconds": round(row.open_seconds, 1),
            "state_seconds": None if row.state_seconds is None else round(row.state_seconds, 1),
            "query": row.query,
        },
    )


def age_text(seconds: float) -> str:
    """A short age: ``45s``, ``12m``, ``3.5h``, ``2.0d``."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86_400:.1f}d"


def size_text(size: int) -> str:
    """Bytes as PostgreSQL's ``pg_size_pretty`` would put them, to one decimal."""
    value = float(size)
    for unit in ("bytes", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"  # pragma: no cover - the loop returns at GB


def table_lines(tables: list[dict[str, Any]], is_postgres: bool) -> list[str]:
    """The table part of ``durable status``'s text."""
    if not is_postgres:
        return ["tables: sizes and dead rows are PostgreSQL figures; none on SQLite"]
    lines = [
        f"{'table':18}  {'live rows':>10}  {'dead rows':>10}  {'dead':>6}  {'heap':>9}  "
        f"{'indexes':>9}  {'total':>9}  last vacuum"
    ]
    for t in tables:
        age = t["last_vacuum_seconds"]
        vacuumed = "never" if age is None else f"{age_text(age)} ago ({t['last_vacuum_by']})"
        if t["autovacuum_off_by"]:
            vacuumed += f", autovacuum off ({t['autovacuum_off_by']})"
        lines.append(
            f"{t['table'][:18]:18}  {t['live_rows']:>10,}  {t['dead_rows']:>10,}  {t['dead_ratio']:>6.1%}  "
            f"{size_text(t['heap_bytes']):>9}  {size_text(t['index_bytes']):>9}  "
            f"{size_text(t['total_bytes']):>9}  {vacuumed}"
        )
    return lines


def vacuum_statements(db: Database) -> list[tuple[str, list[str], str]]:
    """Per tuned table: the storage parameters set on it now, and the statement that sets the
    recommended ones."""
    if not db.is_postgres:
        raise DurableError("autovacuum settings apply to PostgreSQL only")
    with db.engine.connect() as conn:
        now = health_rows.table_options(conn, TUNED_TABLES)
        return [
            (table, now.get(table, []), health_rows.set_table_options_sql(conn, table, RECOMMENDED))
            for table in TUNED_TABLES
        ]


def apply_vacuum_statement(db: Database, table: str, statement: str) -> list[str]:
    """Run one statement of :func:`vacuum_statements`; returns the table's parameters after it."""
    with db.engine.connect() as conn:
        health_rows.set_table_options(conn, statement, LOCK_TIMEOUT)
        return health_rows.table_options(conn, [table]).get(table, [])
