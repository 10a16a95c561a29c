"""activity by workflow: the key statistics of one workflow read only its entries

One index, built CONCURRENTLY (key decisions go on writing activity while it builds): the
activity of a workflow by kind and time, so the week's re-adds and hand-offs of one workflow
(``stats.keys(workflow=...)``, ``durable keys -w``, a workflow's dashboard page) are an index
range, not the newest entries of every workflow filtered row by row. No column changes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from alembic import op

from durable_celery.store.index_builds import IndexSpecs, build_concurrently, drop_concurrently

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

INDEXES: IndexSpecs = {
    "ix_durable_activity_workflow_kind_at": ("durable_activity", ["workflow", "kind", "at"], None),
}


def upgrade() -> None:
    build_concurrently(op, INDEXES)


def downgrade() -> None:
    drop_concurrently(op, INDEXES)
