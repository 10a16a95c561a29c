"""The producer side of keyed starts on PostgreSQL: rates, latencies and statements per start.

    python -m bench.keys [--count 1500] [--hammer-seconds 5] [--threads 32]

No worker runs; every figure is what ``durable.start()`` costs the caller:

1. one producer thread, in interleaved blocks so that drift hits every kind alike:
   - a bare single-row ``INSERT`` + ``COMMIT`` into a scratch table, on ``durable.db.engine``
     (same pool, driver and database), the floor a start is compared with;
   - a keyed start of a new key (creates the run, publishes its first step to Redis);
   - a duplicate: the same key while its holder is unfinished (``use_existing``, nothing published).
   The time of ``durable.publish`` is measured inside the new starts, so the rate is given with
   the publish (what a caller sees) and the share the publish takes.
2. SQL per start, in a separate untimed pass: statements (SQLAlchemy ``before_cursor_execute``),
   transactions (``begin`` on a connection not in autocommit), commits (``commit``) and pool
   checkouts (a connection that rested for a while is pinged at checkout; one in steady use is
   not). psycopg sends BEGIN as a round trip of its own, and none in autocommit.
3. 32 producers hammering one key for a few seconds: starts/s, errors, runs created (must be 1).

This prints figures; it is not a test.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
import redis
from celery import Celery
from sqlalchemy import Column, MetaData, String, Table, event, insert, text
from sqlalchemy.engine import Engine, make_url

from bench.common import prepare_database, private_redis, say
from durable_celery import Durable

WORKFLOW = "bench_keyed"
QUEUE = "bench_keys"  # a queue of its own, so only its own keys are deleted
DUP_KEY = "the-held-key"
HAMMER_KEY = "hammered"
RATIO_TARGET = 0.8
DUP_STATEMENTS_TARGET = 3
DUP_COMMITS_TARGET = 1
NEW_STATEMENTS_TARGET = 5
KINDS = ("bare", "new", "new_sync", "dup")
SQL_KINDS = ("bare", "new", "dup")

scratch = Table("bench_keys_scratch", MetaData(), Column("id", String(36), primary_key=True))


def verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


# -- setup ------------------------------------------------------------------------------------


@dataclass
class Producers:
    """The two producers compared: the default, and one that sends before start() returns."""

    durable: Durable  # publish_in_background=True (the default): the message leaves from a thread
    sync: Durable  # publish_in_background=False: start() returns once the message is sent


def build(database_url: str, broker_url: str, pool_size: int, background: bool = True) -> Durable:
    app = Celery("bench_keys", broker=broker_url, set_as_current=True)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    durable = Durable(
        app, database_url=database_url, pool_size=pool_size, upkeep=False, publish_in_background=background
    )
    workflow = durable.workflow(WORKFLOW, queue=QUEUE)

    @workflow.step
    def only(**_: Any) -> None:
        return None

    return durable


def empty_tables(engine: Engine) -> None:
    scratch.create(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE durable_runs CASCADE"))  # keys, steps and events go with it
        conn.execute(text("TRUNCATE durable_activity, bench_keys_scratch"))


# -- the kinds of call -------------------------------------------------------------------------


def bare_insert(producers: Producers, _n: int) -> None:
    with producers.durable.db.engine.begin() as conn:
        conn.execute(insert(scratch).values(id=str(uuid.uuid4())))


def new_start(producers: Producers, n: int) -> None:
    producers.durable.start(WORKFLOW, {"n": n}, key=f"new-{uuid.uuid4().hex}")


def new_start_sync(producers: Producers, n: int) -> None:
    producers.sync.start(WORKFLOW, {"n": n}, key=f"new-{uuid.uuid4().hex}")


def dup_start(producers: Producers, n: int) -> None:
    producers.durable.start(WORKFLOW, {"n": n}, key=DUP_KEY)


CALLS: dict[str, Callable[[Producers, int], None]] = {
    "bare": bare_insert,
    "new": new_start,
    "new_sync": new_start_sync,
    "dup": dup_start,
}


# -- counting statements ------------------------------------------------------------------------

_WORDS = re.compile(r"\s+")


def label(statement: str) -> str:
    """A short name for a statement: verb, table and the clauses that matter for cost."""
    sql = _WORDS.sub(" ", statement).strip().upper()
    table = re.search(r"(?:INTO|FROM|UPDATE)\s+\"?(\w+)", sql)
    parts = [sql.split(" ", 1)[0], table.group(1).lower() if table else "?"]
    parts += [clause for clause in ("ON CONFLICT", "RETURNING", "FOR UPDATE") if clause in sql]
    return " ".join(parts)


@dataclass
class SqlCount:
    """Statements, transactions, commits and pool checkouts on one engine while attached."""

    counts: Counter[str] = field(default_factory=Counter)
    shape: list[str] = field(default_factory=list)

    def attach(self, engine: Engine) -> None:
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "begin", self._begin)
        event.listen(engine, "commit", self._commit)
        event.listen(engine.pool, "checkout", self._checkout)

    def detach(self, engine: Engine) -> None:
        event.remove(engine, "before_cursor_execute", self._statement)
        event.remove(engine, "begin", self._begin)
        event.remove(engine, "commit", self._commit)
        event.remove(engine.pool, "checkout", self._checkout)

    def _statement(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.counts["statements"] += 1
        self.shape.append(label(statement))

    def _begin(self, conn: Any) -> None:
        # SQLAlchemy begins its own block on a connection in autocommit too; psycopg sends no
        # BEGIN then, and each statement commits on its own.
        if getattr(conn.connection.dbapi_connection, "autocommit", False):
            self.shape.append("(autocommit)")
            return
        self.counts["transactions"] += 1
        self.shape.append("BEGIN")

    def _commit(self, _conn: Any) -> None:
        self.counts["commits"] += 1
        self.shape.append("COMMIT")

    def _checkout(self, *_args: Any) -> None:
        self.counts["checkouts"] += 1
        self.shape.append("checkout")


def count_sql(producers: Producers, kind: str, calls: int) -> tuple[dict[str, float], list[str]]:
    """Per-call averages of what one kind costs in SQL, and the shape of its last call."""
    durable = producers.durable
    counter = SqlCount()
    counter.attach(durable.db.engine)
    try:
        for n in range(calls):
            counter.shape.clear()
            CALLS[kind](producers, n)
        durable.flush()
    finally:
        counter.detach(durable.db.engine)
    averages = {name: counter.counts[name] / calls for name in ("statements", "transactions", "commits")}
    averages["round_trips"] = sum(averages.values())  # statements, BEGINs and COMMITs
    averages["checkouts"] = counter.counts["checkouts"] / calls
    return averages, list(counter.shape)


# -- timing ---------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One kind's calls: their latencies, the time its publisher took to drain after each block
    (counted in its rate: deferring work must not look like saving it) and the CPU it used."""

    latencies: list[float] = field(default_factory=list)
    flush_seconds: float = 0.0
    cpu_seconds: float = 0.0
    block_rates: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.latencies) / (sum(self.latencies) + self.flush_seconds)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_block(producers: Producers, kind: str, calls: int, timing: Timing) -> None:
    call = CALLS[kind]
    durable = producers.sync if kind == "new_sync" else producers.durable
    cpu0 = time.process_time()  # every thread of this process: the publisher's too
    for n in range(calls):
        t0 = time.perf_counter()
        call(producers, n)
        timing.latencies.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    durable.flush()  # whatever the background publisher still holds is this block's work
    flush = time.perf_counter() - t0
    timing.flush_seconds += flush
    timing.cpu_seconds += time.process_time() - cpu0
    timing.block_rates.append(calls / (sum(timing.latencies[-calls:]) + flush))


