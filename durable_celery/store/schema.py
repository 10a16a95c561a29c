"""Every table durable_celery keeps, as SQLAlchemy Core tables: the one place for the schema."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import (
    DDL,
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

# Alembic keeps the revision a database is at in this table; the revisions are in SCRIPTS.
VERSION_TABLE = "durable_alembic_version"
SCRIPTS = Path(__file__).parent / "migrations"

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


def _goes_with_run(column: str, ondelete: str, deferred: bool = False) -> ForeignKeyConstraint:
    """A row that goes with its run (``ondelete``: its row is deleted, or the column set NULL).

    On SQLite a foreign key does it. On PostgreSQL the trigger below does it for every DELETE
    of runs, set-based: a foreign key would fire once per deleted run and table (four times
    per run), which made pruning 100,000 runs spend most of its time in those triggers.
    """
    return ForeignKeyConstraint(
        [column],
        ["durable_runs.id"],
        ondelete=ondelete,
        deferrable=True if deferred else None,
        initially="DEFERRED" if deferred else None,
    ).ddl_if(dialect="sqlite")


# name -> (columns, condition): flow control's partial indexes on durable_runs (revision 0006; its
# lines by start time became LINE_INDEX_SPECS in revision 0011).
FLOW_INDEX_SPECS = {
    "ix_durable_runs_slot_held": (("workflow", "slot_key"), "slot_key IS NOT NULL AND locked_by IS NOT NULL"),
    "ix_durable_runs_throttle_begun": (
        ("workflow", "throttle_key", "started_at"),
        "throttle_key IS NOT NULL AND started_at IS NOT NULL",
    ),
    "ix_durable_runs_rate": (("workflow", "rate_key", "created_at"), "rate_key IS NOT NULL"),
    "ix_durable_runs_flow_wait": (("flow_wait", "workflow"), "flow_wait IS NOT NULL AND finished_at IS NULL"),
}
FLOW_INDEXES = [
    Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))
    for name, (columns, where) in FLOW_INDEX_SPECS.items()
]

# name -> (columns, condition): revision 0009's partial indexes on durable_runs.
VOLUME_INDEX_SPECS = {
    "ix_durable_runs_unfinished_children": (("parent_id",), "parent_id IS NOT NULL AND finished_at IS NULL"),
    "ix_durable_runs_unwoken": (
        ("created_at",),
        "status = 'waiting' AND due_at IS NULL AND locked_by IS NULL",
    ),
    "ix_durable_runs_slot_unfinished": (
        ("workflow", "slot_key", "created_at"),
        "slot_key IS NOT NULL AND finished_at IS NULL",
    ),
}
# name -> (columns, condition): revision 0011's lines of flow control, by ``line_at`` (a run's
# start less its priority's aging, or its fair key's turn): the runs waiting for a slot, due or
# parked, those waiting to begin under a throttle, and the unfinished runs of each fair key.
LINE_INDEX_SPECS = {
    "ix_durable_runs_slot_idle_line": (
        ("workflow", "slot_key", "line_at"),
        "slot_key IS NOT NULL AND flow_wait IS NULL AND locked_by IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_slot_parked_line": (
        ("workflow", "slot_key", "line_at"),
        "flow_wait = 'slot' AND finished_at IS NULL",
    ),
    "ix_durable_runs_throttle_line": (
        ("workflow", "throttle_key", "line_at"),
        "throttle_key IS NOT NULL AND started_at IS NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_fair_line": (
        ("workflow", "slot_key", "fair_key", "line_at"),
        "fair_key IS NOT NULL AND finished_at IS NULL",
    ),
}
VOLUME_INDEXES = [
    Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))
    for name, (columns, where) in VOLUME_INDEX_SPECS.items()
]
LINE_INDEXES = [
    Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))
    for name, (columns, where) in LINE_INDEX_SPECS.items()
]


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
    # The key the run was started with; whether it holds it is in durable_keys.
    Column("key", String(255)),
    Column("runs_after_id", String(36)),
    Column("parent_id", String(36)),
    # Which call inside the parent made this child ("<step index>:<n>" or a branch name): a
    # parent step that runs again finds its children instead of starting second copies.
    Column("parent_ref", String(200)),
    # The queue the current step was sent to (for queue stats and pausing).
    Column("queue", String(200)),
    # W3C traceparent of the run's trace: every step attempt is a span in it.
    Column("trace_parent", String(64)),
    # Which step is next or running (its index and name), and its attempt (1-based). The name
    # tells a renamed or removed step (definition_changed) from a new build's step at that index.
    Column("step_index", Integer, nullable=False, server_default=text("0")),
    Column("step_name", String(200)),
    Column("attempt", Integer, nullable=False, server_default=text("1")),
    # Attempts before this count toward an earlier round: a manual retry starts a new round.
    Column("attempt_base", Integer, nullable=False, server_default=text("0")),
    # Bumped by every claim; a worker may only record a result under the token it claimed with.
    Column("fence", Integer, nullable=False, server_default=text("0")),
    Column("locked_by", String(255)),
    Column("heartbeat_at", Timestamp),
    # The outbox: a run with due_at set needs a message once due_at has passed. `published`
    # says one was (or is about to be) sent after commit; the relay re-sends stale ones.
    Column("due_at", Timestamp),
    Column("published", Boolean, nullable=False, server_default=text("false")),
    # The relay's re-sends of a published, unclaimed run: how many it made since the last claim,
    # and when it looks again (None: relay_after after due_at). Intervals double per re-send.
    Column("resends", Integer, nullable=False, server_default=text("0")),
    Column("resend_at", Timestamp),
    # A debounced run is never due later than this (the debounce timeout from its first start).
    Column("not_after", Timestamp),
    # The workflow timeout: an unfinished run is failed after this.
    Column("deadline_at", Timestamp),
    # The event the run waits for, and until when (waits park the run; see waits.py).
    Column("wait_name", String(200)),
    Column("wait_until", Timestamp),
    # How many times a worker lost the run (lock gone stale) during the current step.
    Column("losses", Integer, nullable=False, server_default=text("0")),
    # Flow control (core/flow.py): the run's concurrency, throttle and rate-limit keys ('' for a
    # limit on the whole workflow, NULL for none), and what it is parked for: 'slot' (due_at
    # NULL until a slot frees) or 'throttle' (due_at when the window may let it begin).
    Column("slot_key", String(255)),
    Column("throttle_key", String(255)),
    Column("rate_key", String(255)),
    Column("flow_wait", String(16)),
    # Its place in the lines of its limits (core/runs.py, core/flow.py): its start less
    # ``priority * priority_aging`` seconds, or under a fair limit its fair key's next turn.
    Column("line_at", Timestamp, nullable=False, server_default=text("CURRENT_TIMESTAMP")),
    Column("fair_key", String(255)),
    Column("priority", Integer),  # NULL: 0
    # What the running step last said of its progress (current_run().set_progress): small JSON.
    Column("progress", Json),
    # The run's tags ({"tenant": "acme"}: string keys and values, copied to its children and to
    # the runs retry, rerun and fork make), and the run it was forked from (durable.fork).
    Column("tags", Json),
    Column("forked_from", String(36)),
    # The batch key a batch workflow's run gathered its starts by (core/batches.py).
    Column("batch_key", String(255)),
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
        "ix_durable_runs_deadline",
        "deadline_at",
        postgresql_where=text("deadline_at IS NOT NULL AND finished_at IS NULL"),
        sqlite_where=text("deadline_at IS NOT NULL AND finished_at IS NULL"),
    ),
    Index(
        "ix_durable_runs_finished",
        "status",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
        sqlite_where=text("finished_at IS NOT NULL"),
    ),
    Index(
        "ux_durable_runs_parent_ref",
        "parent_id",
        "parent_ref",
        unique=True,
        postgresql_where=text("parent_id IS NOT NULL"),
        sqlite_where=text("parent_id IS NOT NULL"),
    ),
    # Flow control (core/flow.py), each index over the runs of limited workflows only, so every
    # count a decision makes is bounded however many runs wait: a key's steps holding a slot,
    # its unparked runs not running (the due ones are in line), its runs parked for a slot, its
    # begins in the throttle window, its runs not yet begun, its starts in the rate-limit window,
    # and every parked run (metrics, the upkeep's pass).
    *FLOW_INDEXES,
    # Tagged runs by containment (tags @> '{...}'); PostgreSQL only: SQLite cannot index it.
    Index(
        "ix_durable_runs_tags",
        "tags",
        postgresql_using="gin",
        postgresql_ops={"tags": "jsonb_path_ops"},
        postgresql_where=text("tags IS NOT NULL"),
    ).ddl_if(dialect="postgresql"),
    Index(
        "ix_durable_runs_forked_from",
        "forked_from",
        postgresql_where=text("forked_from IS NOT NULL"),
        sqlite_where=text("forked_from IS NOT NULL"),
    ),
    Index(
        "ix_durable_runs_locked",
        "heartbeat_at",
        postgresql_where=text("locked_by IS NOT NULL"),
        sqlite_where=text("locked_by IS NOT NULL"),
    ),
    # Revision 0009, each over unfinished runs only, so the passes and pages that read them cost
    # the same however many finished runs are kept: unfinished children (the orphans pass),
    # waiting runs with no wake-up set (missed wake-ups; doctor) and the unfinished runs of a
    # concurrency key (the Flow page).
    *VOLUME_INDEXES,
    *LINE_INDEXES,
)

steps = Table(
    "durable_steps",
    metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("run_id", String(36), nullable=False),
    Column("step_index", Integer, nullable=False),
    # "step" for a step's attempts, "compensate" for its compensation's attempts.
    Column("phase", String(16), nullable=False, server_default=text("'step'")),
    Column("name", String(200), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status", String(24), nullable=False),
    Column("input", Json),
    Column("output", Json),
    Column("error", Json),
    # The run's context as this attempt found it (NULL when empty): a fork from the step starts
    # with it (durable.fork).
    Column("context", Json),
    Column("worker", String(255)),
    # Log records the attempt emitted (see log capture), with their OpenTelemetry fields.
    Column("logs", Json),
    Column("started_at", Timestamp, nullable=False),
    Column("finished_at", Timestamp, nullable=False),
    Index(
        "ux_durable_steps_run_step_phase_attempt",
        "run_id",
        "step_index",
        "phase",
        "attempt",
        unique=True,
    ),
    _goes_with_run("run_id", "CASCADE"),
)

# One row per held key: the unique primary key is what lets at most one run hold a key.
# Deleting the holder deletes the row, so a pruned holder's key is free again.
keys = Table(
    "durable_keys",
    metadata,
    Column("workflow", String(200), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("holder_id", String(36), nullable=False),
    # The one run_again run waiting behind the holder, without the key.
    Column("waiting_id", String(36)),
    Column("taken_at", Timestamp, nullable=False),
    Index("ux_durable_keys_holder", "holder_id", unique=True),
    # The key report lists keys newest taken first (revision 0009).
    Index("ix_durable_keys_taken", "taken_at"),
    # Deleting a run (pruning) sets waiting_id to NULL where it points at it: without this
    # index every deleted run would scan the keys table.
    Index(
        "ix_durable_keys_waiting",
        "waiting_id",
        postgresql_where=text("waiting_id IS NOT NULL"),
        sqlite_where=text("waiting_id IS NOT NULL"),
    ),
    # Deferred: a key row may be written before its run row, in the same transaction.
    _goes_with_run("holder_id", "CASCADE", deferred=True),
    _goes_with_run("waiting_id", "SET NULL", deferred=True),
)

# A batch workflow's open batches (core/batches.py): a start with the batch key adds its input
# to the run named here until ``closes_at`` or ``max`` items; a batch that closed is replaced by
# the next start of its key, and dropped by the upkeep. No foreign key: the row may name a run
# the same transaction writes next, and outlives it by no more than the upkeep's next pass.
batches = Table(
    "durable_batches",
    metadata,
    Column("workflow", String(200), primary_key=True),
    Column("batch_key", String(255), primary_key=True),
    Column("run_id", String(36), nullable=False),
    Column("items", Integer, nullable=False),
    Column("opened_at", Timestamp, nullable=False),
    Column("closes_at", Timestamp, nullable=False),
)

# What happened, for people: key decisions and other notable moments, kept for a week.
activity = Table(
    "durable_activity",
    metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("kind", String(40), nullable=False),
    Column("run_id", String(36)),
    Column("workflow", String(200)),
    Column("key", String(255)),
    Column("details", Json, nullable=False),
    Column("at", Timestamp, nullable=False),
    Index("ix_durable_activity_at", "at"),
    Index("ix_durable_activity_run", "run_id"),
    Index("ix_durable_activity_kind_at", "kind", "at"),
    Index("ix_durable_activity_workflow_key", "workflow", "key"),
    # One workflow's key statistics: its entries of a kind, newest first (revision 0010).
    Index("ix_durable_activity_workflow_kind_at", "workflow", "kind", "at"),
)

# Events sent to runs. A run gets one event per name: the row marked `received`; later ones
# are kept and never read. A wait that timed out is recorded as a received row too.
events = Table(
    "durable_events",
    metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("run_id", String(36), nullable=False),
    Column("name", String(200), nullable=False),
    Column("payload", Json),
    Column("received", Boolean, nullable=False, server_default=text("false")),
    Column("timed_out", Boolean, nullable=False, server_default=text("false")),
    Column("created_at", Timestamp, nullable=False),
    Index("ix_durable_events_run_name", "run_id", "name"),
    _goes_with_run("run_id", "CASCADE"),
)

# Worker nodes seen by their heartbeats: who is alive, draining, and which queues they consume.
nodes = Table(
    "durable_nodes",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("queues", Json, nullable=False),
    Column("pid", Integer),
    Column("draining", Boolean, nullable=False, server_default=text("false")),
    Column("started_at", Timestamp, nullable=False),
    Column("seen_at", Timestamp, nullable=False),
    # The node's code: {workflow: [step names]} (rolling deploys: is a step known elsewhere?).
    Column("steps", Json),
)

# Queues an operator paused; a paused queue's steps are handed back until it is resumed.
queues = Table(
    "durable_queues",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    Column("updated_at", Timestamp, nullable=False),
)

# Periodic per-queue samples (ready, running, waiting), kept for a week.
queue_samples = Table(
    "durable_queue_samples",
    metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("queue", String(200), nullable=False),
    Column("ready", Integer, nullable=False),
    Column("running", Integer, nullable=False),
    Column("waiting", Integer, nullable=False),
    Column("oldest_ready_at", Timestamp),
    Column("at", Timestamp, nullable=False),
    Index("ix_durable_queue_samples_at", "at"),
)

# Keyed schedules: their definitions live in the beat scheduler (RedBeat or beat_schedule);
# this is the state every beat and worker shares: failures in a row, last outcome, disabled.
schedules = Table(
    "durable_schedules",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("workflow", String(200), nullable=False),
    Column("key", String(255)),
    Column("schedule", String(200), nullable=False),
    Column("input", Json),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("failures", Integer, nullable=False, server_default=text("0")),
    Column("last_outcome", String(40)),
    Column("last_run_id", String(36)),
    Column("last_fire_at", Timestamp),
    Column("disabled_at", Timestamp),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
)


# PostgreSQL: what goes with a deleted run (every DELETE, the pruner's or anyone's): its steps,
# events and held key, and a key row's waiting_id pointing at it. One pass per statement.
RUNS_DELETED_FUNCTION = """
CREATE OR REPLACE FUNCTION durable_runs_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM durable_steps WHERE run_id = ANY(ARRAY(SELECT id FROM gone));
    DELETE FROM durable_events WHERE run_id = ANY(ARRAY(SELECT id FROM gone));
    DELETE FROM durable_keys WHERE holder_id = ANY(ARRAY(SELECT id FROM gone));
    UPDATE durable_keys SET waiting_id = NULL WHERE waiting_id = ANY(ARRAY(SELECT id FROM gone));
    RETURN NULL;
