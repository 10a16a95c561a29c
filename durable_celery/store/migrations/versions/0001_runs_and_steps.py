"""runs and steps

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_runs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("workflow", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=24), nullable=False),
        sa.Column(
            "input",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "context",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "output",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "error",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("key", sa.String(length=255), nullable=True),
        sa.Column("holds_key", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("runs_after_id", sa.String(length=36), nullable=True),
        sa.Column("parent_id", sa.String(length=36), nullable=True),
        sa.Column("step_index", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("fence", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("locked_by", sa.String(length=255), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("published", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("losses", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_durable_runs")),
    )
    op.create_index(
        "ix_durable_runs_due",
        "durable_runs",
        ["due_at"],
        unique=False,
        postgresql_where=sa.text("due_at IS NOT NULL"),
        sqlite_where=sa.text("due_at IS NOT NULL"),
    )
    op.create_index(
        "ix_durable_runs_locked",
        "durable_runs",
        ["heartbeat_at"],
        unique=False,
        postgresql_where=sa.text("locked_by IS NOT NULL"),
        sqlite_where=sa.text("locked_by IS NOT NULL"),
    )
    op.create_index("ix_durable_runs_status_created", "durable_runs", ["status", "created_at"], unique=False)
    op.create_index(
        "ix_durable_runs_workflow_created", "durable_runs", ["workflow", "created_at"], unique=False
    )
    op.create_index(
        "ix_durable_runs_workflow_key",
        "durable_runs",
        ["workflow", "key"],
        unique=False,
        postgresql_where=sa.text("key IS NOT NULL"),
        sqlite_where=sa.text("key IS NOT NULL"),
    )
    op.create_table(
        "durable_steps",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=24), nullable=False),
        sa.Column(
            "input",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "output",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "error",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["durable_runs.id"], name=op.f("fk_durable_steps_run_id"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_durable_steps")),
    )
    op.create_index(
        "ux_durable_steps_run_step_attempt", "durable_steps", ["run_id", "step_index", "attempt"], unique=True
    )


def downgrade() -> None:
    op.drop_index("ux_durable_steps_run_step_attempt", table_name="durable_steps")
    op.drop_table("durable_steps")
    op.drop_index(
        "ix_durable_runs_workflow_key",
        table_name="durable_runs",
        postgresql_where=sa.text("key IS NOT NULL"),
        sqlite_where=sa.text("key IS NOT NULL"),
    )
    op.drop_index("ix_durable_runs_workflow_created", table_name="durable_runs")
    op.drop_index("ix_durable_runs_status_created", table_name="durable_runs")
    op.drop_index(
        "ix_durable_runs_locked",
        table_name="durable_runs",
        postgresql_where=sa.text("locked_by IS NOT NULL"),
        sqlite_where=sa.text("locked_by IS NOT NULL"),
    )
    op.drop_index(
        "ix_durable_runs_due",
        table_name="durable_runs",
        postgresql_where=sa.text("due_at IS NOT NULL"),
        sqlite_where=sa.text("due_at IS NOT NULL"),
    )
    op.drop_table("durable_runs")
