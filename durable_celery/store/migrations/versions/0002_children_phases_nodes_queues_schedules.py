"""children, compensation phases, step logs, nodes, queues, queue samples, schedules, key waiting index

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TS = sa.DateTime(timezone=True)
AUTO_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "durable_nodes",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("queues", JSON, nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("draining", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("seen_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_durable_nodes")),
    )
    op.create_table(
        "durable_queue_samples",
        sa.Column("id", AUTO_ID, autoincrement=True, nullable=False),
        sa.Column("queue", sa.String(length=200), nullable=False),
        sa.Column("ready", sa.Integer(), nullable=False),
        sa.Column("running", sa.Integer(), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("oldest_ready_at", TS, nullable=True),
        sa.Column("at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_durable_queue_samples")),
    )
    op.create_index("ix_durable_queue_samples_at", "durable_queue_samples", ["at"], unique=False)
    op.create_table(
        "durable_queues",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_durable_queues")),
    )
    op.create_table(
        "durable_schedules",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("workflow", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=True),
        sa.Column("schedule", sa.String(length=200), nullable=False),
        sa.Column("input", JSON, nullable=True),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("failures", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_outcome", sa.String(length=40), nullable=True),
        sa.Column("last_run_id", sa.String(length=36), nullable=True),
        sa.Column("last_fire_at", TS, nullable=True),
        sa.Column("disabled_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_durable_schedules")),
    )
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("step_name", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("parent_ref", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("queue", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("trace_parent", sa.String(length=64), nullable=True))
        batch_op.create_index(
            "ix_durable_runs_finished",
            ["status", "finished_at"],
            unique=False,
            postgresql_where=sa.text("finished_at IS NOT NULL"),
            sqlite_where=sa.text("finished_at IS NOT NULL"),
        )
        batch_op.create_index(
            "ux_durable_runs_parent_ref",
            ["parent_id", "parent_ref"],
            unique=True,
            postgresql_where=sa.text("parent_id IS NOT NULL"),
            sqlite_where=sa.text("parent_id IS NOT NULL"),
        )
    op.create_index(
        "ix_durable_keys_waiting",
        "durable_keys",
        ["waiting_id"],
        unique=False,
        postgresql_where=sa.text("waiting_id IS NOT NULL"),
        sqlite_where=sa.text("waiting_id IS NOT NULL"),
    )
    with op.batch_alter_table("durable_steps", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("phase", sa.String(length=16), server_default=sa.text("'step'"), nullable=False)
        )
        batch_op.add_column(sa.Column("logs", JSON, nullable=True))
        batch_op.drop_index("ux_durable_steps_run_step_attempt")
        batch_op.create_index(
            "ux_durable_steps_run_step_phase_attempt",
            ["run_id", "step_index", "phase", "attempt"],
            unique=True,
        )


def downgrade() -> None:
    op.drop_index("ix_durable_keys_waiting", table_name="durable_keys")
    with op.batch_alter_table("durable_steps", schema=None) as batch_op:
        batch_op.drop_index("ux_durable_steps_run_step_phase_attempt")
        batch_op.create_index(
            "ux_durable_steps_run_step_attempt", ["run_id", "step_index", "attempt"], unique=True
        )
        batch_op.drop_column("logs")
        batch_op.drop_column("phase")
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.drop_index("ux_durable_runs_parent_ref")
        batch_op.drop_index("ix_durable_runs_finished")
        batch_op.drop_column("trace_parent")
        batch_op.drop_column("queue")
        batch_op.drop_column("parent_ref")
        batch_op.drop_column("step_name")
    op.drop_table("durable_schedules")
    op.drop_table("durable_queues")
    op.drop_index("ix_durable_queue_samples_at", table_name="durable_queue_samples")
    op.drop_table("durable_queue_samples")
    op.drop_table("durable_nodes")
