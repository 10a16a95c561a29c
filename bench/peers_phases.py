"""The three measurements of ``bench.peers``, each of one system at a time.

- ``throughput``: the producer starts ``runs`` runs from ``threads`` threads at once; timed from
  the command to the last run's third step (the Redis counter of ``bench.peers_work``); CPU of
  every process of the system and of its PostgreSQL backends over that time (``peers_measure``).
- ``latency``: the producer starts runs (of three steps, or one) at a steady ``rate``; per run,
  from ``t0`` (taken just before the start call) to its first step's start, and from each step's
  start to the next's; CPU per run as in ``throughput``.
- ``keyed``: starts with a key each from one producer thread; against ``bare``, a single-row
  ``INSERT`` + ``COMMIT`` from this process (psycopg, autocommit off): the floor.
"""

from __future__ import annotations

import glob
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.peers_measure import Meter, Target, percentile
from bench.peers_systems import Running


@dataclass
class StepLog:
    """Reads the step-time files the workers append to, each from where it was left."""

    folder: Path
    offsets: dict[str, int] = field(default_factory=dict)
    lines: dict[str, list[list[str]]] = field(default_factory=dict)

    def read(self, batch: str) -> list[list[str]]:
        """The lines of ``batch`` (``batch i n t0 t``), reading what was appended since last time."""
        for path in glob.glob(str(self.folder / "steps-*.log")):
            with open(path, "rb") as fh:
                fh.seek(self.offsets.get(path, 0))
                data = fh.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.decode().splitlines():
                cols = line.split()
                self.lines.setdefault(cols[0], []).append(cols)
        return self.lines.pop(batch, [])


@dataclass
class Context:
    """What the phases share: the broker client, the meter, the step log, the bare connection."""

    broker: redis.Redis
    meter: Meter
    steps: StepLog
    database_url: str
    redis_pid: int | None

    def target(self, run: Running) -> Target:
        """The processes to measure for a system."""
        assert run.producer is not None
        return Target(
            workers=[w.pid for w in run.workers],
            producer=run.producer.pid,
            redis=self.redis_pid if run.spec.broker else None,
        )


def wait_done(ctx: Context, run: Running, batch: str, runs: int) -> None:
    """Wait until ``runs`` runs of ``batch`` finished (a worker that exits stops the wait)."""
    deadline = time.monotonic() + 180 + runs / 5
    key = f"peers:done:{batch}"
    while int(ctx.broker.get(key) or 0) < runs:
        if time.monotonic() > deadline or any(w.poll() is not None for w in run.workers):
            run.show_logs()
            done = int(ctx.broker.get(key) or 0)
            raise RuntimeError(f"{run.spec.label}: {done} of {runs} runs finished in time")
        time.sleep(0.01)
    ctx.broker.delete(key)


def throughput(ctx: Context, run: Running, runs: int, threads: int) -> dict[str, Any]:
    """Runs/s and CPU per run (ms, by part) of ``runs`` runs started at once."""
    batch = uuid.uuid4().hex[:12]

    def action() -> float:
        t0 = time.perf_counter()
        run.command(op="burst", batch=batch, runs=runs, threads=threads)
        wait_done(ctx, run, batch, runs)
        return time.perf_counter() - t0

    seconds, used = ctx.meter.measure(ctx.target(run), action)
    return {"rate": runs / seconds, "seconds": seconds, "cpu": _per_run(used, runs)}


def _per_run(used: dict[str, float], runs: int) -> dict[str, float]:
    """CPU ms a run by part (``peers_measure.PARTS``), and ``all``."""
    cpu = {part: 1000 * value / runs for part, value in used.items()}
    cpu["all"] = sum(cpu.values())
    return cpu


