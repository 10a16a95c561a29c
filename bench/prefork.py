"""Durable runs against plain Celery chains on a real ``celery worker`` (prefork), as run in production.

    python -m bench.prefork [--runs 3000] [--concurrency 2] [--rounds 3]

A ``celery -A bench.prefork_app worker -P prefork -c 2`` subprocess serves both sides, on a
``redis-server`` this bench starts on a spare port and a scratch database it creates; this
process only produces and waits, so it does not compete with the worker for the GIL. Sides run
in turns (``--rounds``), so drift on the machine falls on all of them alike:

1. plain Celery: ``chain(noop.s(), noop.s(), last.s())``; ``last`` counts the chain done with
   one Redis ``INCR`` (how this process sees completion);
2. durable_celery, inline continuation on: a workflow of three no-op steps, started with
   ``durable.start()``; completion polled on the runs table every 50 ms;
3. the same with ``inline_steps=0`` (one broker message per step).

CPU per run is read from ``/proc`` for the worker's processes and for the PostgreSQL backends
serving the scratch database. SQL statements per run (the start and the worker's) are counted
in an untimed pass after the rounds: runs of the same workflow, with inline continuation on and
off, worked by a Celery worker in this process (thread pool) with SQLAlchemy's
``before_cursor_execute`` counting every statement. This prints figures; it is not a test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click
import redis
from celery import Celery, chain
from sqlalchemy import create_engine, event, text

from bench.common import prepare_database, private_redis, say
from durable_celery import Durable
from durable_celery.testing import worker as thread_worker

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"plain": "plain Celery", "inline": "durable, inline on", "per_step": "durable, inline off"}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) of these processes, and of their children."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / TICK
    return total


def worker_pids(parent: int) -> list[int]:
    """The worker and its pool processes."""
    found = [parent]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def backend_pids(engine, database: str) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = :d"), {"d": database})
        return [int(r[0]) for r in rows]


class Bench:
    """The producer side of one durable worker: an app and a Durable like the worker's."""

    def __init__(self, broker: str, database_url: str, queue: str, inline_steps: int) -> None:
        self.app = Celery(f"bench_{queue}", broker=broker, set_as_current=False)
        self.app.conf.update(
            task_serializer="json", broker_connection_retry_on_startup=True, task_default_queue=queue
        )
        self.durable = Durable(self.app, database_url, upkeep=False, inline_steps=inline_steps)
        wf = self.durable.workflow("bench3")
        for name in ("first", "second", "third"):
            wf.step(lambda batch: None, name=name)
        self.workflow = wf
        self.poller = create_engine(database_url, pool_size=1, max_overflow=0)
        self.sent = 0.0

    def __call__(self, runs: int) -> float:
        """Start ``runs`` runs and wait until every one completed; returns the seconds taken."""
        batch = uuid.uuid4().hex
        t0 = time.perf_counter()
        produce(runs, lambda: self.durable.start(self.workflow, {"batch": batch}))
        self.sent = time.perf_counter() - t0
        query = text("SELECT count(*) FROM durable_runs WHERE status = 'completed' AND input->>'batch' = :b")
        while True:
            with self.poller.connect() as conn:
                if conn.execute(query, {"b": batch}).scalar() >= runs:
                    return time.perf_counter() - t0
            time.sleep(0.05)

    def close(self) -> None:
        self.poller.dispose()
        self.durable.db.dispose()


class Plain:
    """The producer side of the plain worker: chains of three tasks, counted done in Redis."""

    def __init__(self, broker: str) -> None:
        self.app = Celery("bench_plain", broker=broker, set_as_current=False)
        self.app.conf.update(
            task_serializer="json", task_default_queue="plain", task_default_routing_key="plain"
        )
        self.noop, self.last = self.app.signature("bench.noop"), self.app.signature("bench.last")
        self.redis = redis.Redis.from_url(broker)
        self.sent = 0.0

    def __call__(self, runs: int) -> float:
        """Send ``runs`` chains and wait until every one finished; returns the seconds taken."""
        self.redis.set("bench:done", 0)
        t0 = time.perf_counter()
        produce(runs, lambda: chain(self.noop.clone(), self.noop.clone(), self.last.clone()).apply_async())
        self.sent = time.perf_counter() - t0
        while int(self.redis.get("bench:done") or 0) < runs:
            time.sleep(0.02)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.redis.close()


PRODUCERS = [4]  # threads that start runs (send chains) at once, as several web processes would


