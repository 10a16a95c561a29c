"""fair share and priority: a run's place in the lines of its flow limits

Three columns on durable_runs: ``line_at`` (NOT NULL; PostgreSQL adds it with the default
CURRENT_TIMESTAMP, which version 11 and later store once for the rows already there: no rewrite),
``fair_key`` and ``priority`` (nullable). The unfinished runs of limited workflows are then lined
up at their start (``line_at = created_at``: a few rows, by the partial indexes of unfinished
runs). Last, the lines' partial indexes by ``line_at`` are built CONCURRENTLY (starts and claims
go on meanwhile) and the three by ``created_at`` they replace dropped CONCURRENTLY.

During a rolling upgrade a producer still on the older code starts runs without ``line_at``:
they get the time of their insert, which is their start.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

from durable_celery.store.index_builds import IndexSpecs, build_concurrently, drop_concurrently

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

LINES: IndexSpecs = {
    "ix_durable_runs_slot_idle_line": (
        "durable_runs",
        ["workflow", "slot_key", "line_at"],
        "slot_key IS NOT NULL AND flow_wait IS NULL AND locked_by IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_slot_parked_line": (
        "durable_runs",
        ["workflow", "slot_key", "line_at"],
        "flow_wait = 'slot' AND finished_at IS NULL",
    ),
    "ix_durable_runs_throttle_line": (
        "durable_runs",
        ["workflow", "throttle_key", "line_at"],
        "throttle_key IS NOT NULL AND started_at IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_fair_line": (
        "durable_runs",
        ["workflow", "slot_key", "fair_key", "line_at"],
        "fair_key IS NOT NULL AND finished_at IS NULL",
    ),
}
# Revision 0006's lines by start time, which LINES replace.
BY_START: IndexSpecs = {
    "ix_durable_runs_slot_idle": (
        "durable_runs",
        ["workflow", "slot_key", "created_at"],
        "slot_key IS NOT NULL AND flow_wait IS NULL AND locked_by IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_slot_parked": (
        "durable_runs",
        ["workflow", "slot_key", "created_at"],
        "flow_wait = 'slot' AND finished_at IS NULL",
    ),
    "ix_durable_runs_throttle_waiting": (
        "durable_runs",
        ["workflow", "throttle_key", "created_at"],
        "throttle_key IS NOT NULL AND started_at IS NULL AND finished_at IS NULL",
    ),
}


def upgrade() -> None:
    # Runnable again after a try that failed part-way (a build CONCURRENTLY cut off): its
    # columns were committed, and a failed build left an invalid index (dropped first).
    bind = op.get_bind()
    present = {column["name"] for column in sa.inspect(bind).get_columns("durable_runs")}
    if "line_at" not in present:
        if bind.dialect.name == "postgresql":
            default = sa.text("CURRENT_TIMESTAMP")
        else:  # SQLite adds a column with a constant default only; every row is lined up below
            default = sa.text("'1970-01-01 00:00:00.000000'")
        op.add_column(
            "durable_runs",
            sa.Column("line_at", sa.DateTime(timezone=True), nullable=False, server_default=default),
        )
    if "fair_key" not in present:
        op.add_column("durable_runs", sa.Column("fair_key", sa.String(length=255), nullable=True))
    if "priority" not in present:
        op.add_column("durable_runs", sa.Column("priority", sa.Integer(), nullable=True))
    # As the partial indexes of revisions 0006 and 0009 say it: the unfinished runs of a slot
    # key, and the runs of a throttle key not yet begun (no other run's place is read).
    lined = (
        "(slot_key IS NOT NULL AND finished_at IS NULL) OR "
        "(throttle_key IS NOT NULL AND started_at IS NULL AND finished_at IS NULL)"
    )
    where = lined if bind.dialect.name == "postgresql" else "1 = 1"
    op.execute(f"UPDATE durable_runs SET line_at = created_at WHERE {where}")
    build_concurrently(op, LINES)
    drop_concurrently(op, BY_START)


def downgrade() -> None:
    build_concurrently(op, BY_START)
    drop_concurrently(op, LINES)
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.drop_column("priority")
        batch_op.drop_column("fair_key")
        batch_op.drop_column("line_at")
