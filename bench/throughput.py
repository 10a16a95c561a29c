"""Throughput of durable_celery against plain Celery chains, on one broker and one worker.

    python -m bench.throughput [--runs 300] [--concurrency 4] [--rounds 3] [--explain]

Three sides run on the same in-process Celery worker (thread pool), in turns (``--rounds``
rounds of each, so drift on the machine falls on all of them alike):

1. plain Celery: ``chain(noop.s(), noop.s(), noop.s())``, JSON, ``ignore_result``, ``acks_late``;
   completion is counted in-process with ``task_postrun`` (no result backend involved);
2. durable_celery, inline continuation on (the default): a three-step workflow of no-op steps;
   every run is started with ``durable.start()`` (timed), then the runs table is polled once
   every 50 ms;
3. the same with ``inline_steps=0``: one broker message per step.

The broker is a ``redis-server`` this bench starts on a spare port (``--broker-url`` names
another, which is left as it is).

SQL statements are counted with SQLAlchemy ``before_cursor_execute`` events on
``durable.db.engine`` and split by thread: the producer (``start()``, the main thread), the worker's
pool threads, and durable's upkeep and heartbeat threads. The completion poll uses an engine of its
own, so it is never counted. This prints figures; it is not a test.
"""

from __future__ import annotations

import os
import re
import resource
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import click
from celery import Celery, chain
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Engine

from bench.common import prepare_database, private_redis, say
from durable_celery import Durable

WORKFLOW = "bench3"
PLAIN_TASK = "bench.noop"
RATIO_TARGET = 1.0  # durable (inline on) / plain
RATIO_OFF_TARGET = 0.6  # durable with inline_steps=0 / plain
STATEMENTS_TARGET = 6  # per three-step run, inline on
POLL_INTERVAL = 0.05
ROLES = ("producer", "worker", "upkeep", "heartbeat")


# -- setup ------------------------------------------------------------------------------------


def check_schema(engine: Engine) -> None:
    """Fail early when the tables lack columns the code expects (a migration rewritten in place)."""
    from durable_celery.store.schema import metadata

    found = inspect(engine)
    missing = [
        f"{table.name}.{column}"
        for table in metadata.sorted_tables
        for column in set(table.c.keys())
        - ({c["name"] for c in found.get_columns(table.name)} if found.has_table(table.name) else set())
    ]
    if missing:
        raise click.ClickException(
            f"the database lacks {', '.join(sorted(missing)[:5])}{' ...' if len(missing) > 5 else ''}"
            " although it is migrated (was a migration rewritten in place?): rerun with --fresh"
        )


def empty_runs(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE durable_runs CASCADE"))  # and every table pointing at runs


def build_app(broker_url: str, database_url: str) -> tuple[Celery, Durable, Any, Any]:
    """One Celery app holding both the plain no-op task and the durable three-step workflow."""
    app = Celery("bench", broker=broker_url, set_as_current=True)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=PLAIN_TASK, ignore_result=True, acks_late=True, serializer="json", typing=False)
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    durable = Durable(app, database_url=database_url)
    workflow = durable.workflow(WORKFLOW)

    @workflow.step
    def first() -> None:
        return None

    @workflow.step
    def second() -> None:
        return None

    @workflow.step
    def third() -> None:
        return None

    return app, durable, noop, workflow


# -- counting ---------------------------------------------------------------------------------

_WORDS = re.compile(r"\s+")


def squash(statement: str) -> str:
    return _WORDS.sub(" ", statement).strip()


def label(statement: str) -> str:
    """A short name for a statement: verb, table and the clauses that matter for cost."""
    sql = squash(statement).upper()
    verb = sql.split(" ", 1)[0]
    table = re.search(r"(?:INTO|FROM|UPDATE|TRUNCATE)\s+\"?(\w+)", sql)
    parts = [verb, table.group(1).lower() if table else "?"]
    for clause in ("RETURNING", "FOR UPDATE", "SKIP LOCKED"):
        if clause in sql:
            parts.append(clause)
    return " ".join(parts)


