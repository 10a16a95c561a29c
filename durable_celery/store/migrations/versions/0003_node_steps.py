"""node steps: the workflows and steps each worker node's code has

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("durable_nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("steps", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("durable_nodes", schema=None) as batch_op:
        batch_op.drop_column("steps")
