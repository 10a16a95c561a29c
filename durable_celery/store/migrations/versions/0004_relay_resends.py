"""relay resends: how often the relay re-sent a run's message, and when it looks again

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("resends", sa.Integer(), server_default=sa.text("0"), nullable=False))
        batch_op.add_column(sa.Column("resend_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.drop_column("resend_at")
        batch_op.drop_column("resends")
