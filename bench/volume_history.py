"""``python -m bench.volume history --db bench_volume_10m``: what keeping history costs (issue 42).

On a copy of the database (``CREATE DATABASE ... TEMPLATE``, named ``bench_volume_scratch_<hex>``,
dropped at the end unless ``--keep``):

1. **Activity**: entries and bytes per day (kept a week by ``trim_activity_once``), then the
   trim's pass timed when a day of entries is past the week (the entries are moved back a day).
2. **Pruning**: ``durable.prune()`` with rules that make the oldest ``--days`` day(s) of finished
   runs due (every finished status), the library's batched prune (20,000 runs a batch, ``SKIP
   LOCKED``, steps, events and key rows going with their runs through the statement trigger):
   runs, steps, key rows and events deleted, seconds, runs a second, each batch's time.
3. **Vacuum**: ``VACUUM (ANALYZE)`` of each big table after the prune, timed, with the tables'
   sizes before and after (the space is reused, the files keep their size).
4. **Partitions** (``--partitions``): durable_runs and durable_steps copied into tables
   partitioned by day (a range of run ids: ids are time-ordered UUIDs, so a day of runs is a
   range of ids, and a run's steps fall in its run's partition by ``run_id``), with the same
   indexes; then dropping the oldest day's partitions (both tables) timed against the prune of
   the same day, and the library's own statements (captured from the reads and passes of
   ``volume_ops``) timed on both layouts: ``EXPLAIN (ANALYZE)`` planning and execution times,
   medians of 5, the statements' table names swapped for the partitioned copies.
"""

from __future__ import annotations

import re
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any

import click
import psycopg

from bench.common import say
from bench.volume_app import make_durable, refresh
from bench.volume_build import PREFIX, SERVER, SIZES, TABLES, admin_url, drop_database, read_mark, write_mark
from bench.volume_ops import Capture, Target, explainable, operations, pick_sample

FINISHED_RULES = ("completed", "failed", "cancelled")
# Ops whose statements are compared on both layouts (reads newest-first, by id, the passes).
COMPARED = (
    "list_runs()",
    "list_runs(status=failed)",
    "list_runs(workflow=order)",
    "get_run",
    "list_steps",
    "list_children",
    "status_summary()",
    "relay_once",
    "fail_overdue_once",
    "sweep_stale_once",
    "wake_slots_once (SlotWaker)",
)

ACTIVITY_DAYS = """
SELECT date_trunc('day', at) AS day, count(*) AS n FROM durable_activity GROUP BY 1 ORDER BY 1
"""


