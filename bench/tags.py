"""``list_runs(tags=...)`` on a large table (issue 43): the GIN index of tagged runs answers a
tenant's runs in milliseconds however many runs there are.

    python -m bench.tags                  # 1,000,000 runs (a third tagged), about a minute to build
    python -m bench.tags --runs 100000    # a quick look
    python -m bench.tags --help

The runs are inserted set-based (``generate_series``) into a database of the bench's own, in the
columns the library writes; a tenant tag on one run in three (100 tenants), an order tag on each
tagged run. Timed (median of ``--rounds``): ``list_runs(tags={"tenant": ...}, limit=100)``, the
same with a second tag, a tag no run has, and ``list_runs(workflow=..., limit=100)`` for
comparison; the plan of the first is printed. The database is dropped at the end.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import click
import psycopg
from celery import Celery

from durable_celery import Durable

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
CHUNK = 100_000


def _build(url: str, runs: int, say: Any) -> None:
    """Insert ``runs`` runs over 30 days, a third of them tagged."""
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(0, runs, CHUNK):
            end = min(start + CHUNK, runs)
            conn.execute(
                """
                INSERT INTO durable_runs (id, workflow, status, input, context, key, step_index, step_name,
                    attempt, attempt_base, fence, published, resends, losses, created_at, finished_at, tags)
                SELECT gen_random_uuid()::text, 'charge', 'completed', jsonb_build_object('order', g), '{}',
                    NULL, 0, 'pay', 1, 0, 1, true, 0, 0, now() - (g %% 43200) * interval '1 minute',
                    now() - (g %% 43200) * interval '1 minute',
                    CASE WHEN g %% 3 = 0
                        THEN jsonb_build_object('tenant', 't' || (g %% 100), 'order', g::text) END
                FROM generate_series(%(start)s, %(end)s - 1) AS g
                """,
                {"start": start, "end": end},
            )
            say(f"  inserted {end:,} of {runs:,} runs")
        conn.execute("ANALYZE durable_runs")


def _time(fn: Any, rounds: int) -> float:
    """The median milliseconds of ``fn`` over ``rounds`` calls (after one warm-up)."""
    fn()
    taken = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        taken.append((time.perf_counter() - began) * 1000)
    return statistics.median(taken)


@click.command()
@click.option("--runs", default=1_000_000, show_default=True, help="Runs in the table.")
@click.option("--rounds", default=7, show_default=True, help="Timed calls per read (median).")
def main(runs: int, rounds: int) -> None:
    """Time list_runs(tags=...) on a table of --runs runs."""
    name = f"bench_tags_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    durable = Durable(Celery("bench_tags", broker="memory://"), url, upkeep=False)
    try:
        durable.migrate()
        click.echo(f"building {runs:,} runs in {name}")
        began = time.perf_counter()
        _build(url, runs, click.echo)
        click.echo(f"built in {time.perf_counter() - began:.1f} s")
        reads = {
            "list_runs(tags={tenant})": lambda: durable.list_runs(tags={"tenant": "t42"}),
            "list_runs(tags={tenant, order})": lambda: durable.list_runs(
                tags={"tenant": "t42", "order": "42"}
            ),
            "list_runs(tags={tenant: none})": lambda: durable.list_runs(tags={"tenant": "nobody"}),
            "list_runs(workflow=...)": lambda: durable.list_runs(workflow="charge"),
        }
        click.echo(f"\n{'read':34} {'ms (median)':>12}  rows")
        for label, read in reads.items():
            click.echo(f"{label:34} {_time(read, rounds):12.2f}  {len(read())}")
        with psycopg.connect(url) as conn:
            plan = conn.execute(
                'EXPLAIN SELECT id FROM durable_runs WHERE tags @> \'{"tenant": "t42"}\' '
                "ORDER BY created_at DESC LIMIT 100"
            ).fetchall()
        click.echo("\nplan of the tenant's runs:\n" + "\n".join(f"  {row[0]}" for row in plan))
    finally:
        durable.db.dispose()
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        click.echo(f"dropped database {name}")


if __name__ == "__main__":
    main()
