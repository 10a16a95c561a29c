"""Runs per second and pool waits at pool_size 5, 10, 20 and 50, with a fixed worker concurrency.

    python -m bench.pool [--sizes 5,10,20,50] [--concurrency 50] [--runs 300] [--rounds 2]

The seed's table: a three-step workflow whose steps do nothing (the hardest case for the pool:
every step is two statements and no work), worked by a Celery worker of ``--concurrency``
threads in this process, the same for every pool size. For each size a Durable with that
``pool_size`` (and as many overflow connections, the library's rule) starts ``--runs`` runs and
its worker works them; rounds go through the sizes in turn, so that other load on the machine
falls on every size alike. Every checkout's wait for a connection is recorded through
``Database.pool_wait_observers`` (what ``durable_db_pool_wait_seconds`` is fed from).

It prints runs/s (the median over rounds), the p50/p95/p99 pool wait over every checkout, and
errors. A scratch database (``bench_ops_pool_*``) and a redis-server of its own are used and
removed at the end.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import click
from celery import Celery
from sqlalchemy import func, select

from bench.common import private_redis, say
from bench.scratch import SERVER, Timer, scratch_database
from durable_celery import Durable
from durable_celery.store.schema import runs
from durable_celery.testing import worker

WORKFLOW = "pool3"


@dataclass
class Side:
    """One pool size: its Durable, its queue and what was measured."""

    size: int
    durable: Durable
    queue: str
    rates: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    errors: int = 0


def build(url: str, broker: str, size: int) -> Side:
    queue = f"pool-{size}-{uuid.uuid4().hex[:6]}"
    app = Celery(f"bench_pool_{size}", broker=broker)
    app.conf.update(
        task_default_queue=queue, worker_prefetch_multiplier=4, broker_connection_retry_on_startup=True
    )
    durable = Durable(app, url, pool_size=size, upkeep=False, log_capture=False)
    wf = durable.workflow(WORKFLOW)
    for name in ("first", "second", "third"):
        wf.step(lambda **_: None, name=name)
    side = Side(size, durable, queue)
    durable.db.pool_wait_observers.append(side.waits.append)
    return side


def finished(durable: Durable, since: Any) -> int:
    with durable.db.engine.connect() as conn:
        done = (runs.c.status == "completed", runs.c.created_at >= since)
        query = select(func.count()).select_from(runs).where(*done)
        return int(conn.execute(query).scalar() or 0)


def one_round(side: Side, n: int, concurrency: int, timeout: float) -> None:
    durable = side.durable
    with durable.db.engine.connect() as conn:
        since = conn.execute(select(func.now())).scalar()
    with worker(durable, concurrency=concurrency, queues=[side.queue]):
        t0 = time.perf_counter()
        for i in range(n):
            try:
                durable.start(WORKFLOW, {"i": i})
            except Exception:  # counted: a pool that cannot serve must show, not stop the bench
                side.errors += 1
        deadline = t0 + timeout
        done = 0
        while done < n - side.errors and time.perf_counter() < deadline:
            time.sleep(0.1)
            done = finished(durable, since)
        took = time.perf_counter() - t0
    if done < n - side.errors:
        side.errors += n - done
    side.rates.append(done / took)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@click.command()
@click.option("--sizes", default="5,10,20,50", show_default=True, help="Pool sizes, comma-separated.")
@click.option("--concurrency", default=50, show_default=True, help="Worker threads (one value for all).")
@click.option("--runs", default=300, show_default=True, help="Three-step runs per size and round.")
@click.option("--rounds", default=2, show_default=True, help="Rounds through the sizes.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds a round may take.")
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (database made there).")
@click.option("--broker", default="", help="Redis URL; default: a redis-server of the bench's own.")
def main(
    sizes: str, concurrency: int, runs: int, rounds: int, timeout: float, server: str, broker: str
) -> None:
    """The pool-size table: runs/s and pool waits at a fixed concurrency (prints figures)."""
    timer = Timer()
    chosen = [int(s) for s in sizes.split(",") if s.strip()]
    with private_redis(broker) as broker_url, scratch_database(server, "bench_ops_pool") as url:
        sides = [build(url, broker_url, size) for size in chosen]
        for round_no in range(1, rounds + 1):
            for side in sides:
                one_round(side, runs, concurrency, timeout)
                say(
                    f"{timer} round {round_no}/{rounds} pool_size {side.size:3d}: "
                    f"{side.rates[-1]:6.0f} runs/s, p95 wait {quantile(side.waits, 0.95) * 1000:.1f} ms"
                )
        for side in sides:
            side.durable.flush()
            side.durable.db.dispose()
    say("")
    say(f"concurrency {concurrency} (worker threads), {runs} runs of 3 no-op steps per size and round")
    heads = ("pool_size", "runs/s", "wait p50", "wait p95", "wait p99", "checkouts")
    say("  ".join(f"{h:>9}" for h in heads) + "  errors")
    for side in sides:
        w = side.waits
        waits = "  ".join(f"{quantile(w, q) * 1000:>7.2f}ms" for q in (0.5, 0.95, 0.99))
        say(f"{side.size:>9}  {statistics.median(side.rates):>9.0f}  {waits}  {len(w):>9}  {side.errors}")


if __name__ == "__main__":
    main()
