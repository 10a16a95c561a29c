"""batches: a batch workflow's open batches, and the batch key of a run that gathered starts

A new table, ``durable_batches`` (one row per open batch: the run gathering it, its item count
and when it closes), and a nullable column ``durable_runs.batch_key`` (no rewrite). Nothing to
backfill: no run gathered a batch before this revision.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    if "batch_key" not in {column["name"] for column in inspector.get_columns("durable_runs")}:
        with op.batch_alter_table("durable_runs", schema=None) as batch_op:
            batch_op.add_column(sa.Column("batch_key", sa.String(length=255), nullable=True))
    if not inspector.has_table("durable_batches"):
        op.create_table(
            "durable_batches",
            sa.Column("workflow", sa.String(length=200), nullable=False),
            sa.Column("batch_key", sa.String(length=255), nullable=False),
            sa.Column("run_id", sa.String(length=36), nullable=False),
            sa.Column("items", sa.Integer(), nullable=False),
            sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("closes_at", sa.DateTime(timezone=True), nullable=False),
            sa.PrimaryKeyConstraint("workflow", "batch_key", name=op.f("pk_durable_batches")),
        )


def downgrade() -> None:
    op.drop_table("durable_batches")
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.drop_column("batch_key")
