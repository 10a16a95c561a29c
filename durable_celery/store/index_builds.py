"""Indexes a schema revision builds CONCURRENTLY (starts and claims go on while they build),
runnable again after a try that failed part-way (a build cut off, by lock_timeout say, leaves an
invalid index, dropped first)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

# name -> (table, columns, partial-index condition or None), as written when the revision was made.
IndexSpecs = dict[str, tuple[str, list[str], str | None]]


def build_concurrently(op: Any, indexes: IndexSpecs) -> None:
    """Build ``indexes`` CONCURRENTLY outside a transaction, dropping an invalid one left first."""
    with op.get_context().autocommit_block():
        for name, table in _invalid(op, indexes):
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
        for name, (table, columns, where) in indexes.items():
            condition = None if where is None else sa.text(where)
            op.create_index(
                name,
                table,
                columns,
                unique=False,
                postgresql_where=condition,
                sqlite_where=condition,
                postgresql_concurrently=True,
                if_not_exists=True,
            )


def drop_concurrently(op: Any, indexes: IndexSpecs) -> None:
    """Drop ``indexes`` CONCURRENTLY outside a transaction (the revision's downgrade)."""
    with op.get_context().autocommit_block():
        for name, (table, _columns, _where) in indexes.items():
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)


def _invalid(op: Any, indexes: IndexSpecs) -> list[tuple[str, str]]:
    """The ``indexes`` a failed build CONCURRENTLY left invalid (PostgreSQL), with their table."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return []
    found = bind.execute(
        sa.text(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE NOT i.indisvalid AND c.relname = ANY(:names)"
        ),
        {"names": list(indexes)},
    )
    return [(row[0], indexes[row[0]][0]) for row in found]
