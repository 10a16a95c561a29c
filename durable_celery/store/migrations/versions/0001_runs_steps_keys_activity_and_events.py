"""runs, steps, keys, activity and events

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
        "durable_activity",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("kind", sa.String(length=40), nullable=False),
        sa.Column("run_id", sa.String(length=36), nullable=True),
        sa.Column("workflow", sa.String(length=200), nullable=True),
        sa.Column("key", sa.String(length=255), nullable=True),
        sa.Column(
            "details",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_durable_activity")),
    )
    op.create_index("ix_durable_activity_at", "durable_activity", ["at"], unique=False)
    op.create_index("ix_durable_activity_kind_at", "durable_activity", ["kind", "at"], unique=False)
    op.create_index("ix_durable_activity_run", "durable_activity", ["run_id"], unique=False)
    op.create_index("ix_durable_activity_workflow_key", "durable_activity", ["workflow", "key"], unique=False)
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
        sa.Column("runs_after_id", sa.String(length=36), nullable=True),
        sa.Column("parent_id", sa.String(length=36), nullable=True),
        sa.Column("step_index", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("attempt_base", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("fence", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("locked_by", sa.String(length=255), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("published", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("not_after", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("wait_name", sa.String(length=200), nullable=True),
        sa.Column("wait_until", sa.DateTime(timezone=True), nullable=True),
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
        "ix_durable_runs_deadline",
        "durable_runs",
        ["deadline_at"],
        unique=False,
        postgresql_where=sa.text("deadline_at IS NOT NULL AND finished_at IS NULL"),
        sqlite_where=sa.text("deadline_at IS NOT NULL AND finished_at IS NULL"),
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
        "durable_events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("received", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("timed_out", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["durable_runs.id"], name=op.f("fk_durable_events_run_id"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_durable_events")),
    )
    op.create_index("ix_durable_events_run_name", "durable_events", ["run_id", "name"], unique=False)
    op.create_table(
        "durable_keys",
        sa.Column("workflow", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("holder_id", sa.String(length=36), nullable=False),
        sa.Column("waiting_id", sa.String(length=36), nullable=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["holder_id"],
            ["durable_runs.id"],
            name=op.f("fk_durable_keys_holder_id"),
            ondelete="CASCADE",
            initially="DEFERRED",
            deferrable=True,
        ),
        sa.ForeignKeyConstraint(
            ["waiting_id"],
            ["durable_runs.id"],
            name=op.f("fk_durable_keys_waiting_id"),
            ondelete="SET NULL",
            initially="DEFERRED",
            deferrable=True,
        ),
        sa.PrimaryKeyConstraint("workflow", "key", name=op.f("pk_durable_keys")),
    )
    op.create_index("ux_durable_keys_holder", "durable_keys", ["holder_id"], unique=True)
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
    op.drop_index("ux_durable_keys_holder", table_name="durable_keys")
    op.drop_table("durable_keys")
    op.drop_index("ix_durable_events_run_name", table_name="durable_events")
    op.drop_table("durable_events")
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
    op.drop_index("ix_durable_runs_deadline", table_name="durable_runs")
    op.drop_table("durable_runs")
    op.drop_index("ix_durable_activity_workflow_key", table_name="durable_activity")
    op.drop_index("ix_durable_activity_run", table_name="durable_activity")
    op.drop_index("ix_durable_activity_kind_at", table_name="durable_activity")
    op.drop_index("ix_durable_activity_at", table_name="durable_activity")
    op.drop_table("durable_activity")
