"""What a read replica says of itself: how far its replay is behind the primary."""

from __future__ import annotations

from sqlalchemy import Connection, text

_LAG = text(
    "SELECT pg_is_in_recovery() AS standby,"
    " CASE WHEN NOT pg_is_in_recovery() THEN NULL"
    " WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0.0"
    " ELSE COALESCE(EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp()), 0.0) END AS lag"
)


def replication_lag(conn: Connection) -> float | None:
    """Seconds the standby on ``conn`` is behind its primary (0 once it replayed everything it
    received); None when ``conn`` is on a primary."""
    row = conn.execute(_LAG).one()
    return None if not row.standby else max(0.0, float(row.lag))
