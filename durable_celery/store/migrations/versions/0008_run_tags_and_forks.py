"""run tags and forks: a run's tags (small string pairs, searched by containment), the run it
was forked from, and the context each step attempt found (what a fork from that step starts with)

Three nullable columns (no rewrite of durable_runs or durable_steps) and two partial indexes
built CONCURRENTLY:
a GIN index over the tags of tagged runs (PostgreSQL; ``tags @> '{...}'``), and the forks of a
run. Runs without tags or fork are in neither index.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TAGS_INDEX, FORKS_INDEX = "ix_durable_runs_tags", "ix_durable_runs_forked_from"


def upgrade() -> None:
    # Runnable again after a try that failed part-way (a build CONCURRENTLY cut off): its
    # columns were committed, and a failed build left an invalid index (dropped first).
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns("durable_runs")}
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        if "tags" not in present:
            batch_op.add_column(sa.Column("tags", sa.JSON().with_variant(postgresql.JSONB(), "postgresql")))
        if "forked_from" not in present:
            batch_op.add_column(sa.Column("forked_from", sa.String(length=36), nullable=True))
    if "context" not in {column["name"] for column in sa.inspect(op.get_bind()).get_columns("durable_steps")}:
        with op.batch_alter_table("durable_steps", schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("context", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"))
            )
    postgres = op.get_bind().dialect.name == "postgresql"
    with op.get_context().autocommit_block():
        for name in _invalid_indexes():
            op.drop_index(name, table_name="durable_runs", postgresql_concurrently=True, if_exists=True)
        if postgres:  # SQLite cannot index containment: its store is for development
            op.create_index(
                TAGS_INDEX,
                "durable_runs",
                ["tags"],
                unique=False,
                postgresql_using="gin",
                postgresql_ops={"tags": "jsonb_path_ops"},
                postgresql_where=sa.text("tags IS NOT NULL"),
                postgresql_concurrently=True,
                if_not_exists=True,
            )
        op.create_index(
            FORKS_INDEX,
            "durable_runs",
            ["forked_from"],
            unique=False,
            postgresql_where=sa.text("forked_from IS NOT NULL"),
            sqlite_where=sa.text("forked_from IS NOT NULL"),
            postgresql_concurrently=True,
            if_not_exists=True,
        )


def _invalid_indexes() -> list[str]:
    """This revision's indexes a failed build CONCURRENTLY left invalid (PostgreSQL)."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return []
    found = bind.execute(
        sa.text(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE NOT i.indisvalid AND c.relname = ANY(:names)"
        ),
        {"names": [TAGS_INDEX, FORKS_INDEX]},
    )
    return [row[0] for row in found]


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name in (TAGS_INDEX, FORKS_INDEX):
            op.drop_index(name, table_name="durable_runs", postgresql_concurrently=True, if_exists=True)
    with op.batch_alter_table("durable_steps", schema=None) as batch_op:
        batch_op.drop_column("context")
    with op.batch_alter_table("durable_runs", schema=None) as batch_op:
        batch_op.drop_column("forked_from")
        batch_op.drop_column("tags")
