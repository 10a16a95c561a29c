"""Fair share and priority under a backlog, with a real Celery worker (issue 44).

    python -m bench.fair [--backlog 10000] [--small 10] [--limit 4] [--work-ms 20] [--stream-s 20]

On a scratch PostgreSQL database and a private ``redis-server`` (or ``--broker``), a workflow
whose one step sleeps ``--work-ms`` under ``concurrency={"limit": --limit}``, run by one worker
(thread pool, twice the limit plus two):

1. **Backlog**: tenant ``big`` starts ``--backlog`` runs, then tenants ``s1``, ``s2``, ``s3``
   start ``--small`` runs each. Without ``fair`` the small tenants' runs begin after the
   backlog (start order); with ``"fair": "tenant:{tenant}"`` within a few slot turns. For each
   tenant: the wait from start to begin (its first step claimed), p50 and p99, and the slot turns
   it is (wait divided by ``work-ms`` over ``limit``).
2. **Weights**: with ``"weights": {"tenant:gold": 3}``, tenants ``gold`` and ``free`` each keep
   a backlog while runs go on for ``--stream-s`` seconds: the share of the begins each got,
   against 3 to 1.
3. **Priority**: behind 1,000 waiting runs of the limit, a run started with ``priority=10``:
   how many runs began between its start and its begin (the next free slot: at most the limit).
4. **Statements**: per start and per claim of a workflow with a plain concurrency limit and of a
   fair one (``before_cursor_execute``), so the cost of ``fair`` is said, and the plain one's is
   the same as before (no new statement).

The database and the Redis server are removed at the end.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from celery import Celery
from sqlalchemy import event, select

from bench.common import private_redis, say
from bench.scratch import SERVER, scratch_database
from durable_celery import Durable
from durable_celery.store.schema import runs
from durable_celery.testing import RecordingOutbox, worker

SMALL_TENANTS = ("s1", "s2", "s3")


def make(url: str, broker: str, queue: str, **concurrency: Any) -> tuple[Durable, Any]:
    """A Durable on its own queue with the workflow ``job`` (one step sleeping ``work_ms``)."""
    work_ms = concurrency.pop("work_ms")
    app = Celery("fairbench", broker=broker)
    app.conf.task_default_queue = queue
    app.conf.worker_prefetch_multiplier = 1
    durable = Durable(app, url, upkeep=True, sweep_interval=2.0)
    wf = durable.workflow("job", concurrency=concurrency)

    @wf.step
    def work(tenant: str, n: int) -> int:
        time.sleep(work_ms / 1000)
        return n

    return durable, wf


def begun(durable: Durable) -> list[Any]:
    """Every run: tenant, start, begin, in order of begin."""
    with durable.db.engine.connect() as conn:
        query = select(runs.c.id, runs.c.input, runs.c.created_at, runs.c.started_at, runs.c.priority)
        rows = conn.execute(query.where(runs.c.workflow == "job").order_by(runs.c.started_at)).all()
    return list(rows)


def until_done(durable: Durable, total: int, timeout: float) -> None:
    """Wait until ``total`` runs have ended, printing progress."""
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        with durable.db.engine.connect() as conn:
            query = select(runs.c.id).where(runs.c.workflow == "job", runs.c.finished_at.is_not(None))
            done = conn.execute(query).all()
        if len(done) >= total:
            return
        if len(done) // 1000 != last // 1000:
            say(f"  {len(done):,} of {total:,} runs ended")
        last = len(done)
        time.sleep(0.5)
    raise TimeoutError(f"{total} runs did not end in {timeout}s")


def backlog_case(
    url: str, broker: str, fair: bool, opts: dict[str, Any]
) -> tuple[dict[str, list[float]], float]:
    """One tenant's backlog, then the small tenants' runs: each tenant's waits (s), and the runs
    begun per second (slot hand-overs)."""
    limit = opts["limit"]
    concurrency: dict[str, Any] = {"limit": limit, "work_ms": opts["work_ms"]}
    if fair:
        concurrency["fair"] = "tenant:{tenant}"
    queue = f"fairbench-{'fair' if fair else 'plain'}-{time.monotonic_ns()}"
    durable, _ = make(url, broker, queue, **concurrency)
    total = opts["backlog"] + opts["small"] * len(SMALL_TENANTS)
    with worker(durable, concurrency=2 * limit + 2, queues=[queue]):
        t0 = time.perf_counter()
        for n in range(opts["backlog"]):
            durable.start("job", {"tenant": "big", "n": n})
        say(f"  {opts['backlog']:,} runs of big started in {time.perf_counter() - t0:.1f}s")
        for tenant in SMALL_TENANTS:
            for n in range(opts["small"]):
                durable.start("job", {"tenant": tenant, "n": n})
        until_done(durable, total, timeout=total * opts["work_ms"] / 1000 / limit * 4 + 120)
    waits: dict[str, list[float]] = {}
    rows = begun(durable)
    for row in rows:
        waits.setdefault(row.input["tenant"], []).append((row.started_at - row.created_at).total_seconds())
    rate = len(rows) / max((rows[-1].started_at - rows[0].started_at).total_seconds(), 1e-3)
    with durable.db.engine.begin() as conn:
        conn.execute(runs.delete())
    durable.db.dispose()
    return waits, rate


def weights_case(url: str, broker: str, opts: dict[str, Any]) -> Counter[str]:
    """gold (weight 3) and free keep a backlog for ``stream_s`` seconds (``prefill`` runs each
    before the worker starts, then a stream of starts each; steps work 2.5 times longer than
    ``work_ms``): begins per tenant."""
    limit = opts["limit"]
    queue = f"fairbench-weights-{time.monotonic_ns()}"
    concurrency = {"limit": limit, "work_ms": opts["work_ms"] * 2.5, "fair": "tenant:{tenant}"}
    durable, _ = make(url, broker, queue, weights={"tenant:gold": 3}, **concurrency)
    per_second = limit * 1000 / concurrency["work_ms"]
    stop = threading.Event()

    def feed(tenant: str) -> None:  # each tenant starts runs faster than the slots take them
        n = 0
        while not stop.is_set():
            durable.start("job", {"tenant": tenant, "n": n})
            n += 1
            time.sleep(1 / per_second)

    feeders = [threading.Thread(target=feed, args=(t,)) for t in ("gold", "free")]
    for n in range(opts["prefill"]):  # a backlog each before the worker comes: lined up by turns
        for tenant in ("gold", "free"):
            durable.start("job", {"tenant": tenant, "n": -n})
    with worker(durable, concurrency=2 * limit + 2, queues=[queue]):
        for thread in feeders:
            thread.start()
        time.sleep(2)  # both have a backlog
        since = durable.db.utcnow()
        time.sleep(opts["stream_s"])
        until = durable.db.utcnow()
        stop.set()
        for thread in feeders:
            thread.join()
    shares = Counter(
        row.input["tenant"]
        for row in begun(durable)
        if row.started_at is not None and since <= row.started_at < until
    )
    with durable.db.engine.begin() as conn:
        conn.execute(runs.update().where(runs.c.finished_at.is_(None)).values(status="cancelled"))
        conn.execute(runs.delete())
    durable.db.dispose()
    return shares


def settled(durable: Durable, timeout: float = 120.0) -> None:
    """Wait until no run of ``job`` is due and unclaimed (each is parked, running or done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with durable.db.engine.connect() as conn:
            query = select(runs.c.id).where(
                runs.c.workflow == "job",
                runs.c.finished_at.is_(None),
                runs.c.flow_wait.is_(None),
                runs.c.locked_by.is_(None),
            )
            if conn.execute(query.limit(1)).first() is None:
                return
        time.sleep(0.1)
    raise TimeoutError("runs still due and unclaimed")


def priority_case(url: str, broker: str, opts: dict[str, Any]) -> tuple[int, float]:
    """Behind 1,000 waiting runs, a priority-10 run: the runs that began between its start and
    its begin, and its wait (s)."""
    limit = opts["limit"]
    queue = f"fairbench-priority-{time.monotonic_ns()}"
    durable, _ = make(url, broker, queue, limit=limit, work_ms=opts["work_ms"])
    with worker(durable, concurrency=2 * limit + 2, queues=[queue]):
        for n in range(1000):
            durable.start("job", {"tenant": "big", "n": n})
        settled(durable)  # their messages are claimed: parked, running or done
        urgent = durable.start("job", {"tenant": "vip", "n": 0}, priority=10)
        until_done(durable, 1001, timeout=1001 * opts["work_ms"] / 1000 / limit * 4 + 120)
    rows = begun(durable)
    mine = next(r for r in rows if r.id == urgent)
    ahead = sum(1 for r in rows if mine.created_at < r.started_at < mine.started_at)
    with durable.db.engine.begin() as conn:
        conn.execute(runs.delete())
    durable.db.dispose()
    return ahead, (mine.started_at - mine.created_at).total_seconds()


@contextmanager
def counting(durable: Durable, seen: list[str]) -> Iterator[None]:
    """Record every statement ``durable`` sends meanwhile."""

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(durable.db.engine, "before_cursor_execute", note)
    try:
        yield
    finally:
        event.remove(durable.db.engine, "before_cursor_execute", note)


def statements(url: str) -> dict[str, tuple[float, float]]:
    """Statements per start and per claim, with a plain concurrency limit and a fair one."""
    found = {}
    for name, options in (("plain", {}), ("fair", {"fair": "tenant:{tenant}"})):
        durable = Durable(Celery("stmts", broker="memory://"), url, outbox=RecordingOutbox(), upkeep=False)
        wf = durable.workflow(f"count_{name}", concurrency={"limit": 1000, **options})
        wf.step(lambda tenant, n: n, name="work")
        starts: list[str] = []
        claims: list[str] = []
        ids = []
        for n in range(50):
            with counting(durable, starts):
                ids.append(durable.start(wf, {"tenant": f"t{n % 5}", "n": n}))
        for run_id in ids:
            with counting(durable, claims):
                durable.engine.execute(wf, wf.steps[0], run_id, False)
        found[name] = (len(starts) / len(ids), len(claims) / len(ids))
        durable.db.dispose()
    return found


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@click.command()
@click.option("--backlog", default=10_000, show_default=True, help="Runs the big tenant starts first.")
@click.option("--small", default=10, show_default=True, help="Runs each of the three small tenants starts.")
@click.option("--limit", default=4, show_default=True, help="The workflow's concurrency limit.")
@click.option("--work-ms", default=20.0, show_default=True, help="How long a step works.")
@click.option("--stream-s", default=20.0, show_default=True, help="Seconds of the weighted stream.")
@click.option("--prefill", default=500, show_default=True, help="Runs each weighted tenant starts first.")
@click.option(
    "--cases",
    default="backlog,weights,priority",
    show_default=True,
    help="Which measurements to make (comma-separated).",
)
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL server (trust auth).")
@click.option("--broker", default=None, help="Redis URL; default: a private redis-server.")
def main(
    backlog: int,
    small: int,
    limit: int,
    work_ms: float,
    stream_s: float,
    prefill: int,
    cases: str,
    server: str,
    broker: str | None,
) -> None:
    """Fair share, weights and priority under a backlog, with a real worker; prints the waits."""
    opts = {"backlog": backlog, "small": small, "limit": limit, "work_ms": work_ms, "stream_s": stream_s}
    opts["prefill"] = prefill
    chosen = set(cases.split(","))
    with private_redis(broker) as broker_url, scratch_database(server, "bench_ops_fair") as url:
        say("statements per start and claim (50 of each, a limit of 1,000: no run parked)")
        for name, (per_start, per_claim) in statements(url).items():
            say(f"  {name:5}  start {per_start:.1f}  claim {per_claim:.1f}")
        if "backlog" in chosen:
            report_backlog(url, broker_url, opts)
        if "weights" in chosen:
            say(f"weights: gold 3, free 1, both with a backlog ({prefill} each first) for {stream_s:.0f}s")
            shares = weights_case(url, broker_url, opts)
            gold = shares["gold"] / (sum(shares.values()) or 1)
            off = abs(gold - 0.75) / 0.75
            counts = f"gold {shares['gold']:,}, free {shares['free']:,}"
            say(f"  begun: {counts}: {gold:.1%} gold (75%, off {off:.1%})")
        if "priority" in chosen:
            ahead, wait = priority_case(url, broker_url, opts)
            say(f"priority 10 behind 1,000 waiting runs: {ahead} began before it, after {wait * 1000:.0f} ms")


def report_backlog(url: str, broker_url: str, opts: dict[str, Any]) -> None:
    """The backlog case without and with ``fair``: waits per tenant, in seconds and slot turns."""
    results, rates = {}, {}
    for fair in (False, True):
        say(
            f"backlog: {opts['backlog']:,} runs of big, then {opts['small']} each of s1, s2, s3 (fair={fair})"
        )
        results[fair], rates[fair] = backlog_case(url, broker_url, fair, opts)
    turn = 1 / rates[True]
    say(f"begun a second: plain {rates[False]:.0f}, fair {rates[True]:.0f} (turn {turn * 1000:.1f} ms)")
    say("wait from start to begin, seconds")
    columns = ("p50 plain", "p99 plain", "p50 fair", "p99 fair")
    say(
        f"  {'tenant':6} {'runs':>6}  " + "  ".join(f"{c:>10}" for c in columns) + "  p99 fair, in slot turns"
    )
    for tenant in ("big", *SMALL_TENANTS):
        plain, fair_waits = results[False].get(tenant, [0.0]), results[True].get(tenant, [0.0])
        figures = (pct(plain, 0.5), pct(plain, 0.99), pct(fair_waits, 0.5), pct(fair_waits, 0.99))
        shown = "  ".join(f"{f:10.3f}" for f in figures)
        say(f"  {tenant:6} {len(fair_waits):6,}  {shown}  {figures[3] / turn:10,.0f}")
    small_fair = statistics.median(pct(results[True][t], 0.99) for t in SMALL_TENANTS)
    small_plain = statistics.median(pct(results[False][t], 0.99) for t in SMALL_TENANTS)
    say(f"small tenants' p99 wait (median of three): fair {small_fair:.3f}s, plain {small_plain:.3f}s")


if __name__ == "__main__":
    main()
