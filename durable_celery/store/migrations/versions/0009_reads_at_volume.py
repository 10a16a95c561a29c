"""reads at volume: indexes that keep the upkeep's passes and the reports for people bounded by
the unfinished runs, not by every run ever kept

Four indexes, built CONCURRENTLY (starts and claims go on while they build), three of them
partial, over unfinished runs only: the unfinished children of runs (the orphans pass), the
waiting runs with no wake-up set (the missed wake-ups pass) and the unfinished runs of a
concurrency key (the Flow page); and the keys by when they were taken (the key report, newest
first). No column changes.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# name: (table, columns, partial-index condition or None), as written when this revision was made.
INDEXES = {
    "ix_durable_runs_unfinished_children": (
        "durable_runs",
        ["parent_id"],
        "parent_id IS NOT NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_unwoken": (
        "durable_runs",
        ["created_at"],
        "status = 'waiting' AND due_at IS NULL AND locked_by IS NULL",
    ),
    "ix_durable_runs_slot_unfinished": (
        "durable_runs",
        ["workflow", "slot_key", "created_at"],
        "slot_key IS NOT NULL AND finished_at IS NULL",
    ),
    "ix_durable_keys_taken": ("durable_keys", ["taken_at"], None),
}


def upgrade() -> None:
    # Runnable again after a try that failed part-way: a build CONCURRENTLY cut off (by
    # lock_timeout, say) leaves an invalid index, dropped first.
    with op.get_context().autocommit_block():
        for name, table in _invalid_indexes():
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
        for name, (table, columns, where) in INDEXES.items():
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


def _invalid_indexes() -> list[tuple[str, str]]:
    """This revision's indexes a failed build CONCURRENTLY left invalid (PostgreSQL), with their table."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return []
    found = bind.execute(
        sa.text(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE NOT i.indisvalid AND c.relname = ANY(:names)"
        ),
        {"names": list(INDEXES)},
    )
    return [(row[0], INDEXES[row[0]][0]) for row in found]


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, (table, _columns, _where) in INDEXES.items():
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
