"""Every table durable_celery keeps, as SQLAlchemy Core tables: the one place for the schema."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData(
    naming_convention={
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ix": "ix_%(table_name)s_%(column_0_name)s",
    }
)

Json = JSON().with_variant(JSONB(), "postgresql")
Timestamp = DateTime(timezone=True)
AutoId = BigInteger().with_variant(Integer(), "sqlite")

UNFINISHED = ("pending", "running", "waiting", "compensating")
FINISHED = ("completed", "failed", "cancelled", "compensated", "compensation_failed")

runs = Table(
    "durable_runs",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("workflow", String(200), nullable=False),
    Column("status", String(24), nullable=False),
    Column("input", Json, nullable=False),
    Column("context", Json, nullable=False),
    Column("output", Json),
    Column("error", Json),
    Column("key", String(255)),
    Column("holds_key", Boolean, nullable=False, server_default=text("false")),
    Column("runs_after_id", String(36)),
    Column("parent_id", String(36)),
    # Which step is next or running, and its attempt (1-based).
    Column("step_index", Integer, nullable=False, server_default=text("0")),
    Column("attempt", Integer, nullable=False, server_default=text("1")),
    # Bumped by every claim; a worker may only record a result under the token it claimed with.
    Column("fence", Integer, nullable=False, server_default=text("0")),
    Column("locked_by", String(255)),
    Column("heartbeat_at", Timestamp),
    # The outbox: a run with due_at set needs a message once due_at has passed. `published`
    # says one was (or is about to be) sent after commit; the relay re-sends stale ones.
    Column("due_at", Timestamp),
    Column("published", Boolean, nullable=False, server_default=text("false")),
    # How many times a worker lost the run (lock gone stale) during the current step.
    Column("losses", Integer, nullable=False, server_default=text("0")),
    Column("created_at", Timestamp, nullable=False),
    Column("started_at", Timestamp),
    Column("finished_at", Timestamp),
    Index("ix_durable_runs_workflow_created", "workflow", "created_at"),
    Index("ix_durable_runs_status_created", "status", "created_at"),
    Index(
        "ix_durable_runs_workflow_key",
        "workflow",
        "key",
        postgresql_where=text("key IS NOT NULL"),
        sqlite_where=text("key IS NOT NULL"),
    ),
    Index(
        "ix_durable_runs_due",
        "due_at",
        postgresql_where=text("due_at IS NOT NULL"),
        sqlite_where=text("due_at IS NOT NULL"),
    ),
    Index(
        "ix_durable_runs_locked",
        "heartbeat_at",
        postgresql_where=text("locked_by IS NOT NULL"),
        sqlite_where=text("locked_by IS NOT NULL"),
    ),
)

steps = Table(
    "durable_steps",
    metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column(
        "run_id",
        String(36),
        ForeignKey("durable_runs.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("step_index", Integer, nullable=False),
    Column("name", String(200), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status", String(24), nullable=False),
    Column("input", Json),
    Column("output", Json),
    Column("error", Json),
    Column("worker", String(255)),
    Column("started_at", Timestamp, nullable=False),
    Column("finished_at", Timestamp, nullable=False),
    Index("ux_durable_steps_run_step_attempt", "run_id", "step_index", "attempt", unique=True),
)
