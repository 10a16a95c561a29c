"""A bulk retry of 100,000 failed runs (issue 43): in pages, interrupted and run again, each run
in a transaction of its own, its message through the background publisher.

    python -m bench.bulk                  # 100,000 failed runs (about 9 minutes on 2 cores)
    python -m bench.bulk --runs 10000     # a quick look
    python -m bench.bulk --help

A scratch database of its own (``bench_ops_bulk_*``, migrated, dropped at the end) and a
``redis-server`` of its own (or ``--broker``, where only the bench's queue is read and deleted).
The workflow ``charge`` has one step and ``concurrency={"limit": 50}``, on a queue of its own.
One run that fails and one that completes go through the library (``start``, then the step as
a worker runs it); every column of their rows is copied, set-based (``INSERT ... SELECT
generate_series``), into ``--runs`` failed runs created over a 15-minute window (ids
time-ordered like the library's, tagged ``{"tenant": "t<n % 10>"}``) and 1,000 completed runs in
the same window, which a bulk retry must skip; one more failed run, an hour before the window,
is retried by ``durable.retry`` before anything is timed. Then:

- (a) ``durable.bulk("retry", dry_run=True, workflow="charge", status="failed")``, timed;
- (b) ``durable.bulk("retry", workflow="charge", since=..., until=...)`` (the window: the failed
  runs and the completed ones), its ``progress`` callback raising ``KeyboardInterrupt`` once about
  40% of the matches were looked at: the interruption;
- (c) the same bulk retry again: it acts on the rest and skips, with reasons, the completed runs
  and those retried before the interruption. Meanwhile a thread samples ``pg_stat_activity``
  every 100 ms for the oldest open transaction on the bench's database; before and after it,
  ``pg_stat_database`` counts the transactions (the pool closed first, so that every backend
  has reported its counts);
- (d) the bench's peak RSS after each phase; (e) the longest transaction seen in (c);
  (f) transactions per run acted; (g) the messages in the queue against the runs acted, and the
  publisher's batches (counted by wrapping its ``_emit_batch``); (h) one ``bulk`` entry for the
  completed action, one ``retried`` entry per run;
- (i) flow control holds for the retried runs: the messages of the 60 oldest (and the 5 newest)
  handled at once, as a worker's threads would (``durable.run_message`` in 65 threads, the step
  held until counted): 50 steps execute, the other 15 runs are parked for a slot.

It prints progress as it goes, then the checks and a table of figures; it exits with status 1
if a check failed.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import click
import redis
from celery import Celery
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from bench.common import private_redis, run_id_sql, say
from bench.scratch import SERVER, Timer, scratch_database
from durable_celery import Durable
from durable_celery.store.db import normalize_url

LIMIT = 50  # the workflow's concurrency limit
COMPLETED = 1_000  # completed runs in the window: a bulk retry skips them
WINDOW = timedelta(minutes=15)
INTERRUPT_AT = 0.4  # the share of the matches looked at when the first bulk retry is interrupted
SAMPLE_SECONDS = 0.1
FLOW_OLDEST, FLOW_NEWEST = 60, 5  # runs whose messages are handled at once in (i)
PROBE_FAILS = -1  # the order whose payment fails (the library's own failed run)

COLUMNS = """
SELECT column_name, data_type FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = :table ORDER BY ordinal_position
"""

LOAD = """
WITH made AS (
    INSERT INTO durable_runs ({run_columns})
    SELECT {run_values}
    FROM durable_runs AS p CROSS JOIN generate_series(0, CAST(:n AS int) - 1) AS g
    WHERE p.id = :probe
    RETURNING id, created_at
)
INSERT INTO durable_steps ({step_columns})
SELECT {step_values}
FROM made CROSS JOIN durable_steps AS p JOIN durable_runs AS q ON q.id = p.run_id
WHERE p.run_id = :probe
"""

OLDEST_XACT = """
SELECT extract(epoch FROM clock_timestamp() - xact_start) AS age, left(query, 80) AS query
FROM pg_stat_activity
WHERE datname = :db AND backend_type = 'client backend' AND xact_start IS NOT NULL
    AND pid <> pg_backend_pid()
