"""flow control: each run's concurrency, throttle and rate-limit keys, and what it is parked for

Four nullable columns (no rewrite of durable_runs) and seven partial indexes, built
CONCURRENTLY so starts and claims go on while they build. Runs of workflows without a limit
leave the columns NULL and are in none of the indexes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = (("slot_key", 255), ("throttle_key", 255), ("rate_key", 255), ("flow_wait", 16))
# name: (columns, partial-index condition), as written when this revision was made.
INDEXES = {
    "ix_durable_runs_slot_held": (["workflow", "slot_key"], "slot_key IS NOT NULL AND locked_by IS NOT NULL"),
    "ix_durable_runs_slot_idle": (
        ["workflow", "slot_key", "created_at"],
        "slot_key IS NOT NULL AND flow_wait IS NULL AND locked_by IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_slot_parked": (
        ["workflow", "slot_key", "created_at"],
        "flow_wait = 'slot' AND finished_at IS NULL",
    ),
    "ix_durable_runs_throttle_begun": (
        ["workflow", "throttle_key", "started_at"],
        "throttle_key IS NOT NULL AND started_at IS NOT NULL",
    ),
    "ix_durable_runs_throttle_waiting": (
        ["workflow", "throttle_key", "created_at"],
        "throttle_key IS NOT NULL AND started_at IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_rate": (["workflow", "rate_key", "created_at"], "rate_key IS NOT NULL"),
    "ix_durable_runs_flow_wait": (["flow_wait", "workflow"], "flow_wait IS NOT NULL AND finished_at IS NULL"),
}


def upgrade() -> None:
    # Runnable again after a try that failed part-way (a build CONCURRENTLY cut off by
    # lock_timeout): its columns were committed, and the failed build left an invalid index.
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns("durable_runs")}
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        for name, length in COLUMNS:
            if name not in present:
                batch_op.add_column(sa.Column(name, sa.String(length=length), nullable=True))
    with op.get_context().autocommit_block():
        for name in _invalid_indexes():
            op.drop_index(name, table_name="durable_runs", postgresql_concurrently=True, if_exists=True)
        for name, (columns, where) in INDEXES.items():
            op.create_index(
                name,
                "durable_runs",
                columns,
                unique=False,
                postgresql_where=sa.text(where),
                sqlite_where=sa.text(where),
                postgresql_concurrently=True,
                if_not_exists=True,
            )


def _invalid_indexes() -> list[str]:
    """This revision's indexes a failed build CONCURRENTLY left invalid (PostgreSQL)."""
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
    return [row[0] for row in found]


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name in INDEXES:
            op.drop_index(name, table_name="durable_runs", postgresql_concurrently=True, if_exists=True)
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        for name, _length in reversed(COLUMNS):
            batch_op.drop_column(name)
