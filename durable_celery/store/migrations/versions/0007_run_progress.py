"""run progress: what a running step last said of its progress (current_run().set_progress)

One nullable column (no rewrite of durable_runs, no index).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns("durable_runs")}
    if "progress" in present:
        return
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("progress", sa.JSON().with_variant(postgresql.JSONB(), "postgresql")))


def downgrade() -> None:
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.drop_column("progress")
