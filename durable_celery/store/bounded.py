"""Reads that cost the same at 10 million runs as at 100,000: counts that stop at a cap, and
plans kept plain.

A count for people stops at ``COUNT_CAP`` (shown as "10,000+": :func:`shown_count`), so it reads
at most that many index entries however many runs are kept. The upkeep's passes run every few
seconds on every worker: their reads turn PostgreSQL's JIT off (:func:`no_jit`), since a
statement whose estimated cost passes ``jit_above_cost`` (a large table, an estimate made from
a sample of it) would spend far longer compiling than the index scan it runs takes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select

COUNT_CAP = 10_000  # rows a count for people reads at most; more is shown as "10,000+"


def no_jit(conn: Connection) -> None:
    """PostgreSQL: no JIT compilation for the rest of this transaction (``SET LOCAL``)."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SET LOCAL jit = off")


def capped_count(query: Any, cap: int = COUNT_CAP) -> Any:
    """SQL: how many rows ``query`` (a SELECT) gives, counting at most ``cap + 1`` (more than
    ``cap`` means at least that many)."""
    inner = query.limit(cap + 1).subquery()
    return select(func.count()).select_from(inner)


def shown_count(n: int, cap: int = COUNT_CAP) -> str:
    """A capped count for people: ``1,234``, or ``10,000+`` past the cap."""
    return f"{cap:,}+" if n > cap else f"{n:,}"