def timed_pass(producers: Producers, count: int, blocks: int) -> dict[str, Timing]:
    timings = {kind: Timing() for kind in KINDS}
    per_block = max(1, count // blocks)
    t0 = time.perf_counter()
    for block in range(1, blocks + 1):
        order = KINDS if block % 2 else tuple(reversed(KINDS))  # neither kind always goes first
        for kind in order:
            time_block(producers, kind, per_block, timings[kind])
        rates = "  ".join(f"{kind} {timings[kind].block_rates[-1]:6.0f}/s" for kind in KINDS)
        say(f"  block {block}/{blocks}: {rates}   ({time.perf_counter() - t0:5.1f}s)")
    return timings


def start_to_broker(producers: Producers, client: redis.Redis, calls: int) -> dict[str, list[float]]:
    """Seconds from calling start() to its message being in Redis, one start at a time, for the
    background publisher and for a publish before return (what a worker can claim soonest)."""
    seen: dict[str, list[float]] = {"new": [], "new_sync": []}
    for n in range(calls):
        for kind in seen:
            t0 = time.perf_counter()
            CALLS[kind](producers, n)
            if client.brpop([QUEUE], timeout=10) is None:
                raise RuntimeError(f"no message in {QUEUE} 10 s after a start")
            seen[kind].append(time.perf_counter() - t0)
    return seen


# -- hammering one key ----------------------------------------------------------------------------


@dataclass
class Hammer:
    starts: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ids: set[str] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def hammer_thread(
    durable: Durable, result: Hammer, barrier: threading.Barrier, deadline: list[float]
) -> None:
    seen: set[str] = set()
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    barrier.wait()
    while time.perf_counter() < deadline[0]:
        t0 = time.perf_counter()
        try:
            seen.add(durable.start(WORKFLOW, {"t": threading.get_ident()}, key=HAMMER_KEY))
        except Exception as exc:  # counted and printed; the figures say what went wrong
            errors[type(exc).__name__] += 1
        latencies.append(time.perf_counter() - t0)
    with result.lock:
        result.starts += len(latencies) - sum(errors.values())
        result.ids |= seen
        result.errors.update(errors)
        result.latencies += latencies


def hammer(durable: Durable, threads: int, seconds: float) -> tuple[Hammer, float]:
    result = Hammer()
    deadline = [0.0]
    barrier = threading.Barrier(threads + 1)
    workers = [
        threading.Thread(target=hammer_thread, args=(durable, result, barrier, deadline), daemon=True)
        for _ in range(threads)
    ]
    for thread in workers:
        thread.start()
    deadline[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    barrier.wait()
    while any(t.is_alive() for t in workers):
        time.sleep(1.0)
        if time.perf_counter() < deadline[0] + 0.5:
            say(f"  {time.perf_counter() - t0:4.1f}s of {seconds:.0f}s")
    for thread in workers:
        thread.join(timeout=60)
    return result, time.perf_counter() - t0


# -- reporting ------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:6.2f} ms"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def report_rates(timings: dict[str, Timing]) -> bool:
    bare = timings["bare"]
    say(
        "\nsingle producer (interleaved blocks)             calls     rate     p50        p99   CPU/call"
        "   x bare  (median block)"
    )
    names = {
        "bare": "bare INSERT+COMMIT (scratch table)",
        "new": "keyed start, new key",
        "new_sync": "  ... publish_in_background=False",
        "dup": "keyed start, duplicate (held key)",
    }
    for kind in KINDS:
        t = timings[kind]
        ratios = [rate / bare_rate for rate, bare_rate in zip(t.block_rates, bare.block_rates, strict=True)]
        say(
            f"  {names[kind]:<44} {len(t.latencies):6d} {t.rate:7.0f}/s {ms(t.quantile(0.5))} "
            f"{ms(t.quantile(0.99))} {ms(t.cpu_seconds / len(t.latencies))}  {t.rate / bare.rate:5.2f}"
            f"  ({median(ratios):.2f})"
        )
    new = timings["new"]
    say(
        f"  (a new start's rate counts the {new.flush_seconds * 1000:.0f} ms its publisher took to drain "
        "after each block; CPU is this process's, every thread)"
    )
    ok = True
    for what, kind in (("new keyed", "new"), ("duplicate", "dup")):
        ratio = timings[kind].rate / bare.rate
        ok_kind = ratio >= RATIO_TARGET
        ok = ok and ok_kind
        say(f"  target: {what} starts/s >= {RATIO_TARGET} x bare: {ratio:.2f}  {verdict(ok_kind)}")
    return ok


def report_start_to_broker(seen: dict[str, list[float]]) -> None:
    say("\nfrom start() to the message in Redis, one start at a time      p50        p99")
    names = {"new": "background publisher (default)", "new_sync": "publish_in_background=False"}
    for kind, latencies in seen.items():
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        say(f"  {names[kind]:<58} {ms(median(latencies))} {ms(p99)}")


def report_sql(sql: dict[str, tuple[dict[str, float], list[str]]]) -> bool:
    say("\nSQL per call (untimed pass)          statements  transactions  commits  round trips  checkouts")
    for kind, (avg, _shape) in sql.items():
        say(
            f"  {kind:<34} {avg['statements']:10.2f} {avg['transactions']:13.2f} {avg['commits']:8.2f} "
            f"{avg['round_trips']:12.2f} {avg['checkouts']:10.2f}"
        )
    for kind, (_avg, shape) in sql.items():
        say(f"  one {kind}: {' -> '.join(shape)}")
    say("  (round trips = statements + BEGIN + COMMIT; a checkout pings only a rested connection)")
    new, dup = sql["new"][0], sql["dup"][0]
    ok_dup = dup["statements"] <= DUP_STATEMENTS_TARGET and dup["commits"] <= DUP_COMMITS_TARGET
    ok_new = new["statements"] <= NEW_STATEMENTS_TARGET
    say(
        f"  target: duplicate <= {DUP_STATEMENTS_TARGET} statements and {DUP_COMMITS_TARGET} commit: "
        f"{dup['statements']:.2f} / {dup['commits']:.2f}  {verdict(ok_dup)}"
    )
    say(
        f"  target: new keyed start <= {NEW_STATEMENTS_TARGET} statements: {new['statements']:.2f}  "
        f"{verdict(ok_new)}"
    )
    return ok_dup and ok_new


def report_hammer(durable: Durable, result: Hammer, took: float, threads: int, pool: int) -> bool:
    with durable.db.engine.connect() as conn:
        runs = conn.execute(
            text("SELECT count(*) FROM durable_runs WHERE workflow = :w AND key = :k"),
            {"w": WORKFLOW, "k": HAMMER_KEY},
        ).scalar()
    latencies = sorted(result.latencies)
    p50 = latencies[len(latencies) // 2] if latencies else 0.0
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    say(f"\n{threads} producers hammering one key ({took:.1f}s, pool of {pool}+{pool} connections)")
    say(f"  starts/s {result.starts / took:8.0f}   p50 {ms(p50)}   p99 {ms(p99)}")
    say(f"  errors   {sum(result.errors.values()):8d}   {dict(result.errors) or ''}")
    say(f"  ids returned {len(result.ids)}, runs created {runs}")
    ok = runs == 1 and len(result.ids) == 1 and not result.errors
    say(f"  target: exactly 1 run, 1 id, no errors  {verdict(ok)}")
    return ok


# -- the command ----------------------------------------------------------------------------------


@click.command()
@click.option(
    "--url",
    default="postgresql://postgres@127.0.0.1:5432/durable_bench_keys",
    show_default=True,
    help="PostgreSQL database (created if missing, migrated, emptied).",
)
@click.option(
    "--broker",
    default="",
    help="Redis broker URL (its queue's keys are deleted at the end); default: a redis-server of "
    "the bench's own on a spare port.",
)
@click.option("--count", default=1500, show_default=True, help="Timed calls of each kind.")
@click.option("--blocks", default=10, show_default=True, help="Interleaved blocks the timed calls come in.")
@click.option("--sql-calls", default=200, show_default=True, help="Calls of each kind in the counting pass.")
@click.option(
    "--latency-calls", default=200, show_default=True, help="Starts timed from start() to the broker."
)
@click.option("--threads", default=32, show_default=True, help="Producers hammering one key.")
@click.option("--hammer-seconds", default=5.0, show_default=True, help="How long they hammer.")
@click.option("--pool-size", default=5, show_default=True, help="Durable's pool_size (the library default).")
def main(url: str, broker: str, **sizes: Any) -> None:
    """Measure what keyed starts cost a producer on PostgreSQL (no worker involved)."""
    t0 = time.perf_counter()
    database_url = prepare_database(url)
    with private_redis(broker) as broker_url:
        run(database_url, broker_url, Sizes(**sizes))
    say(f"{time.perf_counter() - t0:.1f}s in all")


@dataclass
class Sizes:
    count: int
    blocks: int
    sql_calls: int
    latency_calls: int
    threads: int
    hammer_seconds: float
    pool_size: int


def run(database_url: str, broker: str, sizes: Sizes) -> None:
    client = redis.Redis.from_url(broker)
    durable = build(database_url, broker, sizes.pool_size)
    producers = Producers(durable, build(database_url, broker, sizes.pool_size, background=False))
    say(f"migrating {make_url(database_url).database}: {durable.migrate() or 'up to date'}")
    empty_tables(durable.db.engine)
    durable.start(WORKFLOW, {"n": -1}, key=DUP_KEY)  # the holder every duplicate meets
    say("warming up")
    for kind in KINDS:
        count_sql(producers, kind, 50)
    say(f"counting SQL over {sizes.sql_calls} calls of each kind")
    sql = {kind: count_sql(producers, kind, sizes.sql_calls) for kind in SQL_KINDS}
    say(f"timing {sizes.count} calls of each kind in {sizes.blocks} interleaved blocks")
    timings = timed_pass(producers, sizes.count, sizes.blocks)
    client.delete(QUEUE)
    say(f"timing {sizes.latency_calls} starts from start() to their message in Redis")
    seen = start_to_broker(producers, client, sizes.latency_calls)
    say(f"hammering one key from {sizes.threads} threads for {sizes.hammer_seconds:.0f}s")
    result, took = hammer(durable, sizes.threads, sizes.hammer_seconds)
    ok = report_rates(timings)
    report_start_to_broker(seen)
    ok = report_sql(sql) and ok
    ok = report_hammer(durable, result, took, sizes.threads, sizes.pool_size) and ok
    say(f"\n{'all targets met' if ok else 'some targets missed'}")
    client.delete(QUEUE)  # the messages this bench sent, nothing else
    client.close()
    durable.db.dispose()
    producers.sync.db.dispose()


if __name__ == "__main__":
    main()
