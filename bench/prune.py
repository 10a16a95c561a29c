"""Pruning 100,000 finished runs with 300,000 step rows.

    python -m bench.prune [--runs 100000] [--steps-per-run 3] [--keyed 0]

A scratch database (``bench_ops_prune_*``) is bulk-loaded with ``--runs`` completed runs that
finished ten days ago, each with ``--steps-per-run`` step rows, beside runs that must stay: 10,000
completed a day ago and 1,000 pending ones. ``--keyed N`` also gives N of the old runs a held key
(one ``durable_keys`` row each), as ``reuse="never"`` workflows leave behind; ``--kept-keys N``
adds N young runs holding keys, which stay. After ``VACUUM
ANALYZE``, ``durable.prune()`` runs with ``prune={"completed": timedelta(days=7)}`` (batches of
20,000, ``FOR UPDATE SKIP LOCKED``), printing each batch. Then it checks what is left and prints
table sizes before and after. The database is dropped.
"""

from __future__ import annotations

import time
from datetime import timedelta

import click
from celery import Celery
from sqlalchemy import text

from bench.common import run_id_sql, say
from bench.scratch import SERVER, TABLES, Timer, scratch_database
from durable_celery import Durable

TARGET_SECONDS = 2.0  # issue 15 (the seed measured 4 s)

CREATED = "now() - make_interval(days => CAST(:days AS int), secs => 60)"

LOAD_RUNS = f"""
INSERT INTO durable_runs (id, workflow, status, input, context, output, queue, step_index,
                          created_at, started_at, finished_at, due_at, published, key)
SELECT {run_id_sql(CREATED)},
       'bench3', CAST(:status AS text), jsonb_build_object('account', g),
       jsonb_build_object('rows', g), '"ok"'::jsonb, 'celery',
       CASE WHEN CAST(:status AS text) = 'completed' THEN 2 ELSE 0 END,
       now() - make_interval(days => CAST(:days AS int), secs => 60),
       now() - make_interval(days => CAST(:days AS int), secs => 60),
       CASE WHEN CAST(:status AS text) = 'completed'
            THEN now() - make_interval(days => CAST(:days AS int)) END,
       CASE WHEN CAST(:status AS text) = 'pending' THEN now() END,
       CAST(:status AS text) = 'pending',
       CASE WHEN g <= CAST(:keyed AS int) THEN 'key:' || g END
FROM generate_series(1, CAST(:n AS int)) AS g
"""

LOAD_STEPS = """
INSERT INTO durable_steps (run_id, step_index, phase, name, attempt, status, input, output, worker,
                           started_at, finished_at)
SELECT r.id, s, 'step', 'step' || s, 1, 'completed', r.input, '"done"'::jsonb, 'bench@host:1',
       r.started_at, r.finished_at
FROM durable_runs r CROSS JOIN generate_series(0, CAST(:per_run AS int) - 1) AS s
WHERE r.status = 'completed'
"""

LOAD_KEYS = """
INSERT INTO durable_keys (workflow, key, holder_id, taken_at)
SELECT workflow, key, id, created_at FROM durable_runs WHERE key IS NOT NULL
"""

SIZES = """
SELECT relname, n_live_tup, pg_total_relation_size(relid) AS total, pg_indexes_size(relid) AS idx
FROM pg_stat_user_tables WHERE relname = ANY(:tables) ORDER BY relname
"""


def count(durable: Durable, sql: str) -> int:
    with durable.db.engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar() or 0)


def sizes(durable: Durable) -> dict[str, tuple[int, int]]:
    with durable.db.engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return {r.relname: (r.total, r.idx) for r in conn.execute(text(SIZES), {"tables": list(TABLES)})}


def vacuum(durable: Durable) -> None:
    with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


