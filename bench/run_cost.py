"""What one three-step run costs PostgreSQL: statements, rows written, bytes stored, dead tuples.

    python -m bench.run_cost [--runs 500] [--concurrency 2]

A scratch database (``bench_ops_cost_*``) with autovacuum off on durable's tables, so dead row
versions stay countable. ``--runs`` runs of a workflow of three no-op steps are started with
``durable.start()`` and worked by an in-process Celery worker (thread pool) on Redis, with upkeep
off: this is the cost of a run itself, not of the periodic passes. Then the engine is disposed
(closing its backends flushes their statistics) and the figures are deltas of
``pg_stat_user_tables`` (rows inserted, updated, HOT-updated, deleted, dead) and of
``pg_total_relation_size``, plus ``pg_column_size`` of the live rows, per run. Statements are
counted with SQLAlchemy's ``before_cursor_execute`` on ``durable.db.engine``. The database is
dropped; the Redis queue used is one of its own and is left empty.

Then what inputs cost: ``--input-runs`` runs of the same three steps with a 100 KB input (random,
so TOAST cannot compress it away), and as many keyed runs of that size that each get 10
duplicate starts with a 100 KB input of their own (answered ``use_existing``, so each is dropped
and recorded in ``durable_activity``), started before the worker takes them. Their figures are
``pg_total_relation_size`` deltas (heap, TOAST and indexes) per run.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from collections import Counter
from typing import Any

import click
from celery import Celery
from sqlalchemy import create_engine, event, text

from bench.common import say
from bench.scratch import SERVER, TABLES, Timer, scratch_database
from durable_celery import Durable
from durable_celery.testing import worker

REFERENCE = {"statements": 23, "bytes": 3000, "dead": 15}
INPUT_BYTES = 100_000
DUPLICATES = 10
SIZED = ("durable_runs", "durable_steps", "durable_activity")

STATS = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, n_dead_tup,
       pg_total_relation_size(relid) AS total
FROM pg_stat_user_tables WHERE relname = ANY(:tables)
"""


def snapshot(engine: Any) -> dict[str, dict[str, int]]:
    """Per table: the pg_stat_user_tables counters and the total size, read afresh."""
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        rows = conn.execute(text(STATS), {"tables": list(TABLES)}).mappings().all()
    return {r["relname"]: {k: int(v) for k, v in r.items() if k != "relname"} for r in rows}


