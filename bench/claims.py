"""Claim latency with no history, with 500,000 finished runs, and with 500,000 ready runs queued.

    python -m bench.claims [--finished 500000] [--ready 500000] [--claims 3000] [--rounds 6]

Three scratch databases are made (``bench_ops_claim_*``): one with 100 ready runs of another
workflow and nothing else, one bulk-loaded with finished runs, one with a backlog of ready runs
(pending, due, sent, of another workflow: what a queue looks like when workers fall behind),
each loaded (one ``INSERT ... SELECT generate_series``, then ``VACUUM ANALYZE`` as autovacuum would;
autovacuum is then turned off on the runs table of each, so that a pass of it in the middle of
a round does not slow one side only).
In each, pending runs are inserted the same way and claimed one by one with the claim the worker
uses (``queries.claim_run`` on an autocommit connection); only the statement is timed. Rounds
alternate between the databases, so load from elsewhere on the machine falls on all alike.
Pages touched per claim come from ``pg_statio_user_tables`` deltas. The databases are dropped.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click
from celery import Celery
from sqlalchemy import text

from bench.common import run_id_sql, say
from bench.scratch import SERVER, Timer, scratch_database
from durable_celery import Durable
from durable_celery.store import queries

RATIO_TARGET = 1.1

LOAD_RUNS = f"""
INSERT INTO durable_runs (id, workflow, status, input, context, output, queue, step_index,
                          created_at, started_at, finished_at, due_at, published)
SELECT {run_id_sql("now() - make_interval(secs => g)")},
       'bench3', CAST(:status AS text), jsonb_build_object('n', g), '{{}}'::jsonb,
       CASE WHEN CAST(:status AS text) = 'completed' THEN '"ok"'::jsonb END, 'celery',
       CASE WHEN CAST(:status AS text) = 'completed' THEN 2 ELSE 0 END,
       now() - make_interval(secs => g), now() - make_interval(secs => g),
       CASE WHEN CAST(:status AS text) = 'completed' THEN now() - make_interval(secs => g) END,
       CASE WHEN CAST(:status AS text) = 'pending' THEN now() END,
       CAST(:status AS text) = 'pending'