def copy_database(server: str, source: str) -> str:
    """A copy of ``source`` (nothing may be connected to it), marked as this bench's scratch."""
    name = f"{PREFIX}scratch_{uuid.uuid4().hex[:8]}"
    began = time.perf_counter()
    with psycopg.connect(admin_url(server), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{source}"'.encode())
        write_mark(conn, name, {**(read_mark(server, source) or {}), "scratch": True, "copy_of": source})
    say(f"copied {source} to {name} in {time.perf_counter() - began:.0f}s")
    return name


def sizes(conn: psycopg.Connection) -> dict[str, tuple[int, int]]:
    """Rows and total bytes of each big table."""
    return {r[0]: (r[1], r[4]) for r in conn.execute(SIZES, (list(TABLES),)).fetchall()}


def activity_report(conn: psycopg.Connection) -> float:
    """Entries per day and bytes per entry of durable_activity; returns entries a day."""
    days = conn.execute(ACTIVITY_DAYS).fetchall()
    rows, total = conn.execute(
        "SELECT count(*), pg_total_relation_size('durable_activity') FROM durable_activity"
    ).fetchone()
    full = [n for _, n in days[1:-1]] or [n for _, n in days]  # whole days only
    per_day = statistics.mean(full) if full else 0.0
    say(
        f"activity: {rows:,} entries over {len(days)} days ({per_day:,.0f} a whole day), "
        f"{total / 2**20:,.1f} MiB, {total / max(rows, 1):,.0f} bytes an entry (indexes included)"
    )
    return per_day


def time_trim(durable: Any, conn: psycopg.Connection) -> None:
    """Move the entries back a day, then time trim_activity_once (it deletes a day's worth)."""
    from durable_celery.core.sweeps import trim_activity_once

    conn.execute("UPDATE durable_activity SET at = at - interval '1 day'")
    conn.execute("VACUUM ANALYZE durable_activity")
    began = time.perf_counter()
    deleted = trim_activity_once(durable.db)
    took = time.perf_counter() - began
    say(f"trim_activity_once: {deleted:,} entries (a day's) in {took * 1000:,.0f} ms")


def time_prune(url: str, days: int) -> dict[str, float]:
    """durable.prune() with every finished status due after 30 - ``days`` days; what it did."""
    durable = make_durable(url, "prune", {rule: timedelta(days=30 - days) for rule in FINISHED_RULES})
    marks: list[tuple[float, str]] = []
    began = time.perf_counter()
    counts = durable.prune(progress=lambda line: marks.append((time.perf_counter(), line)))
    took = time.perf_counter() - began
    durable.db.dispose()
    deleted = sum(counts.values())
    gaps = [b[0] - a[0] for a, b in zip([(began, "")] + marks, marks, strict=False)]
    say(
        f"prune of {days} day(s): {deleted:,} runs ({counts}) in {took:,.1f} s "
        f"= {deleted / took:,.0f} runs/s; "
        f"{len(marks)} batches of up to 20,000, each {statistics.median(gaps) if gaps else 0:.2f} s "
        f"(median), {max(gaps) if gaps else 0:.2f} s at most"
    )
    return {"runs": deleted, "seconds": took}


def time_vacuum(conn: psycopg.Connection) -> None:
    """VACUUM (ANALYZE) each big table, timed."""
    for table in TABLES:
        began = time.perf_counter()
        conn.execute(f"VACUUM (ANALYZE) {table}".encode())
        say(f"VACUUM (ANALYZE) {table}: {time.perf_counter() - began:,.1f} s")


def _index_sql(conn: psycopg.Connection, table: str, copy: str) -> list[str]:
    """``table``'s indexes as statements on ``copy`` (unique ones without the partition key are
    made plain: PostgreSQL cannot enforce them across partitions)."""
    key = "id" if table == "durable_runs" else "run_id"
    made = []
    for name, definition in conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,)
    ).fetchall():
        text = definition.replace(f"ON public.{table} ", f"ON public.{copy} ").replace(
            f" {name} ", f" p_{name} "
        )
        columns = re.search(r"\((.*?)\)", text)
        if "UNIQUE" in text and columns and key not in [c.strip() for c in columns.group(1).split(",")]:
            text = text.replace("UNIQUE INDEX", "INDEX")
        made.append(text)
    return made


def day_bounds(conn: psycopg.Connection) -> list[str]:
    """Run-id prefixes of each day's first millisecond, from the oldest run's day to tomorrow."""
    first = conn.execute("SELECT min(created_at) FROM durable_runs").fetchone()[0]
    rows = conn.execute(
        "SELECT lpad(to_hex((extract(epoch FROM d) * 1000)::bigint), 12, '0') FROM "
        "generate_series(date_trunc('day', %s::timestamptz), now() + interval '1 day', interval '1 day') d",
        (first,),
    ).fetchall()
    return [f"{r[0][:8]}-{r[0][8:]}" for r in rows]


def build_partitions(conn: psycopg.Connection) -> list[str]:
    """part_runs and part_steps: durable_runs and durable_steps by day; returns the day bounds."""
    bounds = day_bounds(conn)
    for table, copy, key in (("durable_runs", "part_runs", "id"), ("durable_steps", "part_steps", "run_id")):
        conn.execute(
            f"CREATE TABLE {copy} (LIKE {table} INCLUDING DEFAULTS) PARTITION BY RANGE ({key})".encode()
        )
        conn.execute(
            f"CREATE TABLE {copy}_old PARTITION OF {copy} FOR VALUES FROM (MINVALUE) TO ('{bounds[0]}')"
        )
        for n, (low, high) in enumerate(zip(bounds, bounds[1:], strict=False)):
            conn.execute(
                f"CREATE TABLE {copy}_d{n:02d} PARTITION OF {copy} FOR VALUES FROM ('{low}') TO ('{high}')"
            )
        conn.execute(
            f"CREATE TABLE {copy}_new PARTITION OF {copy} FOR VALUES FROM ('{bounds[-1]}') TO (MAXVALUE)"
        )
        began = time.perf_counter()
        conn.execute(f"INSERT INTO {copy} SELECT * FROM {table}".encode())
        for statement in _index_sql(conn, table, copy):
            conn.execute(statement.encode())
        conn.execute(f"VACUUM ANALYZE {copy}".encode())
        say(
            f"{copy}: {table} copied into {len(bounds) + 1} partitions by day "
            f"in {time.perf_counter() - began:,.0f} s"
        )
    return bounds


