"""What an atomic step costs against a plain one (issue 40): statements and round trips per
step, and runs/s end to end, against a plain Celery task doing the same write.

    python -m bench.atomic                                 # 2,000 runs a side in 4 rounds (about 1 min)
    python -m bench.atomic -n 200 --rounds 1 --count 40    # a quick look
    python -m bench.atomic --help

Every side is a one-step run (or a task) that inserts one row into ``bench_atomic_rows``, an
application table on durable's own database:

- **celery**: a plain Celery task doing the insert in ``with engine.begin()`` on an application
  engine; the ratios are against it;
- **plain, autocommit**: a durable step doing it on a connection of an application engine made
  with ``isolation_level="AUTOCOMMIT"``;
- **plain, engine.begin()**: a durable step doing it in ``with engine.begin()`` (a transaction of
  its own, as a user would write it);
- **atomic**: ``@wf.step(atomic=True)`` doing it on ``current_run().connection``.

Timed: the sides take turns (``--rounds``, the order rotated each round) on one in-process
worker (``durable_celery.testing.worker``, threads pool, ``--concurrency`` 2) on a redis-server
of the bench's own; runs are started from this process's main thread, and counted done in
process (``durable_run_finished``; ``task_postrun`` for the Celery task), so nothing polls the
database. Upkeep is off. CPU per run of this process and of the database's PostgreSQL backends
(read from ``/proc``).

Counted (untimed, after): ``--count`` runs a side on a second app, Durable and application
engines whose connections go through a proxy of the bench's own that reads the PostgreSQL
protocol. Each ``Query`` message and each ``Sync`` is one round trip (the client then waits for
the server's ``ReadyForQuery``), so what psycopg sends, ``BEGIN`` and ``COMMIT`` included, is
counted as it goes, by its SQL (a prepared statement is known by its ``Parse``). Per step (the
worker's threads), statements and transaction commands come from SQLAlchemy's events on every
engine (``before_cursor_execute``, ``commit``, ``rollback``), a ``BEGIN``, ``COMMIT`` or
``ROLLBACK`` counted only when psycopg sends one: ``BEGIN`` before the first statement on an
idle connection out of autocommit, ``COMMIT`` and ``ROLLBACK`` in an open transaction only; and
commits (a ``COMMIT``, or a statement in autocommit: each waits for a WAL flush). The wire's
count per run (the start, pool pings and psycopg's prepares included) checks them.
The events put durable's hot statements on SQLAlchemy's path (``store/direct.py``), which sends
the same messages; the timed rounds run without them.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import click
from celery import Celery
from celery.signals import task_postrun, task_prerun
from psycopg.pq import TransactionStatus
from sqlalchemy import BigInteger, Column, Identity, Integer, MetaData, String, Table, create_engine, event
from sqlalchemy import insert as insert_into
from sqlalchemy.engine import Connection, Engine, make_url

from bench.common import private_redis, say
from bench.scratch import SERVER, scratch_database
from bench.throughput import CpuMeter
from durable_celery import Durable, current_run, signals
from durable_celery.testing import worker

SIDES = {
    "celery": "Celery task, engine.begin()",
    "plain_auto": "plain step, autocommit",
    "plain_tx": "plain step, engine.begin()",
    "atomic": "atomic step",
}
TRIPS_TARGET = 1  # round trips an atomic step may add to a plain step in a transaction of its own
TX_COMMANDS = ("BEGIN", "COMMIT", "ROLLBACK")
POSITIVE = click.IntRange(1)

ROWS = Table(
    "bench_atomic_rows",
    MetaData(),
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("side", String(16), nullable=False),
    Column("batch", String(16), nullable=False),
    Column("n", Integer, nullable=False),
)


# -- what a statement is ----------------------------------------------------------------------

_SPACE = re.compile(r"\s+")
_WRITES = re.compile(r"\b(INSERT INTO|UPDATE|DELETE FROM)\s+\"?(\w+)")


def label(sql: str) -> str:
    """A short name for a statement, the same for SQLAlchemy's text and psycopg's."""
    flat = _SPACE.sub(" ", sql).strip()
    upper = flat.upper()
    verb = upper.split(" ", 1)[0] if upper else "?"
    if verb == "BEGIN" and "SET LOCAL" in upper:
        return "BEGIN; SET LOCAL statement_timeout, idle_in_transaction_session_timeout"
    if verb in TX_COMMANDS:
        return verb
    if upper == "SELECT 1":
        return "SELECT 1 (pool ping)"
    writes = [f"{w.split()[0]} {t.lower()}" for w, t in _WRITES.findall(upper)]
    if verb == "WITH":
        return "WITH (" + ", ".join(dict.fromkeys(writes)) + ")"
    if writes:
        return writes[0] + (" RETURNING" if " RETURNING " in upper else "")
    table = re.search(r"\bFROM\s+\"?(\w+)", upper)
    return f"{verb} {table.group(1).lower()}" if table else flat[:60]


def is_the_steps(name: str) -> bool:
    """Is this the step's own write (not durable's)?"""
    return ROWS.name in name


# -- counting on the wire ---------------------------------------------------------------------


class Wire:
    """A TCP proxy to PostgreSQL counting its clients' round trips by what they run.

    Its URL turns TLS and GSS encryption off, so the first message of a connection is the
    startup message and every later one a typed message (``Q``, ``P``, ``B``, ``S``, ...)."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.trips: Counter[str] = Counter()
        self.connections = 0
        self.counting = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="bench-wire", daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` through this proxy."""
        parsed = make_url(url)
        query = {**parsed.query, "sslmode": "disable", "gssencmode": "disable"}
        moved = parsed.set(host="127.0.0.1", port=self.port, query=query)
        return moved.render_as_string(hide_password=False)

    def reset(self, counting: bool) -> None:
        with self._lock:
            self.trips.clear()
            self.connections = 0
            self.counting = counting

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += self.counting
            threading.Thread(target=self._from_client, args=(client, server), daemon=True).start()
            threading.Thread(target=_relay, args=(server, client), daemon=True).start()

    def _from_client(self, client: socket.socket, server: socket.socket) -> None:
        buffer, started = bytearray(), False
        names: dict[bytes, str] = {}  # prepared statement name -> label
        pending: list[tuple[str, bytes]] = []  # Parse, Bind, Close since the last Sync
        try:
            while data := client.recv(65536):
                server.sendall(data)
                buffer += data
                while True:
                    if not started:  # the startup message: a length, no type byte
                        if len(buffer) < 4 or len(buffer) < int.from_bytes(buffer[:4], "big"):
                            break
                        del buffer[: int.from_bytes(buffer[:4], "big")]
                        started = True
                        continue
                    if len(buffer) < 5 or len(buffer) < 1 + int.from_bytes(buffer[1:5], "big"):
                        break
                    end = 1 + int.from_bytes(buffer[1:5], "big")
                    kind, body = chr(buffer[0]), bytes(buffer[5:end])
                    del buffer[:end]
                    self._message(kind, body, names, pending)
        except OSError:
            pass
        finally:
            _close(client, server)

    def _message(self, kind: str, body: bytes, names: dict[bytes, str], pending: list[Any]) -> None:
        if kind == "Q":  # a simple query: BEGIN, COMMIT, anything without parameters
            self._trip(label(body.split(b"\0", 1)[0].decode()))
        elif kind == "P":  # Parse: statement name, SQL
            name, rest = body.split(b"\0", 1)
            names[name] = label(rest.split(b"\0", 1)[0].decode())
            pending.append(("parse", name))
        elif kind == "B":  # Bind: portal name, statement name
            pending.append(("bind", body.split(b"\0", 2)[1]))
        elif kind == "C":  # Close of a prepared statement
            pending.append(("close", body[1:].split(b"\0", 1)[0]))
        elif kind == "S":  # Sync: the client waits for ReadyForQuery
            binds = [name for what, name in pending if what == "bind"]
            if binds:
                self._trip(names.get(binds[-1], "?"))
            elif pending:
                what, name = pending[-1]
                self._trip(f"{'prepare' if what == 'parse' else 'close'}: {names.get(name, '?')}")
            else:
                self._trip("Sync")
            pending.clear()

    def _trip(self, what: str) -> None:
        with self._lock:
            if self.counting:
                self.trips[what] += 1


def _relay(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        _close(source, target)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with suppress(OSError):
            sock.close()


# -- counting at SQLAlchemy's level -----------------------------------------------------------


class Tally:
    """Statements and the transaction commands psycopg sends, by thread role and statement,
    on every engine attached; commits (each a WAL flush: a ``COMMIT``, or a statement in
    autocommit); and each worker task's sequence of round trips (its shape)."""

    def __init__(self) -> None:
        self.producer = threading.get_ident()
        self.counts: Counter[tuple[str, str]] = Counter()  # (role, label)
        self.commits: Counter[str] = Counter()  # by role
        self.shapes: Counter[tuple[str, ...]] = Counter()
        self.counting = False
        self._lock = threading.Lock()
        self._local = threading.local()

    def attach(self, engine: Engine) -> None:
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "commit", lambda conn: self._ending(conn, "COMMIT"))
        event.listen(engine, "rollback", lambda conn: self._ending(conn, "ROLLBACK"))

    def reset(self, counting: bool) -> None:
        with self._lock:
            self.counts.clear()
            self.commits.clear()
            self.shapes.clear()
            self.counting = counting

    def task_began(self, **_: Any) -> None:
        self._local.shape = []

    def task_ended(self, **_: Any) -> None:
        shape = tuple(getattr(self._local, "shape", ()))
        with self._lock:
            if self.counting:
                self.shapes[shape] += 1

    def _add(self, what: str, commits: bool = False) -> None:
        role = "producer" if threading.get_ident() == self.producer else "worker"
        with self._lock:
            if self.counting:
                self.counts[(role, what)] += 1
                self.commits[role] += commits
        if role == "worker" and hasattr(self._local, "shape"):
            self._local.shape.append(what)

    def _statement(self, conn: Connection, cursor: Any, statement: str, *_: Any) -> None:
        driver: Any = conn.connection.dbapi_connection
        idle = driver.info.transaction_status == TransactionStatus.IDLE
        if idle and not driver.autocommit:
            self._add("BEGIN")  # psycopg sends it before the statement
        what = label(statement)
        self._add(what, commits=idle and driver.autocommit and not what.startswith("BEGIN"))

    def _ending(self, conn: Connection, command: str) -> None:
        driver: Any = conn.connection.dbapi_connection
        if driver is not None and driver.info.transaction_status != TransactionStatus.IDLE:
            self._add(command, commits=command == "COMMIT")  # nothing is sent outside a transaction


# -- the sides --------------------------------------------------------------------------------


class Finished:
    """Runs (and tasks) finished in this process, by side; any that did not complete."""

    def __init__(self) -> None:
        self.done: Counter[str] = Counter()
        self.failed: list[str] = []
        self.sides: dict[str, str] = {}  # workflow name -> side
        self.tasks: set[str] = set()  # the Celery side's task names
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def run_finished(self, sender: Any = None, workflow: str = "", status: str = "", **_: Any) -> None:
        side = self.sides.get(workflow)
        if side is None:
            return
        with self._changed:
            self.done[side] += 1
            if status != "completed":
                self.failed.append(f"{workflow}: {status}")
            self._changed.notify_all()

    def task_finished(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", "") in self.tasks:
            with self._changed:
                self.done["celery"] += 1
                self._changed.notify_all()

    def wait(self, side: str, target: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.done[side] < target and not self.failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise click.ClickException(
                        f"{SIDES[side]}: {self.done[side]} of {target} done in {timeout}s"
                    )
                self._changed.wait(min(left, 1.0))
            if self.failed:
                raise click.ClickException(f"runs did not complete: {', '.join(self.failed[:3])}")


def insert_row(conn: Connection, side: str, batch: str, n: int) -> None:
    conn.execute(insert_into(ROWS).values(side=side, batch=batch, n=n))


@dataclass
class Setup:
    """A Celery app with the task and the three workflows, its Durable and application engines."""

    app: Celery
    durable: Durable
    engines: list[Engine]
    starts: dict[str, Callable[[str, int], Any]] = field(default_factory=dict)

    def dispose(self) -> None:
        for engine in self.engines:
            engine.dispose()
        self.durable.db.dispose()


def build(url: str, broker: str, queue: str, finished: Finished) -> Setup:
    """The four sides on one app, for the database at ``url``."""
    app = Celery(f"bench_atomic_{queue}", broker=broker, set_as_current=True)
    app.conf.update(
        task_default_queue=queue,
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    in_tx = create_engine(url)
    autocommit = create_engine(url, isolation_level="AUTOCOMMIT")
    durable = Durable(app, url, upkeep=False)
    setup = Setup(app, durable, [in_tx, autocommit])

    @app.task(name=f"{queue}.insert", ignore_result=True, acks_late=True)
    def celery_insert(batch: str, n: int) -> None:
        with in_tx.begin() as conn:
            insert_row(conn, "celery", batch, n)

    plain_auto = durable.workflow(f"{queue}_plain_auto")

    @plain_auto.step
    def insert_autocommit(batch: str, n: int) -> None:
        with autocommit.connect() as conn:
            insert_row(conn, "plain_auto", batch, n)

    plain_tx = durable.workflow(f"{queue}_plain_tx")

    @plain_tx.step
    def insert_in_transaction(batch: str, n: int) -> None:
        with in_tx.begin() as conn:
            insert_row(conn, "plain_tx", batch, n)

    atomic = durable.workflow(f"{queue}_atomic")

    @atomic.step(atomic=True)
    def insert_atomically(batch: str, n: int) -> None:
        insert_row(current_run().connection, "atomic", batch, n)

    finished.tasks.add(celery_insert.name)
    setup.starts["celery"] = lambda batch, n: celery_insert.delay(batch, n)
    for side in ("plain_auto", "plain_tx", "atomic"):
        finished.sides[f"{queue}_{side}"] = side
        setup.starts[side] = partial(start_run, durable, f"{queue}_{side}")
    with durable.db.begin() as conn:
        ROWS.create(conn, checkfirst=True)
    return setup


def start_run(durable: Durable, workflow: str, batch: str, n: int) -> str:
    return durable.start(workflow, {"batch": batch, "n": n})


def batch_of(setup: Setup, finished: Finished, side: str, runs: int, timeout: float) -> float:
    """Start ``runs`` of ``side`` and wait until all are done; returns the seconds it took."""
    target = finished.done[side] + runs
    batch = uuid.uuid4().hex[:16]
    start = setup.starts[side]
    began = time.perf_counter()
    for n in range(runs):
        start(batch, n)
    finished.wait(side, target, timeout)
    return time.perf_counter() - began


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Timed:
    """One side's timed rounds together."""

    runs: int = 0
    seconds: float = 0.0
    cpu: float = 0.0  # this process: producer and worker
    server: float | None = 0.0  # PostgreSQL backends of the database (None: unreadable)
    rounds: list[float] = field(default_factory=list)  # runs/s of each round

    @property
    def rate(self) -> float:
        return self.runs / self.seconds


@dataclass
class Counted:
    """One side's counting pass."""

    runs: int
    events: Counter[tuple[str, str]]  # (role, label)
    wire: Counter[str]  # label -> round trips, every thread
    commits: Counter[str]  # by role
    connections: int
    shapes: Counter[tuple[str, ...]]

    def per_step(self, keep: Callable[[str], bool]) -> float:
        return (
            sum(n for (role, what), n in self.events.items() if role == "worker" and keep(what)) / self.runs
        )

    def producer(self) -> float:
        return sum(n for (role, _), n in self.events.items() if role == "producer") / self.runs

    def on_wire(self) -> float:
        return sum(self.wire.values()) / self.runs

    def shape(self) -> tuple[str, ...]:
        return self.shapes.most_common(1)[0][0] if self.shapes else ()


def timed_rounds(
    setup: Setup, finished: Finished, cpu: CpuMeter, runs: int, rounds: int, warmup: int, timeout: float
) -> dict[str, Timed]:
    """Every side ``rounds`` times, ``runs / rounds`` runs each time, in a rotating order."""
    per_round = max(1, runs // rounds)
    found = {side: Timed() for side in SIDES}
    say(f"warming up: {warmup} runs of each side")
    for side in SIDES:
        batch_of(setup, finished, side, warmup, timeout)
    order = list(SIDES)
    for turn in range(1, rounds + 1):
        for side in order:
            before = cpu.snapshot()
            seconds = batch_of(setup, finished, side, per_round, timeout)
            own, server = cpu.since(before)
            timed = found[side]
            timed.runs += per_round
            timed.seconds += seconds
            timed.cpu += own
            timed.server = None if server is None or timed.server is None else timed.server + server
            rate = per_round / seconds
            timed.rounds.append(rate)
            say(
                f"round {turn}/{rounds}: {SIDES[side]:28} {per_round} runs in {seconds:5.2f}s = {rate:6.1f}/s"
            )
        order = order[1:] + order[:1]
    return found


def counting_pass(
    setup: Setup, finished: Finished, tally: Tally, wire: Wire, count: int, timeout: float
) -> dict[str, Counted]:
    """``count`` runs of each side with every statement and round trip counted."""
    found = {}
    for side in SIDES:
        batch_of(setup, finished, side, 10, timeout)  # connections open, statements prepared
        tally.reset(True)
        wire.reset(True)
        batch_of(setup, finished, side, count, timeout)
        tally.counting = False
        wire.counting = False
        found[side] = Counted(
            count,
            Counter(tally.counts),
            Counter(wire.trips),
            Counter(tally.commits),
            wire.connections,
            Counter(tally.shapes),
        )
        say(f"counted {SIDES[side]:28} {count} runs: {found[side].on_wire():.2f} round trips a run")
    return found


@contextmanager
def signals_connected(finished: Finished, tally: Tally) -> Iterator[None]:
    handlers = [
        (signals.run_finished, finished.run_finished),
        (task_postrun, finished.task_finished),
        (task_prerun, tally.task_began),
        (task_postrun, tally.task_ended),
    ]
    for signal, handler in handlers:
        signal.connect(handler, weak=False)
    try:
        yield
    finally:
        for signal, handler in handlers:
            signal.disconnect(handler)


# -- reporting --------------------------------------------------------------------------------


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    """Print rows under a header, the first column left-aligned and the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(widths[i]) for i, cell in enumerate(row) if i]
        say("  " + "  ".join(cells))


def every(_: str) -> bool:
    return True


def durables(what: str) -> bool:
    return what not in TX_COMMANDS and not is_the_steps(what)


def report_rates(timed: dict[str, Timed], concurrency: int) -> None:
    celery, plain = timed["celery"].rate, timed["plain_tx"].rate
    rows = []
    for side, t in timed.items():
        server = "?" if t.server is None else f"{1000 * t.server / t.runs:.2f}"
        rows.append(
            (SIDES[side], str(t.runs), f"{t.rate:.1f}", f"{t.rate / celery:.2f}", f"{t.rate / plain:.2f}")
            + (f"{1000 * t.cpu / t.runs:.2f}", server, ", ".join(f"{r:.0f}" for r in t.rounds))
        )
    say(f"runs/s: one-step runs (Celery: tasks) inserting one row; threads pool, concurrency {concurrency}")
    header = ("side", "runs", "runs/s", "x celery", "x plain tx", "CPU ms here", "ms PostgreSQL", "rounds")
    table(header, rows)


def report_trips(counted: dict[str, Counted]) -> None:
    runs = next(iter(counted.values())).runs
    rows = []
    for side, c in counted.items():
        rows.append(
            (SIDES[side], f"{c.per_step(durables):.2f}", f"{c.per_step(is_the_steps):.2f}")
            + (f"{c.per_step(lambda w: w in TX_COMMANDS):.2f}", f"{c.per_step(every):.2f}")
            + (f"{c.commits['worker'] / c.runs:.2f}",)
            + (f"{c.on_wire():.2f}", f"{c.producer():.2f}")
        )
    say(f"per step ({runs} runs a side counted; SQL statements and what psycopg sends, the worker's threads)")
    header = (
        "side",
        "durable's",
        "the step's",
        "BEGIN/COMMIT",
        "round trips",
        "commits",
        "wire per run",
        "start",
    )
    table(header, rows)
    say("")
    say("what one step sends, in order:")
    for side, c in counted.items():
        say(f"  {SIDES[side]:28} {' -> '.join(c.shape())}")
    say("")
    say("on the wire, round trips per run (every thread: the start, pings and psycopg's prepares too):")
    for side, c in counted.items():
        say(
            f"  {SIDES[side]:28} " + ", ".join(f"{what} {n / c.runs:.2f}" for what, n in c.wire.most_common())
        )
        unseen = sum(
            n for what, n in c.wire.items() if what.startswith(("prepare:", "close:")) or "ping" in what
        )
        left = c.on_wire() - c.per_step(every) - c.producer() - unseen / c.runs
        if abs(left) > 0.005:
            say(f"  {'':28} {left:+.2f} a run that SQLAlchemy's events did not count")


def verdict(timed: dict[str, Timed], counted: dict[str, Counted]) -> None:
    atomic, in_tx, auto = counted["atomic"], counted["plain_tx"], counted["plain_auto"]
    extra = atomic.per_step(every) - in_tx.per_step(every)
    more = [f"+{w}" for w in (Counter(atomic.shape()) - Counter(in_tx.shape())).elements()]
    fewer = [f"-{w}" for w in (Counter(in_tx.shape()) - Counter(atomic.shape())).elements()]
    say("")
    say(f"atomic step vs plain step in a transaction: {extra:+.2f} round trips")
    for change in more + fewer:
        say(f"  {change}")
    over_auto = atomic.per_step(every) - auto.per_step(every)
    say(f"atomic step vs plain step in autocommit: {over_auto:+.2f} round trips")
    flushes = ", ".join(f"{SIDES[side]} {c.commits['worker'] / c.runs:.2f}" for side, c in counted.items())
    say(f"commits per step (each a WAL flush): {flushes}")
    say(f"runs/s, atomic / plain step in a transaction: {timed['atomic'].rate / timed['plain_tx'].rate:.2f}")
    met = "met" if extra <= TRIPS_TARGET + 0.005 else "MISSED"
    say(f"target: an atomic step adds at most {TRIPS_TARGET} round trip to a plain one: {met}")


@click.command()
@click.option("--runs", "-n", default=2000, show_default=True, type=POSITIVE, help="Timed runs a side.")
@click.option("--rounds", default=4, show_default=True, type=POSITIVE, help="Turns of each side.")
@click.option("--concurrency", "-c", default=2, show_default=True, type=POSITIVE, help="Worker threads.")
@click.option("--warmup", default=20, show_default=True, type=POSITIVE, help="Warm-up runs a side.")
@click.option("--count", default=200, show_default=True, type=POSITIVE, help="Runs a side counted.")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds a batch may take.")
@click.option("--server", default=SERVER, show_default=True, help="PostgreSQL (a scratch database is made).")
@click.option("--broker-url", default=None, help="A Redis instead of a redis-server of the bench's own.")
def main(
    runs: int,
    rounds: int,
    concurrency: int,
    warmup: int,
    count: int,
    timeout: float,
    server: str,
    broker_url: str | None,
) -> None:
    """An atomic step against a plain one: runs/s, statements and round trips per step."""
    began = time.perf_counter()
    finished, tally = Finished(), Tally()
    with (
        scratch_database(server, "bench_ops_atomic") as url,
        private_redis(broker_url) as broker,
        signals_connected(finished, tally),
    ):
        timed_setup = build(url, broker, f"atomic-{uuid.uuid4().hex[:6]}", finished)
        poller = create_engine(url, pool_size=1, max_overflow=0)
        try:
            say(f"worker: threads pool, concurrency {concurrency}; upkeep off")
            with worker(timed_setup.durable, concurrency=concurrency):
                timed = timed_rounds(timed_setup, finished, CpuMeter(poller), runs, rounds, warmup, timeout)
        finally:
            timed_setup.dispose()
            poller.dispose()
        parsed = make_url(url)
        wire = Wire(parsed.host or "127.0.0.1", parsed.port or 5432)
        counted_setup = build(wire.url(url), broker, f"atomic-{uuid.uuid4().hex[:6]}", finished)
        for engine in [*counted_setup.engines, counted_setup.durable.db.engine]:
            tally.attach(engine)
        try:
            say(f"counting: {count} runs a side through a counting proxy on port {wire.port}")
            with worker(counted_setup.durable, concurrency=concurrency):
                counted = counting_pass(counted_setup, finished, tally, wire, count, timeout)
        finally:
            counted_setup.dispose()
            wire.close()
    say("")
    report_rates(timed, concurrency)
    say("")
    report_trips(counted)
    verdict(timed, counted)
    say(f"\ntotal time {time.perf_counter() - began:.1f}s")


if __name__ == "__main__":
    main()