ORDER BY xact_start LIMIT 1
"""

XACTS = "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = :db"

RETRIED = """
SELECT count(*) AS runs, count(*) FILTER (WHERE n > 1) AS twice, coalesce(sum(n), 0) AS entries
FROM (SELECT run_id, count(*) AS n FROM durable_activity WHERE kind = 'retried' GROUP BY run_id) AS r
"""

FLOW_STATE = """
SELECT count(*) FILTER (WHERE status = 'running' AND locked_by IS NOT NULL) AS executing,
       count(*) FILTER (WHERE flow_wait = 'slot') AS parked,
       count(*) FILTER (WHERE status = 'completed') AS completed
FROM durable_runs WHERE id = ANY(:ids)
"""

FLOW_PICK = """
SELECT id FROM durable_runs
WHERE workflow = 'charge' AND status IN ('pending', 'running') AND due_at IS NOT NULL
    AND locked_by IS NULL AND created_at < :until
ORDER BY created_at {order}, id {order} LIMIT :n
"""


class Gate:
    """Holds the ``pay`` steps that run in (i) until they were counted."""

    def __init__(self) -> None:
        """An open gate."""
        self.closed = False
        self.opened = threading.Event()

    def wait(self) -> None:
        """Wait while the gate is closed (at most a minute)."""
        if self.closed:
            self.opened.wait(60)


class Figures:
    """What the bench measured (printed in the table) and its checks."""

    def __init__(self) -> None:
        """None yet."""
        self.rows: list[tuple[str, str]] = []
        self.checks: list[tuple[str, bool, str]] = []

    def add(self, label: str, value: str) -> None:
        """Keep a figure for the table and print it now."""
        self.rows.append((label, value))
        say(f"  {label}: {value}")

    def check(self, label: str, ok: bool, detail: str) -> None:
        """Keep a check and print it now."""
        self.checks.append((label, ok, detail))
        say(f"  check {'ok  ' if ok else 'FAIL'} {label}: {detail}")


class Sampler(threading.Thread):
    """Samples the oldest open transaction on the bench's database every ``SAMPLE_SECONDS``."""

    def __init__(self, admin: Engine, db: str) -> None:
        """A sampler of database ``db`` through ``admin`` (another database: it adds no count)."""
        super().__init__(name="bench-xact-sampler", daemon=True)
        self.admin, self.db = admin, db
        self.stop = threading.Event()
        self.samples = 0
        self.open_samples = 0  # samples that found a transaction open
        self.longest = (0.0, "")

    def run(self) -> None:
        """Sample until stopped."""
        with self.admin.connect() as conn:
            while not self.stop.wait(SAMPLE_SECONDS):
                row = conn.execute(text(OLDEST_XACT), {"db": self.db}).first()
                self.samples += 1
                if row is not None:
                    self.open_samples += 1
                    if row.age > self.longest[0]:
                        self.longest = (float(row.age), row.query)


class Progress:
    """A bulk action's ``progress``: prints every ``every`` pages, interrupts past ``stop_at``."""

    def __init__(self, timer: Timer, every: int, stop_at: int | None = None) -> None:
        """Counting from now."""
        self.timer, self.every, self.stop_at = timer, every, stop_at
        self.pages = 0
        self.looked = 0
        self.began = time.perf_counter()

    def __call__(self, line: str) -> None:
        """One page done: ``line`` is '<n> of <m> runs looked at'."""
        self.pages += 1
        self.looked = int(line.split()[0].replace(",", ""))
        stopping = self.stop_at is not None and self.looked >= self.stop_at
        if stopping or self.pages % self.every == 0:
            rate = self.looked / (time.perf_counter() - self.began)
            say(f"{self.timer}   {line} ({rate:,.0f} runs/s, peak RSS {peak_rss():.0f} MB)")
        if stopping:
            say(f"{self.timer}   interrupting (KeyboardInterrupt from the progress callback)")
            raise KeyboardInterrupt


def peak_rss() -> float:
    """The bench process's peak resident set size, MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scalar(durable: Durable, sql: str, **params: Any) -> Any:
    """One value read on the bench's database."""
    with durable.db.engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def define(durable: Durable, queue: str, gate: Gate) -> Any:
    """The workflow ``charge``: one step, ``concurrency={"limit": LIMIT}``, on ``queue``."""
    wf = durable.workflow("charge", concurrency={"limit": LIMIT}, queue=queue)

    @wf.step
    def pay(order: int) -> str:
        """Fails for the probe's order; waits at the gate while it is closed."""
        if order == PROBE_FAILS:
            raise ConnectionError("payment provider down")
        gate.wait()
        return f"PAY-{order}"

    return wf