def live_bytes(engine: Any) -> dict[str, int]:
    """Bytes of the live rows of runs and steps, as stored (``pg_column_size`` of each row)."""
    with engine.connect() as conn:
        return {
            t: int(
                conn.execute(text(f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {t} t")).scalar() or 0
            )
            for t in ("durable_runs", "durable_steps")
        }


def build(url: str, broker: str, queue: str) -> Durable:
    app = Celery("bench_cost", broker=broker, set_as_current=True)
    app.conf.update(
        task_default_queue=queue, broker_connection_retry_on_startup=True, worker_hijack_root_logger=False
    )
    durable = Durable(app, url, upkeep=False)
    wf = durable.workflow("bench3")
    for name in ("first", "second", "third"):
        wf.step(lambda: None, name=name)
    sized = durable.workflow("bench3_input")
    for name in ("first", "second", "third"):
        sized.step(lambda blob: None, name=name)
    return durable


def total_sizes(engine: Any) -> dict[str, int]:
    """``pg_total_relation_size`` (heap, TOAST, indexes) of each table in ``SIZED``."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables"
                " WHERE relname = ANY(:t)"
            ),
            {"t": list(SIZED)},
        ).all()
    return {name: int(size) for name, size in rows}


def payload() -> dict[str, str]:
    """An input of ``INPUT_BYTES`` of JSON that does not compress (so TOAST keeps all of it)."""
    return {"blob": base64.b64encode(os.urandom(INPUT_BYTES * 3 // 4)).decode()[: INPUT_BYTES - 11]}


def input_costs(
    durable: Durable, observer: Any, timer: Timer, queue: str, concurrency: int, runs: int
) -> list[tuple[str, dict[str, float]]]:
    """Bytes per run of a 100 KB input on three steps, then of keyed ones with 10 duplicates."""
    figures = []
    for label, duplicates in (
        ("100 KB input, 3 steps", 0),
        (f"... and {DUPLICATES} duplicate starts", DUPLICATES),
    ):
        before = total_sizes(observer)
        say(f"{timer} starting {runs} runs: {label}")
        ids = []
        for i in range(runs):
            key = f"sized-{i}" if duplicates else None
            ids.append(durable.start("bench3_input", payload(), key=key))
            for _ in range(duplicates):
                durable.start("bench3_input", payload(), key=key, on_duplicate="use_existing")
        with worker(durable, concurrency=concurrency, queues=[queue]):
            wait_all(observer, ids, timer)
        after = total_sizes(observer)
        figures.append((label, {t: (after[t] - before[t]) / runs for t in SIZED}))
    return figures


@click.command()
@click.option("--runs", "-n", default=500, show_default=True, type=click.IntRange(1), help="Runs measured.")
@click.option(
    "--concurrency", "-c", default=2, show_default=True, type=click.IntRange(1), help="Worker threads."
)
@click.option(
    "--broker-url", default="redis://127.0.0.1:6379/11", show_default=True, help="Redis (not flushed)."
)
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (database made there).")
@click.option(
    "--input-runs",
    default=20,
    show_default=True,
    type=click.IntRange(1),
    help="Runs measured per input case (100 KB input; with 10 duplicate starts).",
)
def main(runs: int, concurrency: int, broker_url: str, server: str, input_runs: int) -> None:
    """Per-run cost of a three-step run, and of large inputs (prints figures, not a test)."""
    timer = Timer()
    queue = f"bench-cost-{uuid.uuid4().hex[:8]}"
    with scratch_database(server, "bench_ops_cost") as url:
        observer = create_engine(url, isolation_level="AUTOCOMMIT")
        with observer.connect() as conn:
            for table in TABLES:
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
        durable = build(url, broker_url, queue)
        statements: Counter[str] = Counter()
        lock = threading.Lock()

        def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            with lock:
                statements[statement.split(None, 1)[0].upper()] += 1

        with worker(durable, concurrency=concurrency, queues=[queue]):
            warm = [durable.start("bench3") for _ in range(5)]
            wait_all(observer, warm, timer)
            durable.db.dispose()
            time.sleep(1.2)
            before, before_live = snapshot(observer), live_bytes(observer)
            event.listen(durable.db.engine, "before_cursor_execute", count)
            say(f"{timer} starting {runs} runs")
            ids = [durable.start("bench3") for _ in range(runs)]
            wait_all(observer, ids, timer)
            event.remove(durable.db.engine, "before_cursor_execute", count)
        durable.db.dispose()  # backends exit and flush their statistics
        time.sleep(1.5)
        after, after_live = snapshot(observer), live_bytes(observer)
        sized = input_costs(durable, observer, timer, queue, concurrency, input_runs)
        durable.db.dispose()
        observer.dispose()
    report(runs, statements, before, after, before_live, after_live)
    report_inputs(input_runs, sized)


def wait_all(engine: Any, ids: list[str], timer: Timer, timeout: float = 300.0) -> None:
    """Poll (on an engine of its own, not counted) until every run completed."""
    deadline, shown = time.monotonic() + timeout, -1
    while True:
        with engine.connect() as conn:
            done = int(
                conn.execute(
                    text("SELECT count(*) FROM durable_runs WHERE id = ANY(:ids) AND status = 'completed'"),
                    {"ids": ids},
                ).scalar()
                or 0
            )
        if done * 10 // len(ids) != shown:
            shown = done * 10 // len(ids)
            say(f"{timer}   {done}/{len(ids)} runs completed")
        if done == len(ids):
            return
        if time.monotonic() > deadline:
            raise click.ClickException(f"only {done} of {len(ids)} runs completed in {timeout}s")
        time.sleep(0.1)


def report(
    runs: int,
    statements: Counter[str],
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
    before_live: dict[str, int],
    after_live: dict[str, int],
) -> None:
    """Print the per-run figures against the reference."""

    def per_run(table: str, field: str) -> float:
        return (after[table][field] - before[table][field]) / runs

    say("")
    say(
        f"per three-step run ({runs} runs): statements by verb "
        + ", ".join(f"{k} {v / runs:.2f}" for k, v in sorted(statements.items()))
    )
    say(f"{'table':18}  {'ins':>6}  {'upd':>6}  {'hot':>6}  {'del':>6}  {'dead':>6}  {'bytes':>8}")
    totals: Counter[str] = Counter()
    for table in TABLES:
        figures = {
            f: per_run(table, f)
            for f in ("n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del", "n_dead_tup", "total")
        }
        totals.update(figures)
        cells = [
            f"{figures[f]:>6.2f}"
            for f in ("n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del", "n_dead_tup")
        ]
        say(f"{table:18}  {'  '.join(cells)}  {figures['total']:>8.0f}")
    n_statements = sum(statements.values()) / runs
    rows_written = totals["n_tup_ins"] + totals["n_tup_upd"] + totals["n_tup_del"]
    live = sum(after_live.values()) - sum(before_live.values())
    run_bytes = (after_live["durable_runs"] - before_live["durable_runs"]) / runs
    step_bytes = (after_live["durable_steps"] - before_live["durable_steps"]) / runs
    say(
        f"live row bytes per run (pg_column_size): runs {run_bytes:.0f}, steps {step_bytes:.0f}, "
        f"total {live / runs:.0f}"
    )
    say("")
    say(f"{'metric':34}  {'measured':>9}  {'reference':>9}  verdict")
    rows = [
        ("SQL statements per run", n_statements, REFERENCE["statements"]),
        ("rows written per run", rows_written, 1 + 9 + 3 + 6),
        ("bytes on disk per run (total size)", totals["total"], REFERENCE["bytes"]),
        ("dead row versions per run", totals["n_dead_tup"], REFERENCE["dead"]),
    ]
    for name, value, reference in rows:
        say(f"{name:34}  {value:>9.2f}  {reference:>9}  {'fewer' if value < reference else 'NOT fewer'}")


def report_inputs(runs: int, figures: list[tuple[str, dict[str, float]]]) -> None:
    """Print the bytes per run of the input cases, by table."""
    say("")
    say(f"bytes per run with large inputs ({runs} runs each; pg_total_relation_size, TOAST included)")
    say(f"{'case':34}  " + "  ".join(f"{t:>16}" for t in SIZED) + f"  {'total':>9}")
    for label, sizes in figures:
        cells = "  ".join(f"{sizes[t]:>16,.0f}" for t in SIZED)
        say(f"{label:34}  {cells}  {sum(sizes.values()):>9,.0f}")


if __name__ == "__main__":
    main()
