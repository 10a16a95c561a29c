"""runs deleted trigger: on PostgreSQL what goes with a deleted run goes in one pass per DELETE

The four foreign keys that pointed at durable_runs (steps, events, a key's holder and its
waiting run) fired once per deleted run each; pruning spent most of its time in them. One
statement-level trigger now deletes the steps, events and held keys of the deleted runs and
clears waiting_id, for any DELETE; a TRUNCATE of durable_runs truncates them along. SQLite
keeps its foreign keys.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from alembic import op

from durable_celery.store.schema import RUNS_TRIGGERS

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

FOREIGN_KEYS = {
    "fk_durable_steps_run_id": ("durable_steps", "run_id", "CASCADE", False),
    "fk_durable_events_run_id": ("durable_events", "run_id", "CASCADE", False),
    "fk_durable_keys_holder_id": ("durable_keys", "holder_id", "CASCADE", True),
    "fk_durable_keys_waiting_id": ("durable_keys", "waiting_id", "SET NULL", True),
}


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    # Trigger first, foreign keys dropped after, in one transaction: no moment without either.
    for ddl in RUNS_TRIGGERS:
        op.execute(ddl)
    for name, (table, _column, _ondelete, _deferred) in FOREIGN_KEYS.items():
        op.drop_constraint(name, table, type_="foreignkey")


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for name, (table, column, ondelete, deferred) in FOREIGN_KEYS.items():
        op.create_foreign_key(
            name,
            table,
            "durable_runs",
            [column],
            ["id"],
            ondelete=ondelete,
            deferrable=True if deferred else None,
            initially="DEFERRED" if deferred else None,
        )
    for name in ("durable_runs_deleted", "durable_runs_truncated"):
        op.execute(f"DROP TRIGGER IF EXISTS {name} ON durable_runs")
        op.execute(f"DROP FUNCTION IF EXISTS {name}()")