@click.command()
@click.option("--runs", default=100_000, show_default=True, type=click.IntRange(1), help="Old runs to prune.")
@click.option(
    "--steps-per-run", default=3, show_default=True, type=click.IntRange(0), help="Step rows per run."
)
@click.option("--keyed", default=0, show_default=True, type=click.IntRange(0), help="Old runs holding a key.")
@click.option(
    "--kept-keys",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Young runs holding a key (stay).",
)
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (database made there).")
def main(runs: int, steps_per_run: int, keyed: int, kept_keys: int, server: str) -> None:
    """Time durable.prune() on bulk-loaded history (prints figures, not a test)."""
    timer = Timer()
    with scratch_database(server, "bench_ops_prune") as url:
        durable = Durable(
            Celery("bench_prune", broker="memory://"),
            url,
            upkeep=False,
            prune={"completed": timedelta(days=7)},
        )
        with durable.db.begin() as conn:
            say(f"{timer} loading {runs:,} completed runs finished 10 days ago ({keyed:,} holding a key)")
            conn.execute(
                text(LOAD_RUNS), {"status": "completed", "days": 10, "n": runs, "keyed": min(keyed, runs)}
            )
            say(f"{timer} loading runs that stay: 10,000 completed a day ago, 1,000 pending")
            conn.execute(text(LOAD_RUNS), {"status": "completed", "days": 1, "n": 10_000, "keyed": 0})
            if kept_keys:
                say(f"{timer} loading {kept_keys:,} young completed runs holding a key (they stay)")
                conn.execute(
                    text(LOAD_RUNS.replace("'key:'", "'kept:'")),
                    {"status": "completed", "days": 1, "n": kept_keys, "keyed": kept_keys},
                )
            conn.execute(text(LOAD_RUNS), {"status": "pending", "days": 0, "n": 1_000, "keyed": 0})
            say(f"{timer} loading {steps_per_run} step rows per completed run")
            conn.execute(text(LOAD_STEPS), {"per_run": steps_per_run})
            conn.execute(text(LOAD_KEYS))
        vacuum(durable)
        before = sizes(durable)
        n_steps = count(durable, "SELECT count(*) FROM durable_steps")
        say(
            f"{timer} loaded: {count(durable, 'SELECT count(*) FROM durable_runs'):,} runs, {n_steps:,} steps"
        )

        t0 = time.perf_counter()
        counts = durable.prune(progress=lambda line: say(f"{timer}   {line}"))
        took = time.perf_counter() - t0

        left_runs = count(durable, "SELECT count(*) FROM durable_runs")
        left_steps = count(durable, "SELECT count(*) FROM durable_steps")
        left_keys = count(durable, "SELECT count(*) FROM durable_keys")
        pending = count(durable, "SELECT count(*) FROM durable_runs WHERE status = 'pending'")
        assert counts == {"completed": runs}, counts
        assert left_runs == 11_000 + kept_keys and pending == 1_000, (left_runs, pending)
        assert left_steps == (10_000 + kept_keys) * steps_per_run, left_steps
        assert left_keys == kept_keys, left_keys
        vacuum(durable)
        after = sizes(durable)
        durable.db.dispose()
    say("")
    say(
        f"pruned {runs:,} runs and {runs * steps_per_run:,} step rows in {took:.2f} s "
        f"({runs / took:,.0f} runs/s)"
    )
    say(f"left: {left_runs:,} runs ({pending:,} pending), {left_steps:,} steps, {left_keys} keys")
    say(f"{'table':18}  {'total before':>12}  {'after vacuum':>12}  {'indexes before':>14}  {'after':>10}")
    for name in sorted(before):
        (tb, ib), (ta, ia) = before[name], after.get(name, (0, 0))
        mb = [f"{v / 2**20:.1f}MB" for v in (tb, ta, ib, ia)]
        say(f"{name:18}  {mb[0]:>12}  {mb[1]:>12}  {mb[2]:>14}  {mb[3]:>10}")
    say(f"target <= {TARGET_SECONDS} s: {'met' if took <= TARGET_SECONDS else 'NOT met'}")


if __name__ == "__main__":
    main()