@dataclass
class Tally:
    """Statements, transactions and pool checkouts seen on one engine, by thread role."""

    producer_ident: int
    explain: bool = False
    enabled: bool = False
    pre_ping: bool = False
    statements: Counter[str] = field(default_factory=Counter)
    commits: Counter[str] = field(default_factory=Counter)
    rollbacks: Counter[str] = field(default_factory=Counter)
    checkouts: Counter[str] = field(default_factory=Counter)
    connects: Counter[str] = field(default_factory=Counter)
    texts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    seconds: Counter[tuple[str, str]] = field(default_factory=Counter)
    shapes: dict[str, Counter[tuple[str, ...]]] = field(default_factory=lambda: defaultdict(Counter))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def role(self) -> str:
        thread = threading.current_thread()
        if thread.ident == self.producer_ident:
            return "producer"
        if thread.name.startswith("durable-upkeep"):
            return "upkeep"
        if thread.name.startswith("durable-heartbeat"):
            return "heartbeat"
        return "worker"

    def attach(self, engine: Engine) -> None:
        self.pre_ping = bool(getattr(engine.pool, "_pre_ping", False))
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)
        event.listen(engine, "commit", self._commit)
        event.listen(engine, "rollback", self._rollback)
        event.listen(engine.pool, "checkout", self._checkout)
        event.listen(engine.pool, "connect", self._connect)

    def reset(self, enabled: bool) -> None:
        with self._lock:
            for counter in (self.statements, self.commits, self.rollbacks, self.checkouts, self.connects):
                counter.clear()
            self.seconds.clear()
            self.texts.clear()
            self.shapes.clear()
            self.enabled = enabled

    def _before(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if not self.enabled:
            return
        role = self.role()
        with self._lock:
            self.statements[role] += 1
        if self.explain:
            conn.info.setdefault("bench_tx", []).append(label(statement))
            conn.info["bench_t0"] = time.perf_counter()

    def _after(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if not (self.enabled and self.explain):
            return
        took = time.perf_counter() - conn.info.pop("bench_t0", time.perf_counter())
        text_ = squash(statement)
        role = self.role()
        with self._lock:
            self.texts[role][text_] += 1
            self.seconds[(role, text_)] += took

    def _end(self, conn: Any, counter: Counter[str], how: str) -> None:
        shape = tuple(conn.info.pop("bench_tx", ()))
        if not self.enabled:
            return
        role = self.role()
        with self._lock:
            counter[role] += 1
            if self.explain:
                self.shapes[role][(*shape, how)] += 1

    def _commit(self, conn: Any) -> None:
        self._end(conn, self.commits, "COMMIT")

    def _rollback(self, conn: Any) -> None:
        self._end(conn, self.rollbacks, "ROLLBACK")

    def _checkout(self, dbapi_conn: Any, record: Any, proxy: Any) -> None:
        if self.enabled:
            role = self.role()
            with self._lock:
                self.checkouts[role] += 1

    def _connect(self, dbapi_conn: Any, record: Any) -> None:
        if self.enabled:
            role = self.role()
            with self._lock:
                self.connects[role] += 1


class Progress:
    """Prints a line each time another 10% of the runs is done (or started)."""

    def __init__(self, side: str, total: int, what: str = "runs done") -> None:
        self.side = side
        self.total = total
        self.what = what
        self.next_tenth = 1
        self.t0 = time.perf_counter()

    def update(self, done: int) -> None:
        while self.next_tenth <= 10 and done * 10 >= self.total * self.next_tenth:
            took = time.perf_counter() - self.t0
            say(f"  {self.side}: {self.next_tenth * 10:3d}% ({done}/{self.total} {self.what}) {took:6.2f}s")
            self.next_tenth += 1


class CpuMeter:
    """CPU seconds of this process, and of the PostgreSQL backends serving the bench database.

    Other work on the machine (another test suite, say) bends wall-clock figures; CPU per run does
    not move much with it. Backends are read from /proc, so that part needs the server on this host.
    """

    def __init__(self, poller: Engine) -> None:
        self.poller = poller
        self.tick = os.sysconf("SC_CLK_TCK")

    def snapshot(self) -> tuple[float, dict[int, float | None]]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        with self.poller.connect() as conn:
            pids = conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalars()
            backends = {pid: self._backend_cpu(pid) for pid in pids}
        return usage.ru_utime + usage.ru_stime, backends

    def since(self, before: tuple[float, dict[int, float | None]]) -> tuple[float, float | None]:
        """(this process, PostgreSQL backends or None if unreadable) CPU seconds since ``before``."""
        own, backends = self.snapshot()
        if any(cpu is None for cpu in backends.values()):
            return own - before[0], None
        server = sum((cpu or 0.0) - (before[1].get(pid) or 0.0) for pid, cpu in backends.items())
        return own - before[0], server

    def _backend_cpu(self, pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self.tick


# -- the plain side ---------------------------------------------------------------------------


class TaskCounter:
    """Counts finished no-op tasks in this process; sets an event when the target is reached."""

    def __init__(self) -> None:
        self.done = 0
        self.target = 0
        self.reached = threading.Event()
        self._lock = threading.Lock()

    def expect(self, tasks: int) -> None:
        with self._lock:
            self.done = 0
            self.target = tasks
            self.reached.clear()

    def __call__(self, sender: Any = None, **_: Any) -> None:
        with self._lock:
            self.done += 1
            if self.done >= self.target:
                self.reached.set()


def plain_batch(
    noop: Any, counter: TaskCounter, runs: int, timeout: float, progress: bool
) -> tuple[float, float]:
    """Send ``runs`` chains and wait for all their tasks; returns (seconds to send, seconds in all)."""
    counter.expect(3 * runs)
    shown = Progress("plain", runs) if progress else None
    t0 = time.perf_counter()
    for _ in range(runs):
        chain(noop.s(), noop.s(), noop.s()).apply_async()
    sent = time.perf_counter() - t0
    deadline = t0 + timeout
    while not counter.reached.wait(POLL_INTERVAL):
        if shown:
            shown.update(counter.done // 3)
        if time.perf_counter() > deadline:
            raise click.ClickException(f"plain: only {counter.done}/{3 * runs} tasks done after {timeout}s")
    total = time.perf_counter() - t0
    if shown:
        shown.update(runs)
    return sent, total


# -- the durable side -------------------------------------------------------------------------

_POLL = text(
    "SELECT count(*) FILTER (WHERE status = 'completed'),"
    " count(*) FILTER (WHERE status IN ('failed', 'cancelled', 'compensated', 'compensation_failed'))"
    " FROM durable_runs WHERE workflow = :workflow"
)


def finished_counts(poller: Engine) -> tuple[int, int]:
    with poller.connect() as conn:
        completed, bad = conn.execute(_POLL, {"workflow": WORKFLOW}).one()
    return int(completed), int(bad)


def durable_batch(
    durable: Durable,
    workflow: Any,
    poller: Engine,
    runs: int,
    timeout: float,
    progress: bool,
    keyed: bool = False,
) -> tuple[float, float]:
    """Start ``runs`` runs and wait until they completed; returns (seconds to start, seconds in all)."""
    baseline, _ = finished_counts(poller)
    batch = uuid.uuid4().hex[:8]
    launched = Progress("durable", runs, "start() calls made") if progress else None
    shown = Progress("durable", runs) if progress else None
    t0 = time.perf_counter()
    for made in range(1, runs + 1):
        durable.start(workflow, key=f"bench:{batch}:{made}" if keyed else None)
        if launched:
            launched.update(made)
    started = time.perf_counter() - t0
    deadline = t0 + timeout
    while True:
        completed, bad = finished_counts(poller)
        done = completed - baseline
        if shown:
            shown.update(done)
        if bad:
            raise click.ClickException(f"durable: {bad} run(s) ended without completing")
        if done >= runs:
            return started, time.perf_counter() - t0
        if time.perf_counter() > deadline:
            raise click.ClickException(f"durable: only {done}/{runs} runs completed after {timeout}s")
        time.sleep(POLL_INTERVAL)


# -- reporting --------------------------------------------------------------------------------


@dataclass
class Side:
    """What one side came to over every round."""

    name: str
    runs: int = 0
    started: float = 0.0  # seconds spent sending / starting
    total: float = 0.0  # seconds until every run finished
    cpu: float = 0.0  # this process (producer + worker)
    server: float | None = 0.0  # PostgreSQL backends (None: unreadable)
    statements: Counter[str] = field(default_factory=Counter)

    @property
    def rate(self) -> float:
        return self.runs / self.total

    @property
    def start_rate(self) -> float:
        return self.runs / self.started

    def per_run(self, role: str | None = None) -> float:
        count = sum(self.statements.values()) if role is None else self.statements[role]
        return count / self.runs


SIDES = {"plain": "plain Celery", "inline": "durable, inline on", "per_step": "durable, inline off"}


def print_figures(sides: dict[str, Side]) -> list[tuple[str, str, str, str]]:
    """Print the measured figures; returns the rows of the summary table."""
    plain, inline, per_step = sides["plain"], sides["inline"], sides["per_step"]
    say("")
    for side in sides.values():
        n = side.runs
        server = ""
        if side.name != "plain":
            server = " + ? ms" if side.server is None else f" + {1000 * side.server / n:.2f} ms"
            server += " in PostgreSQL"
        stmts = "" if side.name == "plain" else f"; {side.per_run():.2f} SQL statements/run"
        say(
            f"{SIDES[side.name]:<20}: {n} runs of 3 in {side.total:.2f}s = {side.rate:.1f} runs/s;"
            f" CPU {1000 * side.cpu / n:.2f} ms/run in this process{server}{stmts}"
        )
    ratio, ratio_off = inline.rate / plain.rate, per_step.rate / plain.rate
    say(f"ratios              : inline on / plain = {ratio:.2f}; inline off / plain = {ratio_off:.2f}")
    say(f"start()             : {inline.start_rate:.1f} calls/s (inline on side, worker running)")
    for side in (inline, per_step):
        split = ", ".join(f"{role} {side.per_run(role):.2f}" for role in ROLES)
        say(f"SQL by thread       : {SIDES[side.name]}: {split}")
    return [
        ("plain runs/s", f"{plain.rate:.1f}", "", ""),
        ("durable runs/s, inline on", f"{inline.rate:.1f}", "", ""),
        ("durable runs/s, inline off", f"{per_step.rate:.1f}", "", ""),
        ("inline on / plain", f"{ratio:.2f}", f">= {RATIO_TARGET}", _ok(ratio >= RATIO_TARGET)),
        (
            "inline off / plain",
            f"{ratio_off:.2f}",
            f">= {RATIO_OFF_TARGET}",
            _ok(ratio_off >= RATIO_OFF_TARGET),
        ),
        (
            "SQL statements/run, inline on",
            f"{inline.per_run():.2f}",
            f"<= {STATEMENTS_TARGET}",
            _ok(inline.per_run() <= STATEMENTS_TARGET),
        ),
        ("SQL statements/run, inline off", f"{per_step.per_run():.2f}", "", ""),
        ("  by worker (steps), inline on", f"{inline.per_run('worker'):.2f}", "", ""),
        ("  by producer (start)", f"{inline.per_run('producer'):.2f}", "", ""),
    ]


def print_sql(tally: Tally, n: int, total: float, stmts: dict[str, float]) -> None:
    """Statements, transactions and (estimated) round trips to PostgreSQL per durable run."""
    commits = sum(tally.commits.values()) / n
    rollbacks = sum(tally.rollbacks.values()) / n
    checkouts = sum(tally.checkouts.values()) / n
    connects = sum(tally.connects.values())
    pings = checkouts - connects / n if tally.pre_ping else 0.0
    trips = total + 2 * (commits + rollbacks) + pings
    split = ", ".join(f"{role} {stmts[role]:.2f}" for role in ROLES)
    say(f"SQL statements : {total:.2f} per run ({split})")
    say(
        f"transactions   : {commits:.2f} commits and {rollbacks:.2f} rollbacks per run;"
        f" {checkouts:.2f} pool checkouts per run (pool_pre_ping {'on' if tally.pre_ping else 'off'})"
    )
    parts = "statements + BEGIN + COMMIT" + (" + pre-ping" if tally.pre_ping else "")
    say(f"round trips    : ~{trips:.1f} to PostgreSQL per run ({parts})")
    if connects:
        say(
            f"connections    : {connects} opened while measuring (pool overflow?); the CPU of backends"
            " that closed again is missing above"
        )


def _ok(flag: bool) -> str:
    return "yes" if flag else "NO"


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    header = ("metric", "value", "target", "ok?")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    say("")
    for row in [header, *rows]:
        say("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def print_explain(tally: Tally, runs: int) -> None:
    say("")
    say(f"--explain: distinct SQL statements on durable.db.engine during the {runs} measured runs")
    say("(wall time per statement includes waiting for the GIL while other threads run)")
    for role in ROLES:
        texts = tally.texts.get(role)
        if not texts:
            continue
        say(
            f"[{role}] {tally.statements[role]} statements, {tally.commits[role]} commits,"
            f" {tally.checkouts[role]} pool checkouts"
        )
        for sql, count in texts.most_common():
            ms = 1000 * tally.seconds[(role, sql)] / count
            say(f"  {count / runs:6.2f}/run  {count:6d}x  {ms:6.2f} ms wall avg  {sql}")
        say(f"  transactions of [{role}] (statement labels, then how it ended):")
        for shape, count in tally.shapes[role].most_common():
            say(f"    {count / runs:6.2f}/run  {count:6d}x  {' ; '.join(shape)}")


# -- main -------------------------------------------------------------------------------------


def measure(
    sides: dict[str, Callable[[int, bool], tuple[float, float]]],
    durable: Durable,
    runs: int,
    rounds: int,
    warmup: int,
    tally: Tally,
    cpu: CpuMeter,
) -> dict[str, Side]:
    """Run every side ``rounds`` times in turn, ``runs / rounds`` runs each time."""
    inline_steps = durable.settings.inline_steps or 20
    per_round = max(1, runs // rounds)
    found = {name: Side(name) for name in SIDES}

    def configure(name: str) -> None:
        if name != "plain":  # read per message: switching between batches is enough
            durable.settings = replace(durable.settings, inline_steps=inline_steps if name == "inline" else 0)

    for name in SIDES:
        say(f"warming up {SIDES[name]} ({warmup} runs)")
        configure(name)
        sides["plain" if name == "plain" else "durable"](warmup, False)
    for turn in range(1, rounds + 1):
        for name in SIDES:
            say(f"round {turn}/{rounds}: {SIDES[name]}, {per_round} runs")
            configure(name)
            before = cpu.snapshot()
            tally.reset(enabled=name != "plain")
            started, total = sides["plain" if name == "plain" else "durable"](per_round, True)
            tally.enabled = False
            own, server = cpu.since(before)
            side = found[name]
            side.runs += per_round
            side.started += started
            side.total += total
            side.cpu += own
            side.server = None if server is None or side.server is None else side.server + server
            side.statements.update(tally.statements)
    return found


@click.command()
@click.option("--runs", "-n", default=300, show_default=True, type=click.IntRange(1), help="Runs per side.")
@click.option(
    "--concurrency",
    "-c",
    default=4,
    show_default=True,
    type=click.IntRange(1),
    help="Worker threads (the same worker serves both sides).",
)
@click.option(
    "--database-url",
    default="postgresql://postgres@127.0.0.1:5432/durable_bench",
    show_default=True,
    help="Created if missing, migrated, and its runs table emptied.",
)
@click.option(
    "--broker-url",
    default=None,
    help="A Redis to use (left as it is) instead of a redis-server of the bench's own.",
)
@click.option(
    "--rounds", default=3, show_default=True, type=click.IntRange(1), help="Turns of each side, interleaved."
)
@click.option(
    "--warmup", default=10, show_default=True, type=click.IntRange(1), help="Warm-up runs per side."
)
@click.option(
    "--timeout", default=120.0, show_default=True, help="Give up on a side after this many seconds."
)
@click.option("--keyed", is_flag=True, help="Start every durable run with a key of its own.")
@click.option(
    "--fresh", is_flag=True, help="Drop and recreate the database first (if a migration was rewritten)."
)
@click.option(
    "--explain", is_flag=True, help="Also print every distinct SQL statement and transaction per run."
)
def main(
    runs: int,
    concurrency: int,
    database_url: str,
    broker_url: str | None,
    rounds: int,
    warmup: int,
    timeout: float,
    keyed: bool,
    fresh: bool,
    explain: bool,
) -> None:
    """Runs/s of plain Celery chains vs durable_celery workflows (inline continuation on and
    off), CPU and SQL statements per run."""
    began = time.perf_counter()
    database_url = prepare_database(database_url, fresh)
    with ExitStack() as stack:
        if broker_url is None:
            broker_url = stack.enter_context(private_redis())
        app, durable, noop, workflow = build_app(broker_url, database_url)
        durable.migrate()
        check_schema(durable.db.engine)
        empty_runs(durable.db.engine)
        tally = Tally(producer_ident=threading.get_ident(), explain=explain)
        tally.attach(durable.db.engine)  # the engine exists now; worker threads share it
        poller = create_engine(database_url, pool_size=1, max_overflow=0)
        stack.callback(poller.dispose)
        stack.callback(durable.db.dispose)
        counter = TaskCounter()
        task_postrun.connect(counter, sender=noop, weak=False)
        sides: dict[str, Callable[[int, bool], tuple[float, float]]] = {
            "plain": lambda n, show: plain_batch(noop, counter, n, timeout, show),
            "durable": lambda n, show: durable_batch(durable, workflow, poller, n, timeout, show, keyed),
        }
        say(f"worker: threads pool, concurrency {concurrency}; broker {broker_url}")
        say(f"database: {durable.db.engine.url}")
        say(f"durable runs: {'each with a key of its own' if keyed else 'without keys'}")
        with start_worker(
            app,
            pool="threads",
            concurrency=concurrency,
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=30,
        ):
            found = measure(sides, durable, runs, rounds, warmup, tally, CpuMeter(poller))
    rows = print_figures(found)
    if explain:
        print_explain(tally, found["per_step"].runs // rounds)
    print_table(rows)
    say(f"\ntotal time {time.perf_counter() - began:.1f}s")


if __name__ == "__main__":
    main()