FROM generate_series(1, :n) AS g
"""


def load(durable: Durable, status: str, n: int, ready_queue: bool = False) -> list[str]:
    """Bulk-insert ``n`` runs in ``status``; returns the ids of pending ones to claim (none for
    ``ready_queue``: a backlog of another workflow, due and sent, that stays unclaimed)."""
    with durable.db.begin() as conn:
        sql = LOAD_RUNS.replace("'bench3'", "'backlog'") if ready_queue else LOAD_RUNS
        conn.execute(text(sql), {"status": status, "n": n})
        if status != "pending" or ready_queue:
            return []
        rows = conn.execute(
            text(
                "SELECT id FROM durable_runs WHERE status = 'pending' AND locked_by IS NULL"
                " AND workflow = 'bench3'"
            )
        )
        return [r.id for r in rows]


def pages(durable: Durable) -> int:
    """Heap and index pages read (hit or not) on the runs and queues tables so far."""
    sql = """SELECT coalesce(sum(heap_blks_hit + heap_blks_read + coalesce(idx_blks_hit, 0)
                                 + coalesce(idx_blks_read, 0)), 0)
             FROM pg_statio_user_tables WHERE relname IN ('durable_runs', 'durable_queues')"""
    with durable.db.engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return int(conn.execute(text(sql)).scalar() or 0)


def claim_all(durable: Durable, ids: list[str]) -> tuple[list[float], int]:
    """Claim each run once on one autocommit connection; returns per-claim ms and pages touched."""
    db = durable.db
    seconds = []
    before = pages(durable)
    with db.single() as conn:
        for run_id in ids:
            t0 = time.perf_counter()
            row = queries.claim_run(db, conn, run_id, 0, "bench-node", None)
            seconds.append((time.perf_counter() - t0) * 1000)
            assert row is not None, run_id
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.execute(text("SELECT 1"))
    time.sleep(0.2)
    return seconds, pages(durable) - before


def make(url: str) -> Durable:
    durable = Durable(Celery("bench_claims", broker="memory://"), url, upkeep=False, pool_size=1)
    durable.workflow("bench3").step(lambda: None, name="first")
    return durable


@click.command()
@click.option(
    "--finished", default=500_000, show_default=True, type=click.IntRange(1), help="Finished runs loaded."
)
@click.option(
    "--claims", default=3000, show_default=True, type=click.IntRange(10), help="Claims timed per side."
)
@click.option(
    "--ready", default=500_000, show_default=True, type=click.IntRange(1), help="Ready runs queued."
)
@click.option("--rounds", default=6, show_default=True, type=click.IntRange(1), help="Alternating rounds.")
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (databases made there).")
def main(finished: int, ready: int, claims: int, rounds: int, server: str) -> None:
    """Claim latency with no history and with many finished runs (prints figures, not a test)."""
    timer = Timer()
    with (
        scratch_database(server, "bench_ops_claim_empty") as empty_url,
        scratch_database(server, "bench_ops_claim_full") as full_url,
        scratch_database(server, "bench_ops_claim_ready") as ready_url,
    ):
        sides: dict[str, Durable] = {
            "0 finished, 100 ready": make(empty_url),
            f"{finished:,} finished": make(full_url),
            f"{ready:,} ready": make(ready_url),
        }
        say(f"{timer} loading {finished:,} finished runs (one INSERT ... SELECT generate_series)")
        load(sides[f"{finished:,} finished"], "completed", finished)
        say(f"{timer} loading {ready:,} ready runs (pending, due, sent: a backlog nobody claims)")
        load(sides[f"{ready:,} ready"], "pending", ready, ready_queue=True)
        load(sides["0 finished, 100 ready"], "pending", 100, ready_queue=True)
        for durable in sides.values():
            with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("VACUUM ANALYZE"))
                # No autovacuum pass in the middle of a round: its reads would count as the
                # claims' pages and its work would slow one side only.
                conn.execute(text("ALTER TABLE durable_runs SET (autovacuum_enabled = false)"))
        say(f"{timer} loaded and vacuumed")
        per_round = max(1, claims // rounds)
        times: dict[str, list[float]] = {name: [] for name in sides}
        touched: dict[str, int] = dict.fromkeys(sides, 0)
        for round_no in range(1, rounds + 1):
            for name, durable in sides.items():
                ids = load(durable, "pending", per_round)
                took, n_pages = claim_all(durable, ids)
                times[name] += took
                touched[name] += n_pages
            say(
                f"{timer} round {round_no}/{rounds}: "
                + ", ".join(f"{n} median {statistics.median(t):.3f} ms" for n, t in times.items())
            )
        report(times, touched)
        for durable in sides.values():
            durable.db.dispose()


def report(times: dict[str, list[float]], touched: dict[str, int]) -> None:
    """Print the figures and the verdict."""
    say("")
    say(f"{'table':24}  {'claims':>6}  {'median ms':>9}  {'p95 ms':>7}  {'mean ms':>7}  {'pages/claim':>11}")
    medians: list[float] = []
    for name, took in times.items():
        p95 = statistics.quantiles(took, n=20)[-1]
        medians.append(statistics.median(took))
        say(
            f"{name:24}  {len(took):>6}  {medians[-1]:>9.3f}  {p95:>7.3f}  {statistics.mean(took):>7.3f}  "
            f"{touched[name] / len(took):>11.1f}"
        )
    names = list(times)
    for index in (1, 2):
        ratio = medians[index] / medians[0]
        verdict: Any = "met" if ratio <= RATIO_TARGET else "NOT met"
        say(f"median ratio ({names[index]} / {names[0]}): {ratio:.2f}  target <= {RATIO_TARGET}: {verdict}")


if __name__ == "__main__":
    main()
