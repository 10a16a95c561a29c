"""reads at volume: indexes that keep the upkeep's passes and the reports for people bounded by
the unfinished runs, not by every run ever kept

Four indexes, built CONCURRENTLY (starts and claims go on while they build), three of them
partial, over unfinished runs only: the unfinished children of runs (the orphans pass), the
waiting runs with no wake-up set (the missed wake-ups pass) and the unfinished runs of a
concurrency key (the Flow page); and the keys by when they were taken (the key report, newest
first). No column changes.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from alembic import op

from durable_celery.store.index_builds import IndexSpecs, build_concurrently, drop_concurrently

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# name: (table, columns, partial-index condition or None), as written when this revision was made.
INDEXES: IndexSpecs = {
    "ix_durable_runs_unfinished_children": (
        "durable_runs",
        ["parent_id"],
        "parent_id IS NOT NULL AND finished_at IS NULL",
    ),
    "ix_durable_runs_unwoken": (
        "durable_runs",
        ["created_at"],
        "status = 'waiting' AND due_at IS NULL AND locked_by IS NULL",
    ),
    "ix_durable_runs_slot_unfinished": (
        "durable_runs",
        ["workflow", "slot_key", "created_at"],
        "slot_key IS NOT NULL AND finished_at IS NULL",
    ),
    "ix_durable_keys_taken": ("durable_keys", ["taken_at"], None),
}


def upgrade() -> None:
    build_concurrently(op, INDEXES)


def downgrade() -> None:
    drop_concurrently(op, INDEXES)