def produce(runs: int, make: Any) -> None:
    """Call ``make`` ``runs`` times from PRODUCERS threads."""
    count = PRODUCERS[0]

    def part(n: int) -> None:
        for _ in range(n):
            make()

    threads = [
        threading.Thread(target=part, args=(runs // count + (i < runs % count),)) for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def statements_per_run(broker: str, database_url: str, inline_steps: int, runs: int = 60) -> float:
    """SQL statements per three-step run (its start and the worker's), counted with
    ``before_cursor_execute`` while an in-process worker works ``runs`` runs."""
    queue = f"count_{inline_steps}"
    side = Bench(broker, database_url, queue, inline_steps)
    count = [0]

    def counted(*_: Any) -> None:
        count[0] += 1

    try:
        with thread_worker(side.durable, concurrency=2, queues=[queue]):
            side(5)  # the worker's first statements (its node row, schema checks) are not a run's
            event.listen(side.durable.db.engine, "before_cursor_execute", counted)
            side(runs)
            event.remove(side.durable.db.engine, "before_cursor_execute", counted)
    finally:
        side.close()
    return count[0] / runs


@click.command()
@click.option(
    "--runs",
    "-n",
    default=3000,
    show_default=True,
    type=click.IntRange(3),
    help="Runs per side, split over the rounds (a round of 1,000 or more: the 50 ms completion poll "
    "moves a shorter one's rate by several percent).",
)
@click.option(
    "--concurrency", "-c", default=2, show_default=True, type=click.IntRange(1), help="Pool processes."
)
@click.option(
    "--producers", default=4, show_default=True, type=click.IntRange(1), help="Threads starting runs."
)
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Turns of each side.")
@click.option(
    "--database-url",
    default="postgresql://postgres@127.0.0.1:5432/durable_bench_prefork",
    show_default=True,
    help="Created if missing, migrated, runs emptied.",
)
def main(runs: int, concurrency: int, producers: int, rounds: int, database_url: str) -> None:
    """Runs/s and CPU per run of plain Celery chains and durable runs on prefork workers."""
    PRODUCERS[0] = producers
    database_url = prepare_database(database_url)
    with private_redis() as broker, ExitStack() as stack:
        setup = Durable(Celery("bench_setup", broker=broker), database_url, upkeep=False)
        setup.migrate()
        with setup.db.engine.begin() as conn:
            conn.execute(text("TRUNCATE durable_runs CASCADE"))
        database = setup.db.engine.url.database or ""
        setup.db.dispose()
        # One worker per side, each on its queue; only one is busy at a time.
        workers = {}
        for name, inline_steps in (("plain", 20), ("inline", 20), ("per_step", 0)):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_BROKER": broker, "BENCH_DB": database_url}
            env.update(BENCH_INLINE=str(inline_steps), BENCH_QUEUE=name)
            cmd = [sys.executable, "-m", "celery", "-A", "bench.prefork_app", "worker", "-P", "prefork"]
            cmd += ["-c", str(concurrency), "-Q", name, "-n", f"{name}@%h", "--loglevel", "WARNING"]
            cmd += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
            log = stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115
            workers[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
            stack.callback(_stop, workers[name])
        sides: dict[str, Any] = {
            "plain": Plain(broker),
            "inline": Bench(broker, database_url, "inline", 20),
            "per_step": Bench(broker, database_url, "per_step", 0),
        }
        for side in sides.values():
            stack.callback(side.close)
        admin = create_engine(database_url, pool_size=1, max_overflow=0)
        stack.callback(admin.dispose)
        for name, side in sides.items():
            say(f"warming up {SIDES[name]} (worker pid {workers[name].pid})")
            side(20)
        results = {name: {"runs": 0, "seconds": 0.0, "cpu": 0.0, "server": 0.0} for name in SIDES}
        per_round = max(1, runs // rounds)
        for turn in range(1, rounds + 1):
            for name, side in sides.items():
                pids, backends = worker_pids(workers[name].pid), backend_pids(admin, database)
                cpu0, server0 = cpu_of(pids), cpu_of(backends)
                seconds = side(per_round)
                pids, backends = worker_pids(workers[name].pid), backend_pids(admin, database)
                row = results[name]
                row["runs"] += per_round
                row["seconds"] += seconds
                row["cpu"] += cpu_of(pids) - cpu0
                row["server"] += cpu_of(backends) - server0
                shown = f"{per_round} runs in {seconds:.2f}s = {per_round / seconds:.1f}/s"
                say(f"  round {turn}/{rounds}, {SIDES[name]}: {shown} (sent in {side.sent:.2f}s)")
        say("counting SQL statements per run (untimed, a worker in this process)")
        statements = {
            "inline": statements_per_run(broker, database_url, 20),
            "per_step": statements_per_run(broker, database_url, 0),
        }
    say("")
    plain_rate = results["plain"]["runs"] / results["plain"]["seconds"]
    say(f"prefork workers, concurrency {concurrency}; {os.cpu_count()} CPUs; Redis; PostgreSQL")
    for name, row in results.items():
        n = row["runs"]
        rate = n / row["seconds"]
        say(
            f"{SIDES[name]:<20}: {rate:7.1f} runs/s ({rate / plain_rate:.2f}x plain); worker CPU"
            f" {1000 * row['cpu'] / n:.2f} ms/run; PostgreSQL CPU {1000 * row['server'] / n:.2f} ms/run"
            + (f"; {statements[name]:.2f} statements/run" if name in statements else "")
        )
    ratios = {name: results[name]["runs"] / results[name]["seconds"] / plain_rate for name in statements}
    for label, met in (
        (f"inline on >= 1.0 x plain: {ratios['inline']:.2f}", ratios["inline"] >= 1.0),
        (f"inline off >= 0.6 x plain: {ratios['per_step']:.2f}", ratios["per_step"] >= 0.6),
        (f"statements per run <= 6 with inline on: {statements['inline']:.2f}", statements["inline"] <= 6),
    ):
        say(f"target: {label}  {'met' if met else 'MISSED'}")


def _stop(worker: subprocess.Popen[Any]) -> None:
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()


if __name__ == "__main__":
    main()