def time_drop(conn: psycopg.Connection) -> None:
    """Drop a whole day's partitions of both tables (the oldest whole day), timed: what a prune
    of that day would become."""
    runs, steps = conn.execute(
        "SELECT (SELECT count(*) FROM part_runs_d01), (SELECT count(*) FROM part_steps_d01)"
    ).fetchone()
    began = time.perf_counter()
    with conn.transaction():
        conn.execute("DROP TABLE part_steps_d01")
        conn.execute("DROP TABLE part_runs_d01")
    took = time.perf_counter() - began
    say(f"DROP of a day's partitions ({runs:,} runs, {steps:,} steps): {took * 1000:,.0f} ms")


def compare_reads(target: Target, conn: psycopg.Connection, rounds: int = 5) -> None:
    """The library's statements of ``COMPARED`` on durable_* and on part_*: planning and execution ms."""
    ops = {op.name: op for op in operations()}
    capture = Capture([target.durable.db.engine])
    say(f"{'statement of':30} {'plain: plan ms':>14} {'exec ms':>8} {'by day: plan ms':>15} {'exec ms':>8}")
    try:
        for name in COMPARED:
            with capture.during() as statements:
                ops[name].call(target)
            first: dict[str, Any] = {}
            for statement, params in statements:
                if explainable(statement) and "durable_runs" in statement:
                    first.setdefault(statement, params)
            for statement, params in first.items():
                plain = _explain_times(conn, statement, params, rounds)
                parted = statement.replace("durable_runs", "part_runs").replace("durable_steps", "part_steps")
                parts = _explain_times(conn, parted, params, rounds)
                say(f"{name[:30]:30} {plain[0]:>14.2f} {plain[1]:>8.2f} {parts[0]:>15.2f} {parts[1]:>8.2f}")
    finally:
        capture.close()


TIMES = re.compile(r"(Planning|Execution) Time: ([\d.]+) ms")


def _explain_times(conn: psycopg.Connection, statement: str, params: Any, rounds: int) -> tuple[float, float]:
    """Median planning and execution ms of EXPLAIN ANALYZE, each in a transaction rolled back."""
    planning, execution = [], []
    for _ in range(rounds):
        with conn.transaction(force_rollback=True):
            rows = conn.execute(f"EXPLAIN (ANALYZE) {statement}".encode(), params).fetchall()
        found = dict((k, float(v)) for k, v in TIMES.findall("\n".join(r[0] for r in rows)))
        planning.append(found.get("Planning", 0.0))
        execution.append(found.get("Execution", 0.0))
    return statistics.median(planning), statistics.median(execution)


@click.command()
@click.option("--db", "name", required=True, help="A built database (it is copied; the copy is used).")
@click.option("--days", default=1, show_default=True, help="Days of the oldest runs to prune.")
@click.option("--partitions/--no-partitions", default=True, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the copy.")
@click.option("--server", default=SERVER, show_default=True)
def history(name: str, days: int, partitions: bool, keep: bool, server: str) -> None:
    """Pruning, vacuum, the activity table and day partitions, on a copy of a built database."""
    source = name if name.startswith(PREFIX) else PREFIX + name
    if not (read_mark(server, source) or {}).get("complete"):
        raise click.ClickException(f"{source} is not a complete volume database")
    copy = copy_database(server, source)
    try:
        durable = make_durable(admin_url(server, copy), "history")
        refresh(durable)
        with psycopg.connect(admin_url(server, copy), autocommit=True) as conn:
            before = sizes(conn)
            activity_report(conn)
            time_trim(durable, conn)
            if partitions:
                build_partitions(conn)
                refresh(durable)  # the copy took minutes: no lock may look stale to the passes
                compare_reads(Target(durable, pick_sample(durable), "history"), conn)
            time_prune(admin_url(server, copy), days)
            time_vacuum(conn)
            after = sizes(conn)
            if partitions:
                time_drop(conn)
        say(f"{'table':18} {'rows before':>12} {'after':>12} {'MiB before':>11} {'after vacuum':>12}")
        for table in TABLES:
            (r0, b0), (r1, b1) = before[table], after[table]
            say(f"{table:18} {r0:>12,} {r1:>12,} {b0 / 2**20:>11,.0f} {b1 / 2**20:>12,.0f}")
        durable.db.dispose()
    finally:
        if keep:
            say(f"kept {copy}")
        else:
            drop_database(server, copy)
            say(f"dropped {copy}")