def probe(durable: Durable, wf: Any) -> tuple[str, str]:
    """A failed and a completed run made by the library: the rows the loaded runs copy."""
    failed = durable.start(wf, {"order": PROBE_FAILS}, tags={"tenant": "t9"})
    completed = durable.start(wf, {"order": 0}, tags={"tenant": "t0"})
    outcomes = durable.run_message("charge", 0, failed), durable.run_message("charge", 0, completed)
    if outcomes != ("failed", "completed"):
        raise RuntimeError(f"the probe runs ended {outcomes}, not failed and completed")
    return failed, completed


def copied(durable: Durable, table: str, values: dict[str, str], shift: str) -> dict[str, str]:
    """Columns and select list copying row ``p`` of ``table``: ``values`` replace, times move by ``shift``."""
    with durable.db.engine.connect() as conn:
        columns = conn.execute(text(COLUMNS), {"table": table}).all()
    names, exprs = [], []
    for name, kind in columns:
        if name == "id" and "id" not in values:
            continue  # an identity column (step rows)
        names.append(f'"{name}"')
        if name in values:
            exprs.append(values[name])
        elif kind.startswith("timestamp"):
            exprs.append(f'p."{name}" + ({shift})')
        else:
            exprs.append(f'p."{name}"')
    return {"columns": ", ".join(names), "values": ", ".join(exprs)}


def load(durable: Durable, probe_id: str, n: int, first: int, t0: datetime, spacing: timedelta) -> None:
    """``n`` copies of a probe run and its step row, created ``spacing`` apart from ``t0``."""
    created = "CAST(:t0 AS timestamptz) + g * CAST(:spacing AS interval)"
    order = "CAST(:first AS int) + g"
    run = {
        "id": run_id_sql(created),
        "created_at": created,
        "input": f"jsonb_build_object('order', {order})",
        "tags": f"jsonb_build_object('tenant', 't' || (({order}) % 10))",
    }
    runs = copied(durable, "durable_runs", run, f"{created} - p.created_at")
    steps = copied(durable, "durable_steps", {"run_id": "made.id"}, "made.created_at - q.created_at")
    sql = LOAD.format(
        run_columns=runs["columns"],
        run_values=runs["values"],
        step_columns=steps["columns"],
        step_values=steps["values"],
    )
    params = {"n": n, "first": first, "t0": t0, "spacing": spacing, "probe": probe_id}
    with durable.db.begin() as conn:
        conn.execute(text(sql), params)


def build(durable: Durable, runs: int, timer: Timer, window: tuple[datetime, datetime]) -> str:
    """Probe, load, and ``durable.retry`` the failed probe and the extra run (its id returned)."""
    wf = durable.workflows["charge"]
    failed, completed = probe(durable, wf)
    say(f"{timer} probe runs made by the library: {failed} failed, {completed} completed")
    t0, t1 = window
    say(
        f"{timer} loading {runs:,} failed runs and {COMPLETED:,} completed ones created {t0:%H:%M}-{t1:%H:%M}"
    )
    load(durable, failed, runs, 1, t0, WINDOW / runs)
    load(durable, completed, COMPLETED, runs + 1, t0 + WINDOW / COMPLETED / 2, WINDOW / COMPLETED)
    load(durable, failed, 1, runs + COMPLETED + 1, t0 - timedelta(hours=1), timedelta(0))
    with durable.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    extra = scalar(durable, "SELECT id FROM durable_runs WHERE created_at < :t0", t0=t0)
    for run_id in (failed, extra):
        durable.retry(run_id, by="bench")
        if durable.get_run(run_id).status not in ("pending", "running"):
            raise RuntimeError(f"durable.retry({run_id!r}) left the run {durable.get_run(run_id).status}")
    durable.flush()
    say(f"{timer} durable.retry works on a loaded run ({extra}) and on the library's failed run")
    return extra


def count_batches(durable: Durable) -> list[int]:
    """The sizes of the batches the publisher sends from now on (its ``_emit_batch`` wrapped)."""
    sizes: list[int] = []
    publisher = durable.publisher
    emit = publisher._emit_batch

    def counted(batch: list[Any]) -> None:
        """Note the batch's size, then send it."""
        sizes.append(len(batch))
        emit(batch)

    publisher._emit_batch = counted  # type: ignore[method-assign]
    return sizes


