"""Rules for revisions after the first release's (0001-0005), checked on their source: an
index on a table that already holds rows is built ``CONCURRENTLY`` (no write lock while it
builds), which PostgreSQL runs outside a transaction: inside ``op.get_context().autocommit_block()``.
docs/production.md ("Migrations that add an index") says why."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

VERSIONS = Path(__file__).resolve().parents[2] / "durable_celery" / "store" / "migrations" / "versions"
RELEASED = 5  # revisions up to this number shipped with plain CREATE INDEX, measured in the docs


def index_problems(source: str) -> list[str]:
    """Each index build of a revision that would lock an existing table's writes."""
    tree = ast.parse(source)
    created = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "create_table"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    in_autocommit: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any("autocommit_block" in ast.unparse(item) for item in node.items):
            in_autocommit.update(id(inner) for inner in ast.walk(node))
    problems = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "create_index"):
            continue
        table = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
        if table in created:
            continue  # a new table is empty: nothing waits for its index
        concurrent = any(
            k.arg == "postgresql_concurrently" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords
        )
        if not concurrent:
            problems.append(f"line {node.lineno}: index on {table} without postgresql_concurrently=True")
        elif id(node) not in in_autocommit:
            problems.append(f"line {node.lineno}: concurrent index on {table} outside autocommit_block()")
    return problems


def _revisions_after_release() -> list[Path]:
    return [p for p in sorted(VERSIONS.glob("[0-9]*.py")) if int(p.name[:4]) > RELEASED]


def test_revisions_after_the_release_build_indexes_concurrently():
    found = {p.name: index_problems(p.read_text()) for p in _revisions_after_release()}
    assert {name: problems for name, problems in found.items() if problems} == {}


def test_the_released_revisions_are_the_ones_measured():
    assert [p.name[:4] for p in sorted(VERSIONS.glob("[0-9]*.py"))][:RELEASED] == [
        "0001",
        "0002",
        "0003",
        "0004",
        "0005",
    ]


GOOD = """
def upgrade():
    op.create_table("durable_new", sa.Column("id", sa.Integer()))
    op.create_index("ix_new", "durable_new", ["id"])
    with op.get_context().autocommit_block():
        op.create_index("ix_runs_x", "durable_runs", ["x"], postgresql_concurrently=True)
"""
PLAIN = """
def upgrade():
    op.create_index("ix_runs_x", "durable_runs", ["x"])
"""
IN_TRANSACTION = """
def upgrade():
    op.create_index("ix_runs_x", "durable_runs", ["x"], postgresql_concurrently=True)
"""


def test_the_check_tells_a_locking_index_build_from_a_concurrent_one():
    assert index_problems(textwrap.dedent(GOOD)) == []
    assert index_problems(textwrap.dedent(PLAIN)) == [
        "line 3: index on durable_runs without postgresql_concurrently=True"
    ]
    assert index_problems(textwrap.dedent(IN_TRANSACTION)) == [
        "line 3: concurrent index on durable_runs outside autocommit_block()"
    ]
