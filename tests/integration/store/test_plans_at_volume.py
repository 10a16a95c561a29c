"""No read or upkeep pass reads a whole big table (issue 42): the plan guard of ``bench.volume``.

A database of ``RUNS`` runs is built with the bench's builder (``bench/volume_build.py``: runs of
eight workflows over 30 days with their steps, key rows, events, a week of activity and 3,000
unfinished runs, ``VACUUM ANALYZE``), then every op ``python -m bench.volume time`` times
(``bench/volume_ops.py``: the public reads, CLI reports, dashboard pages and JSON routes, the
metrics scrape, the upkeep passes) runs once while ``before_cursor_execute`` captures its
statements, and the Django admin's views once in a process of their own (``bench/volume_admin.py
--statements``). No statement's plan (``EXPLAIN (FORMAT JSON)`` with its captured parameters)
may read durable_runs, durable_steps, durable_activity, durable_keys or durable_events whole: a
``Seq Scan`` of one, or one of their indexes scanned with no condition and no ``Limit`` for at
least half of the table's rows (``bench/volume_ops.py``, ``seq_scans``).

``RUNS`` is 1,000,000, as the issue asks: the build takes about 40 s on the 2-core development VM
(up to 65 s under load), the whole module about 70 s. The planner sees real tables of that size;
no statistics are faked. ``DURABLE_PLAN_RUNS`` sets another size. The database is this module's
own (``bench_volume_ci_<hex>``), dropped at the end.

``EXCEPTIONS`` read every row by design. ``KNOWN_SLOW`` still read a whole table, each with the
statement that does: expected to fail (``xfail``, not strict) until that statement is rewritten;
empty it as they are. ``AT_CI_SIZE`` read a table whole at 1,000,000 runs but not at 10,000,000
(``python -m bench.volume plans --db bench_volume_10m``): the planner's choice for a table of that
size, not a statement to rewrite.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from bench.volume_app import make_durable, refresh
from bench.volume_build import Builder, drop_database
from bench.volume_ops import Target, operations, pick_sample
from bench.volume_plans import admin_statements, op_statements, whole_table_reads
from tests.conftest import PG_HOST

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(300)]

RUNS = int(os.environ.get("DURABLE_PLAN_RUNS", "1000000"))

# Ops that read every row by design: what they answer needs every row.
EXCEPTIONS = {
    "count_runs()": "counts every run exactly, by design (status_summary() is the bounded overview)",
}

# Ops that still read a whole table, and which statement does: xfail until rewritten.
KNOWN_SLOW: dict[str, str] = {}

# Whole reads at 1,000,000 runs that 10,000,000 do not make: the planner's choice for tables of
# that size (python -m bench.volume plans --db bench_volume_10m finds none of them).
MISSED_WAKEUPS = (
    "at 1,000,000 runs the planner hashes durable_events whole (68,000 rows) for the missed "
    "wake-ups' NOT EXISTS; at 10,000,000 it probes ix_durable_events_run_name per waiting run"
)
READDS = (
    "at 1,000,000 runs durable_activity is 16,000 rows, over half of them the week's re-adds: the "
    "planner reads the table rather than ix_durable_activity_kind_at for the capped counts and the "
    "most re-added keys; at 10,000,000 (152,000 re-adds) it reads the index newest first and stops"
)
AT_CI_SIZE = {
    "doctor()": MISSED_WAKEUPS,
    "durable doctor": MISSED_WAKEUPS,
    "wake_missed_once": MISSED_WAKEUPS,
    "stats.keys()": READDS,
    "durable keys": READDS,
    "GET /keys": READDS,
    "GET /api/keys": READDS,
}


@pytest.fixture(scope="module")
def volume() -> Iterator[Target]:
    """A volume database of ``RUNS`` runs, this module's own; dropped at the end."""
    name = f"bench_volume_ci_{uuid.uuid4().hex[:8]}"
    try:
        Builder(PG_HOST, name, RUNS, 3_000, lambda line: None).run()
        durable = make_durable(f"{PG_HOST}/{name}", "ci")
        refresh(durable)
        target = Target(durable, pick_sample(durable), "ci", RUNS, name)
        yield target
        durable.db.dispose()
    finally:
        drop_database(PG_HOST, name)


def _params(names: list[str]) -> list[Any]:
    """Ops as test parameters, those of KNOWN_SLOW and AT_CI_SIZE marked xfail (not strict)."""
    marked = []
    for name in names:
        reason = KNOWN_SLOW.get(name) or AT_CI_SIZE.get(name)
        marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
        marked.append(pytest.param(name, marks=marks, id=name))
    return marked


OPS = {op.name: op for op in operations()}


@pytest.mark.parametrize("name", _params(list(OPS)))
def test_no_op_reads_a_whole_big_table(volume: Target, name: str) -> None:
    """No statement of the op reads a big table whole."""
    if name in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[name])
    reads = whole_table_reads(volume, op_statements(OPS[name], volume))
    assert not reads, "\n".join(reads)


ADMIN_VIEWS = [
    "admin: runs changelist",
    "admin: runs ?status=failed",
    "admin: runs ?workflow=order",
    "admin: runs search key",
    "admin: run page",
    "admin: keys changelist",
    "admin: steps changelist",
    "admin: activity changelist",
    "admin: schedules changelist",
]


@pytest.fixture(scope="module")
def admin(volume: Target) -> dict[str, list[Any]]:
    """Each admin view's statements, sent in ``bench.volume_admin``'s process."""
    return admin_statements(volume.database, PG_HOST)


@pytest.mark.parametrize("view", _params(ADMIN_VIEWS))
def test_no_admin_view_reads_a_whole_big_table(
    volume: Target, admin: dict[str, list[Any]], view: str
) -> None:
    """No statement of the admin view reads a big table whole."""
    if view in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[view])
    reads = whole_table_reads(volume, [(sql, params) for sql, params in admin[view]])
    assert not reads, "\n".join(reads)