def queued(client: redis.Redis, queue: str) -> int:
    """Messages in the bench's queue."""
    return int(client.llen(queue))


def xacts(durable: Durable, admin: Engine, db: str) -> tuple[int, int]:
    """Transactions committed and rolled back on the database (the pool closed first: counts reported)."""
    durable.db.dispose()
    time.sleep(1.0)
    with admin.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(text(XACTS), {"db": db}).one()
    return int(row.xact_commit), int(row.xact_rollback)


@contextmanager
def sampling(admin: Engine, db: str) -> Iterator[Sampler]:
    """The transaction sampler, running for the block."""
    sampler = Sampler(admin, db)
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop.set()
        sampler.join(10)


def dry_run(durable: Durable, runs: int, fig: Figures, timer: Timer) -> None:
    """(a) The dry run of the brief's filter: every failed run of ``charge``."""
    say(f"{timer} (a) dry run: bulk('retry', dry_run=True, workflow='charge', status='failed')")
    began = time.perf_counter()
    report = durable.bulk(
        "retry", dry_run=True, workflow="charge", status="failed", progress=Progress(timer, 40)
    )
    took = time.perf_counter() - began
    say(f"{timer}   {report.summary()}")
    fig.add(
        "(a) dry run: matched, seconds",
        f"{report.matched:,} in {took:.1f} s ({report.matched / took:,.0f} runs/s)",
    )
    fig.check("dry run matches every failed run", report.matched == report.acted == runs, report.summary())
    fig.add("peak RSS after (a)", f"{peak_rss():.0f} MB")


def interrupted(durable: Durable, runs: int, window: dict[str, Any], fig: Figures, timer: Timer) -> int:
    """(b) The bulk retry, interrupted from its progress callback; the runs it retried."""
    stop_at = int((runs + COMPLETED) * INTERRUPT_AT)
    say(f"{timer} (b) bulk retry of the window, interrupted after about {stop_at:,} runs looked at")
    began = time.perf_counter()
    try:
        durable.bulk("retry", by="bench", progress=Progress(timer, 20, stop_at), **window)
    except KeyboardInterrupt:
        pass
    else:
        raise RuntimeError("the bulk retry was not interrupted")
    took = time.perf_counter() - began
    durable.flush()
    left = scalar(durable, "SELECT count(*) FROM durable_runs WHERE status = 'failed'")
    done = runs - int(left)
    fig.add(
        "(b) interrupted: runs retried before it, seconds",
        f"{done:,} in {took:.1f} s ({done / took:,.0f} runs/s)",
    )
    fig.check("the interrupted action retried runs, not all", 0 < done < runs, f"{done:,} no longer failed")
    fig.add("peak RSS after (b)", f"{peak_rss():.0f} MB")
    return done


def run_again(durable: Durable, runs: int, done: int, ctx: dict[str, Any], fig: Figures, timer: Timer) -> Any:
    """(c) The same bulk retry again, sampled (e) and counted (f)."""
    admin, db, window = ctx["admin"], ctx["db"], ctx["window"]
    before = xacts(durable, admin, db)
    say(f"{timer} (c) the same bulk retry again (transactions sampled every {SAMPLE_SECONDS * 1000:.0f} ms)")
    with sampling(admin, db) as sampler:
        began = time.perf_counter()
        report = durable.bulk("retry", by="bench", progress=Progress(timer, 20), **window)
        took = time.perf_counter() - began
        durable.flush()
    after = xacts(durable, admin, db)
    say(f"{timer}   {report.summary()}")
    fig.add(
        "(c) run again: acted, seconds",
        f"{report.acted:,} in {took:.1f} s ({report.acted / took:,.0f} runs/s)",
    )
    fig.add("(c) run again: skipped", "; ".join(f"{n:,} {why}" for why, n in report.skipped.items()))
    fig.check(
        "run again acts on the rest", report.acted == runs - done, f"{report.acted:,} = {runs:,} - {done:,}"
    )
    want = {"not failed (completed)": COMPLETED, "not failed (running)": done}
    fig.check("run again skips what was done, with reasons", report.skipped == want, str(report.skipped))
    fig.add("peak RSS after (c)", f"{peak_rss():.0f} MB")
    age, query = sampler.longest
    fig.add(
        "(e) longest transaction seen in (c)",
        f"{age * 1000:.1f} ms ({sampler.samples:,} samples, "
        f"{sampler.open_samples:,} found one open; {query.split()[0] if query else '-'})",
    )
    fig.check(
        "no transaction holds the action", age < min(1.0, took / 10), f"{age * 1000:.1f} ms vs {took:.0f} s"
    )
    commits, rollbacks = after[0] - before[0], after[1] - before[1]
    fig.add(
        "(f) transactions in (c)",
        f"{commits / report.acted:.2f} committed per run acted, {rollbacks / report.matched:.2f} read-only"
        f" (rolled back) per run looked at ({commits:,} and {rollbacks:,} in all)",
    )
    fig.check(
        "about one committed transaction per run acted", 1 <= commits / report.acted < 1.1, f"{commits:,}"
    )
    return report


