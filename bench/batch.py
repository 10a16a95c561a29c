"""Batches against one run per start, with a real Celery worker (issue 44).

    python -m bench.batch [-n 5000] [--keys 50] [--max 100] [--period 1.0] [--threads 4]

On a scratch PostgreSQL database and a private ``redis-server`` (or ``--broker``), ``-n`` starts
of one invoice line each, over ``--keys`` customers from ``--threads`` threads, while a worker
(4 threads) runs them:

1. **one run per start**: a workflow whose step takes ``customer, n``;
2. **batched**: the same step over ``items`` with ``batch={"max": --max, "period": --period,
   "key": "invoice:{customer}"}``.

For each: starts a second, runs made, the time until every line was handled (the start of the
first to the end of the last run) and lines handled a second; for the batches, items per run and
how long a batch stayed open (its first start to its run's begin: p50, p99, max; at most
``period`` plus the relay's pass while the worker keeps up). Then statements per start: one that
opens a batch, one that joins it, one of the plain workflow. The database and the Redis server
are removed at the end.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import click
from celery import Celery
from sqlalchemy import func, select

from bench.common import private_redis, say
from bench.fair import counting, pct
from bench.scratch import SERVER, scratch_database
from durable_celery import Durable
from durable_celery.store.schema import runs
from durable_celery.testing import RecordingOutbox, worker


def define(durable: Durable, batch: dict[str, Any] | None) -> None:
    """The workflow ``lines``: one step handling a line, or a batch of them."""
    if batch is None:
        durable.workflow("lines").step(lambda customer, n: n, name="handle")
    else:
        durable.workflow("lines", batch=batch).step(lambda items: len(items), name="handle")


def run_case(url: str, broker: str, opts: dict[str, Any], batch: dict[str, Any] | None) -> dict[str, Any]:
    """Start ``n`` lines from the threads with a worker running; what it took."""
    app = Celery("batchbench", broker=broker)
    queue = f"batchbench-{time.monotonic_ns()}"
    app.conf.task_default_queue = queue
    durable = Durable(app, url, upkeep=True, poll_interval=0.1)
    define(durable, batch)
    n, keys, threads = opts["n"], opts["keys"], opts["threads"]

    def produce(part: int) -> None:
        for i in range(part, n, threads):
            durable.start("lines", {"customer": i % keys, "n": i})

    with worker(durable, concurrency=4, queues=[queue]):
        began = time.perf_counter()
        producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join()
        started = time.perf_counter() - began
        say(f"  {n:,} starts in {started:.1f}s")
        rows = until_done(durable, timeout=n / 20 + 120)
        handled = time.perf_counter() - began
    open_for = [(r.started_at - r.created_at).total_seconds() for r in rows]
    items = sum(len(r.input["items"]) if batch else 1 for r in rows)
    with durable.db.engine.begin() as conn:
        conn.execute(runs.delete())
    durable.db.dispose()
    return {
        "starts/s": n / started,
        "runs": len(rows),
        "items": items,
        "handled s": handled,
        "lines/s": n / handled,
        "open": open_for,
    }


def until_done(durable: Durable, timeout: float) -> list[Any]:
    """Wait until no run of ``lines`` is unfinished; every run, printing progress."""
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        with durable.db.engine.connect() as conn:
            left = conn.execute(select(func.count()).where(runs.c.finished_at.is_(None))).scalar_one()
            if left == 0:
                query = select(runs.c.input, runs.c.created_at, runs.c.started_at, runs.c.status)
                return list(conn.execute(query))
        if left // 500 != last // 500:
            say(f"  {left:,} runs unfinished")
        last = left
        time.sleep(0.2)
    raise TimeoutError(f"runs did not end in {timeout:.0f}s")


def statements(url: str, batch: dict[str, Any]) -> dict[str, float]:
    """Statements per start: opening a batch, joining one, and a start of the plain workflow."""
    found: dict[str, float] = {}
    for name, option in (("plain", None), ("batch", batch)):
        durable = Durable(Celery("stmts", broker="memory://"), url, outbox=RecordingOutbox(), upkeep=False)
        define(durable, option)
        for case, customers in (("open", range(100, 150)), ("join", [100] * 50)):
            if option is None and case == "join":
                continue
            seen: list[str] = []
            with counting(durable, seen):
                for customer in customers:
                    durable.start("lines", {"customer": customer, "n": 0})
            found[f"{name} {case}" if option else name] = len(seen) / len(customers)
        with durable.db.engine.begin() as conn:
            conn.execute(runs.delete())
        durable.db.dispose()
    return found


@click.command()
@click.option("-n", "count", default=5000, show_default=True, help="Lines started (one start each).")
@click.option("--keys", default=50, show_default=True, help="Customers (batch keys) they spread over.")
@click.option("--max", "most", default=100, show_default=True, help="The batch's max.")
@click.option("--period", default=1.0, show_default=True, help="The batch's period (seconds).")
@click.option("--threads", default=4, show_default=True, help="Producer threads.")
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (trust auth).")
@click.option("--broker", default=None, help="Redis URL; default: a private redis-server.")
def main(
    count: int, keys: int, most: int, period: float, threads: int, server: str, broker: str | None
) -> None:
    """Batched starts against one run per start, with a real worker; prints the figures."""
    opts = {"n": count, "keys": keys, "threads": threads}
    batch = {"max": most, "period": period, "key": "invoice:{customer}"}
    with private_redis(broker) as broker_url, scratch_database(server, "bench_ops_batch") as url:
        results = {}
        for name, option in (("one run per start", None), ("batched", batch)):
            say(
                f"{name}: {count:,} lines over {keys} customers from {threads} threads, a worker of 4 threads"
            )
            results[name] = run_case(url, broker_url, opts, option)
        say("")
        say(f"  {'':18} {'starts/s':>9} {'runs':>7} {'all handled':>12} {'lines/s':>8}")
        for name, got in results.items():
            say(
                f"  {name:18} {got['starts/s']:9,.0f} {got['runs']:7,} {got['handled s']:11.1f}s "
                f"{got['lines/s']:8,.0f}"
            )
        got = results["batched"]
        plain = results["one run per start"]
        ratio = got["lines/s"] / plain["lines/s"]
        say(f"  batched / one run per start: lines handled a second {ratio:.1f}x")
        say(
            f"  batched: {got['items']:,} items in {got['runs']:,} runs "
            f"({got['items'] / got['runs']:.1f} a run, "
            f"max {most}); every line in exactly one: {got['items'] == count}"
        )
        opened = got["open"]
        say(
            f"  a batch open (first start to its run's begin): p50 {pct(opened, 0.5):.2f}s, "
            f"p99 {pct(opened, 0.99):.2f}s, max {max(opened):.2f}s (period {period:g}s)"
        )
        say("statements per start")
        for name, per in statements(url, batch).items():
            say(f"  {name:10} {per:.1f}")


if __name__ == "__main__":
    main()
