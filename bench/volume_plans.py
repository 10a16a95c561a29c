"""``python -m bench.volume plans --db bench_volume_10m``: which ops' statements read a whole big table.

Each op of ``volume_ops`` runs once while its statements are captured; each statement's plan
(``EXPLAIN (FORMAT JSON)`` with its captured parameters, in a transaction rolled back) is read
for a ``Seq Scan`` of durable_runs, durable_steps, durable_activity, durable_keys or
durable_events. The admin's changelists are asked in ``volume_admin``'s process
(``--statements``). The CI guard (``tests/integration/store/test_plans_at_volume.py``) makes the
same check on a database of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import click

from bench.common import say
from bench.volume_build import SERVER
from bench.volume_ops import Capture, Op, Target, explainable, operations, plan_of, seq_scans, table_rows


def op_statements(op: Op, target: Target) -> list[tuple[str, Any]]:
    """The statements ``op`` sends on ``target``, each with its parameters."""
    capture = Capture([target.durable.db.engine])
    try:
        with capture.during() as statements:
            op.call(target)
        return list(statements)
    finally:
        capture.close()


def whole_table_reads(target: Target, statements: list[tuple[str, Any]]) -> list[str]:
    """Each distinct statement that reads a big table whole (a Seq Scan, or a whole index): the
    tables (with the scan's filter) and the statement."""
    found, rows = [], table_rows(target.durable)
    for statement, parameters in dict.fromkeys((s, json.dumps(p, default=str)) for s, p in statements):
        if not explainable(statement):
            continue
        plan = plan_of(target.durable, statement, json.loads(parameters), analyze=False)
        tables = seq_scans(plan, rows)
        if tables:
            text = " ".join(statement.split())
            shown = text if len(text) < 700 else f"{text[:200]} ... {text[-450:]}"
            found.append(f"reads whole: {'; '.join(sorted(set(tables)))}\n    in: {shown}")
    return found


def admin_statements(database: str, server: str) -> dict[str, list[Any]]:
    """Each admin view's statements, sent in ``bench.volume_admin``'s process."""
    command = [
        sys.executable,
        "-m",
        "bench.volume_admin",
        "--db",
        database,
        "--statements",
        "--server",
        server,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"bench.volume_admin failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])["statements"]


@click.command()
@click.option("--db", "name", required=True, help="A built database.")
@click.option("--no-admin", is_flag=True, help="Leave out the Django admin's changelists.")
@click.option("--server", default=SERVER, show_default=True)
def plans(name: str, no_admin: bool, server: str) -> None:
    """Print each op whose statements read a whole big table, with the statement."""
    from bench.volume import database_name
    from bench.volume_time import open_target

    target = open_target(server, database_name(name, 0))
    clean = 0
    for op in operations():
        reads = whole_table_reads(target, op_statements(op, target))
        clean += not reads
        for read in reads:
            say(f"{op.name}: {read}")
    admin = {} if no_admin else admin_statements(target.database, server)
    for view, statements in admin.items():
        reads = whole_table_reads(target, [(s, p) for s, p in statements])
        clean += not reads
        for read in reads:
            say(f"{view}: {read}")
    say(f"{clean} of {len(operations()) + len(admin)} ops read no big table whole on {target.label}")