def messages(ctx: dict[str, Any], runs: int, done: int, fig: Figures) -> None:
    """(g) The queue holds a message per run acted; how the publisher batched them."""
    client, queue, base, sizes = ctx["redis"], ctx["queue"], ctx["queued"], ctx["batches"]
    sent, in_b = queued(client, queue) - base, ctx["queued_b"] - base
    fig.check("a message in the queue per run (b) retried", in_b == done, f"{in_b:,} messages")
    fig.check(
        "a message in the queue per run (c) retried", sent - in_b == runs - done, f"{sent - in_b:,} messages"
    )
    many = [n for n in sizes if n > 1]
    fig.add(
        "(g) messages, publisher batches",
        f"{sent:,} in {len(sizes):,} batches (mean {sum(sizes) / max(len(sizes), 1):.1f}, "
        f"largest {max(sizes, default=0)}; {sum(many):,} messages in {len(many):,} batches of 2 or more)",
    )


def entries(durable: Durable, report: Any, runs: int, fig: Figures) -> None:
    """(h) One ``bulk`` entry for the interrupted pass, one for the completed one; one
    ``retried`` entry per run."""
    found = durable.activity(kinds="bulk", limit=1000)
    ours = [e for e in found if e.details.get("bulk") == report.bulk_id]
    done = [e for e in ours if not e.details.get("interrupted")]
    dry = [e for e in found if e.details.get("dry_run")]
    ok = len(ours) == 2 and len(done) == 1 and done[0].details.get("acted") == report.acted
    ok = ok and len(found) == 2 + len(dry)
    detail = f"{len(ours)} for bulk {report.bulk_id}, {len(dry)} for the dry run (a), {len(found)} in all"
    fig.check("one bulk entry for the interrupted pass and one for the completed one", ok, detail)
    with durable.db.engine.connect() as conn:
        row = conn.execute(text(RETRIED)).one()
        named = conn.execute(
            text("SELECT count(*) FROM durable_activity WHERE kind = 'retried' AND details->>'from' = :o"),
            {"o": f"bulk {report.bulk_id}"},
        ).scalar()
    twice = f"{row.runs:,} runs with a retried entry, {row.twice} with more than one"
    fig.check("no run retried twice", row.twice == 0 and row.runs == row.entries, twice)
    fig.check(
        "every run's entry names the bulk action", named == runs, f"{named:,} name bulk {report.bulk_id}"
    )
    fig.add(
        "(h) activity entries",
        f"{len(ours)} bulk entry for the action (+{len(dry)} for the dry run); {named:,} retried entries"
        f" naming it, {row.twice} run retried twice",
    )


def flow_control(durable: Durable, gate: Gate, window: tuple[datetime, datetime], fig: Figures) -> None:
    """(i) The retried runs' messages handled 65 at once: 50 execute, the rest park for a slot."""
    with durable.db.engine.connect() as conn:
        oldest = list(
            conn.execute(
                text(FLOW_PICK.format(order="ASC")), {"until": window[1], "n": FLOW_OLDEST}
            ).scalars()
        )
        newest = list(
            conn.execute(
                text(FLOW_PICK.format(order="DESC")), {"until": window[1], "n": FLOW_NEWEST}
            ).scalars()
        )
    ids = oldest + newest
    gate.closed = True
    threads = [threading.Thread(target=durable.run_message, args=("charge", 0, i), daemon=True) for i in ids]
    for thread in threads:
        thread.start()
    deadline, state = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        state = flow_state(durable, ids)
        if state.executing + state.parked >= len(ids):
            break
        time.sleep(0.05)
    gate.opened.set()
    for thread in threads:
        thread.join(60)
    end = flow_state(durable, ids)
    assert state is not None
    detail = (
        f"{state.executing} executing at once, {state.parked} parked for a slot;"
        f" then {end.completed} completed"
    )
    fig.add("(i) 65 retried runs' messages handled at once", detail)
    ok = state.executing == LIMIT and state.parked == len(ids) - LIMIT and end.completed == LIMIT
    fig.check(f"flow control holds for retried runs (limit {LIMIT})", ok, detail)