def latency(ctx: Context, run: Running, runs: int, rate: float, steps: int = 3) -> dict[str, Any]:
    """Start-to-first-step and step-to-step p50/p99 (ms) at a steady start rate, of runs of
    ``steps`` steps (3, or 1: no step to step)."""
    batch = uuid.uuid4().hex[:12]

    def action() -> dict[str, Any]:
        answer: dict[str, Any] = run.command(op="steady", batch=batch, runs=runs, rate=rate, steps=steps)
        wait_done(ctx, run, batch, runs)
        return answer

    t0 = time.perf_counter()
    answer, used = ctx.meter.measure(ctx.target(run), action)
    drain = time.perf_counter() - t0 - answer["seconds"]
    times: dict[int, dict[int, float]] = {}  # run -> step -> when it began (-1000: t0)
    for cols in ctx.steps.read(batch):
        times.setdefault(int(cols[1]), {-1000: float(cols[3])})[int(cols[2])] = float(cols[4])
        if len(cols) > 5:  # step 1's task began in its worker (step -2)
            times[int(cols[1])][-2] = float(cols[5])
    first = [1000 * (t[1] - t[-1000]) for t in times.values() if 1 in t]
    between = [1000 * (t[n + 1] - t[n]) for t in times.values() for n in (1, 2) if n in t and n + 1 in t]
    # Step 0: the start call returned; step -1 (durable): its message was published.
    calls = [1000 * (t[0] - t[-1000]) for t in times.values() if 0 in t]
    sent = [1000 * (t[-1] - t[-1000]) for t in times.values() if -1 in t]
    # From the run being handed over (its message published, else the call returned) to step 1.
    after = [1000 * (t[1] - t.get(-1, t[0])) for t in times.values() if 1 in t and 0 in t]
    # From the task's start in its worker process (Celery systems) to step 1: durable's claim.
    in_task = [1000 * (t[1] - t[-2]) for t in times.values() if 1 in t and -2 in t]
    achieved = runs / answer["seconds"]
    # What the workers got through: every run, from the first start to the last step. A system
    # that falls behind a short burst (500 runs at 500/s) drains its queue after the last start.
    worked = runs / (answer["seconds"] + drain)
    return {
        "first_p50": percentile(first, 0.5),
        "first_p99": percentile(first, 0.99),
        "step_p50": percentile(between, 0.5),
        "step_p99": percentile(between, 0.99),
        "call_p50": percentile(calls, 0.5),
        "sent_p50": percentile(sent, 0.5) if sent else None,
        "after_p50": percentile(after, 0.5),
        "task_p50": percentile(in_task, 0.5) if in_task else None,
        "achieved": achieved,
        "worked": worked,
        "drain": drain,
        "kept_up": achieved >= 0.9 * rate and worked >= 0.95 * rate,
        "cpu": _per_run(used, runs),
        "seen": len(first),
    }


def keyed(ctx: Context, run: Running, count: int) -> dict[str, Any]:
    """Keyed starts/s from one producer thread (new keys), then their rows deleted."""
    answer = run.command(op="keyed", prefix=f"peers-{uuid.uuid4().hex[:8]}", count=count)
    with psycopg.connect(ctx.database_url, autocommit=True) as conn:
        for statement in run.spec.keyed_cleanup:
            conn.execute(statement)
    ctx.broker.delete("peers_keyed")
    return {
        "rate": count / answer["seconds"],
        "p50": 1000 * answer["p50"],
        "p99": 1000 * answer["p99"],
        "cpu": 1000 * answer["cpu"] / count,
    }


def bare(ctx: Context, count: int) -> dict[str, Any]:
    """A single-row ``INSERT`` + ``COMMIT``, ``count`` times from this process: the floor."""
    with psycopg.connect(ctx.database_url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS peers_bare (id bigserial PRIMARY KEY, k text NOT NULL)")
        conn.commit()
        times = []
        cpu0, began = time.process_time(), time.perf_counter()
        for i in range(count):
            t = time.perf_counter()
            conn.execute("INSERT INTO peers_bare (k) VALUES (%s)", (f"bare-{os.getpid()}-{i}",))
            conn.commit()
            times.append(time.perf_counter() - t)
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu0
        conn.execute("TRUNCATE peers_bare")
        conn.commit()
    return {
        "rate": count / seconds,
        "p50": 1000 * percentile(times, 0.5),
        "p99": 1000 * percentile(times, 0.99),
        "cpu": 1000 * cpu / count,
    }