END
$$
"""
RUNS_DELETED_TRIGGER = """
CREATE TRIGGER durable_runs_deleted AFTER DELETE ON durable_runs
REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION durable_runs_deleted()
"""
# TRUNCATE fires no DELETE trigger: the rows that go with runs are truncated along.
RUNS_TRUNCATED_FUNCTION = """
CREATE OR REPLACE FUNCTION durable_runs_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE durable_steps, durable_events, durable_keys;
    RETURN NULL;
END
$$
"""
RUNS_TRUNCATED_TRIGGER = """
CREATE TRIGGER durable_runs_truncated AFTER TRUNCATE ON durable_runs
FOR EACH STATEMENT EXECUTE FUNCTION durable_runs_truncated()
"""
RUNS_TRIGGERS = (RUNS_DELETED_FUNCTION, RUNS_DELETED_TRIGGER, RUNS_TRUNCATED_FUNCTION, RUNS_TRUNCATED_TRIGGER)
for _ddl in RUNS_TRIGGERS:
    event.listen(metadata, "after_create", DDL(_ddl).execute_if(dialect="postgresql"))


POSTGRES_ONLY_INDEXES = ("ix_durable_runs_tags",)  # containment: SQLite cannot index it


def compare_filter(dialect: str) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """For Alembic's compare_metadata: leave out the foreign keys PostgreSQL does not have, and
    the indexes made for PostgreSQL only on SQLite."""

    def include(obj: Any, _name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
        if type_ == "index" and dialect == "sqlite" and _name in POSTGRES_ONLY_INDEXES:
            return False
        if type_ == "foreign_key_constraint" and dialect != "sqlite":
            return not any(ref.column.table is runs for ref in getattr(obj, "elements", ()))
        return True

    return include
