"""Statements of PostgreSQL's upkeep: table health from the catalog, long transactions, and
the autovacuum settings of our tables. PostgreSQL only; the callers skip them on SQLite."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, text
from sqlalchemy.exc import DBAPIError

from ..errors import DurableError
from .db import short_reason

# Per table: live and dead rows, when (auto)vacuum and (auto)analyze last came, the sizes of
# the heap, of its indexes and of everything (with TOAST), and the point at which autovacuum
# starts on it (the table's own reloptions, else the server's settings). Tables are resolved
# through the search_path, as every other statement of ours is.
_TABLE_HEALTH = text(
    """
    SELECT c.relname AS table_name,
           coalesce(s.n_live_tup, 0) AS live_rows,
           coalesce(s.n_dead_tup, 0) AS dead_rows,
           s.last_vacuum, s.last_autovacuum, s.last_analyze, s.last_autoanalyze,
           now() AS checked_at,
           pg_relation_size(c.oid) AS heap_bytes,
           pg_indexes_size(c.oid) AS index_bytes,
           pg_total_relation_size(c.oid) AS total_bytes,
           current_setting('autovacuum') = 'on' AS server_autovacuum,
           coalesce(o.enabled, 'true') NOT IN ('false', 'off', '0', 'no') AS table_autovacuum,
           coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold'))::float8
             + coalesce(o.scale_factor, current_setting('autovacuum_vacuum_scale_factor'))::float8
               * greatest(c.reltuples, 0) AS autovacuum_at
    FROM pg_class c
    LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
    LEFT JOIN LATERAL (
        SELECT max(option_value) FILTER (WHERE option_name = 'autovacuum_enabled') AS enabled,
               max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold') AS threshold,
               max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor')
                 AS scale_factor
        FROM pg_options_to_table(c.reloptions)
    ) o ON true
    WHERE c.oid = ANY(SELECT to_regclass(name) FROM unnest(CAST(:tables AS text[])) AS name)
    ORDER BY pg_total_relation_size(c.oid) DESC
    """
).bindparams(bindparam("tables"))

# Client sessions of this database, other than this one, whose transaction has been open for
# longer than ``open_for`` seconds: running a statement, or idle in it (which holds back vacuum
# all the same). Autovacuum's own workers are left out: vacuum does not hold back vacuum.
# Ages are from the server's clock.
_LONG_TRANSACTIONS = text(
    """
    SELECT pid, application_name, usename AS user_name, client_addr::text AS client_addr, state,
           extract(epoch FROM now() - xact_start)::float8 AS open_seconds,
           extract(epoch FROM now() - state_change)::float8 AS state_seconds,
           left(query, 80) AS query
    FROM pg_stat_activity
    WHERE datname = current_database()
      AND backend_type = 'client backend'
      AND pid <> pg_backend_pid()
      AND xact_start IS NOT NULL
      AND xact_start < now() - make_interval(secs => :open_for)
    ORDER BY xact_start
    LIMIT :limit
    """
)

_TABLE_OPTIONS = text(
    """
    SELECT c.relname AS table_name, coalesce(c.reloptions, CAST('{}' AS text[])) AS options
    FROM pg_class c
    WHERE c.oid = ANY(SELECT to_regclass(name) FROM unnest(CAST(:tables AS text[])) AS name)
    ORDER BY c.relname
    """
).bindparams(bindparam("tables"))


def table_health(conn: Connection, tables: Sequence[str]) -> Sequence[Any]:
    """Per table that exists: rows live and dead, last (auto)vacuum and (auto)analyze, sizes of
    heap, indexes and total, whether autovacuum is on for the server and for the table, and the
    dead rows it starts at."""
    return conn.execute(_TABLE_HEALTH, {"tables": list(tables)}).all()


def long_transactions(conn: Connection, open_for: float, limit: int) -> Sequence[Any]:
    """Other sessions of this database whose transaction is open for longer than ``open_for``
    seconds, oldest first: pid, application name, user, client, state and ages."""
    return conn.execute(_LONG_TRANSACTIONS, {"open_for": float(open_for), "limit": limit}).all()


def table_options(conn: Connection, tables: Sequence[str]) -> dict[str, list[str]]:
    """The storage parameters (``pg_class.reloptions``) set on each table, as ``name=value``."""
    rows = conn.execute(_TABLE_OPTIONS, {"tables": list(tables)}).all()
    return {r.table_name: list(r.options) for r in rows}


def set_table_options_sql(conn: Connection, table: str, options: dict[str, Any]) -> str:
    """The ``ALTER TABLE ... SET (...)`` statement that sets ``options`` on ``table``."""
    name = conn.dialect.identifier_preparer.quote(table)
    settings = ", ".join(f"{option} = {value}" for option, value in options.items())
    return f"ALTER TABLE {name} SET ({settings})"


def set_table_options(conn: Connection, statement: str, lock_timeout: float) -> None:
    """Run one statement of :func:`set_table_options_sql` in its own transaction, giving up
    after ``lock_timeout`` seconds rather than waiting behind a running VACUUM or DDL."""
    try:
        with conn.begin():
            conn.execute(
                text("SELECT set_config('lock_timeout', :ms, true)"), {"ms": str(int(lock_timeout * 1000))}
            )
            conn.exec_driver_sql(statement)
    except DBAPIError as exc:
        # A lock not granted in time (55P03), or a role that does not own the table (42501).
        raise DurableError(f"{statement}: {short_reason(exc.orig or exc)}") from exc