def flow_state(durable: Durable, ids: list[str]) -> Any:
    """How many of ``ids`` execute, are parked for a slot, completed."""
    with durable.db.engine.connect() as conn:
        return conn.execute(text(FLOW_STATE), {"ids": ids}).one()


def report_table(runs: int, fig: Figures) -> bool:
    """Print the checks and the figures; True if every check held."""
    say("")
    say(f"bulk retry of {runs:,} failed runs (+{COMPLETED:,} completed in the window)")
    width = max(len(label) for label, _ in fig.rows)
    for label, value in fig.rows:
        say(f"  {label:{width}}  {value}")
    failed = [c for c in fig.checks if not c[1]]
    say(f"checks: {len(fig.checks) - len(failed)} of {len(fig.checks)} held")
    for label, _, detail in failed:
        say(f"  FAILED {label}: {detail}")
    return not failed


def measure(durable: Durable, runs: int, ctx: dict[str, Any], fig: Figures, timer: Timer) -> None:
    """(a) to (i), after the build."""
    t0, t1 = ctx["window_times"]
    ctx["window"] = {"workflow": "charge", "since": t0, "until": t1}
    dry_run(durable, runs, fig, timer)
    ctx["queued"] = queued(ctx["redis"], ctx["queue"])
    ctx["batches"] = count_batches(durable)
    done = interrupted(durable, runs, ctx["window"], fig, timer)
    ctx["queued_b"] = queued(ctx["redis"], ctx["queue"])
    report = run_again(durable, runs, done, ctx, fig, timer)
    messages(ctx, runs, done, fig)
    entries(durable, report, runs, fig)
    say(f"{timer} (i) flow control: the messages of {FLOW_OLDEST + FLOW_NEWEST} retried runs handled at once")
    flow_control(durable, ctx["gate"], ctx["window_times"], fig)


@click.command()
@click.option(
    "--runs", default=100_000, show_default=True, type=click.IntRange(100), help="Failed runs to retry."
)
@click.option(
    "--server", default=SERVER, show_default=True, help="PostgreSQL server (a database made there)."
)
@click.option(
    "--broker",
    default=None,
    help="Redis URL (only the bench's queue is touched); default: a private redis-server.",
)
def main(runs: int, server: str, broker: str | None) -> None:
    """Bulk-retry --runs failed runs, interrupted and run again; print figures and checks."""
    timer, fig, gate = Timer(), Figures(), Gate()
    now = datetime.now(timezone.utc).replace(second=0, microsecond=0)
    window = (now - timedelta(hours=1), now - timedelta(hours=1) + WINDOW)
    with private_redis(broker) as broker_url, scratch_database(server, "bench_ops_bulk") as url:
        db = make_url(url).database or ""
        queue = f"{db}_charge"
        admin = create_engine(
            make_url(normalize_url(server.rstrip("/") + "/postgres")), isolation_level="AUTOCOMMIT"
        )
        client = redis.Redis.from_url(broker_url)
        durable = Durable(Celery("bench_bulk", broker=broker_url), url, upkeep=False)
        define(durable, queue, gate)
        ctx = {
            "admin": admin,
            "db": db,
            "redis": client,
            "queue": queue,
            "gate": gate,
            "window_times": window,
        }
        try:
            build(durable, runs, timer, window)
            fig.add("peak RSS after the build", f"{peak_rss():.0f} MB")
            measure(durable, runs, ctx, fig, timer)
        finally:
            gate.opened.set()
            durable.flush(10)
            durable.db.dispose()
            admin.dispose()
            client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
            client.close()
    if not report_table(runs, fig):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
