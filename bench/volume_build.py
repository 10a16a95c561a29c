"""Building a volume database: N runs in the shape durable_celery writes, loaded set-based.

A database of its own (``bench_volume_<name>``) is created, migrated with the library
(``Durable.migrate()``), then filled with ``INSERT ... SELECT generate_series`` in chunks of
``CHUNK`` runs, each chunk one statement whose data-modifying CTEs write its runs, their steps,
key rows, events and activity entries; then a few thousand active runs, worker nodes, queue
samples and schedules; then ``VACUUM ANALYZE`` (autovacuum is off on the test server).

The shape follows the library's own writes (``store/queries.py``, ``key_rows.py``, a sample of
real runs): see ``WORKFLOWS`` and :data:`HISTORY_SQL`. Everything is derived from the run's
number ``g`` by an integer hash, so two builds of one size are alike.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from bench.volume_sql import (
    ACTIVE_BASE,
    ACTIVE_KEYS,
    ACTIVE_RUNS,
    ACTIVE_STEPS,
    ACTIVITY,
    ACTIVITY_DAYS,
    CHUNK,
    DAYS,
    EXTRAS,
    FUNCTIONS,
    HISTORY_BASE,
    HISTORY_EVENTS,
    HISTORY_KEYS,
    HISTORY_RUNS,
    HISTORY_STEPS,
    OPTIONAL,
    WORKFLOWS,
    Mix,
    bind,
    chunk_sql,
)

SERVER = "postgresql://postgres@127.0.0.1:5432"
PREFIX = "bench_volume_"
MARK = "bench.volume"  # the key of the database's COMMENT: only databases carrying it are dropped
TABLES = ("durable_runs", "durable_steps", "durable_keys", "durable_events", "durable_activity")
SIZES = """
SELECT c.relname, c.reltuples::bigint AS rows, pg_table_size(c.oid) AS heap,
       pg_indexes_size(c.oid) AS indexes, pg_total_relation_size(c.oid) AS total
FROM pg_class c WHERE c.relname = ANY(%s) ORDER BY c.relname
"""


def admin_url(server: str = SERVER, database: str = "postgres") -> str:
    """A libpq URL of ``database`` on ``server``."""
    return f"{server.rstrip('/')}/{database}"


def read_mark(server: str, name: str) -> dict[str, Any] | None:
    """The bench's note on database ``name`` (its COMMENT), None if it has none (not ours)."""
    with psycopg.connect(admin_url(server), autocommit=True) as conn:
        row = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", (name,)
        ).fetchone()
    if row is None or not row[0]:
        return None
    try:
        found = json.loads(row[0])
    except ValueError:
        return None
    return found.get(MARK) if isinstance(found, dict) else None


def write_mark(conn: psycopg.Connection, name: str, info: dict[str, Any]) -> None:
    """Note on database ``name`` (its COMMENT) that the bench made it, and what it holds."""
    text = json.dumps({MARK: info}).replace("'", "''")
    conn.execute(f"COMMENT ON DATABASE \"{name}\" IS '{text}'".encode())


def bench_databases(server: str) -> dict[str, dict[str, Any]]:
    """The databases this bench made on ``server``: name -> its note."""
    with psycopg.connect(admin_url(server), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database WHERE datname LIKE %s",
            (PREFIX + "%",),
        ).fetchall()
    found = {}
    for name, comment in rows:
        mark = read_mark(server, name) if comment else None
        if mark is not None:
            found[name] = mark
    return found


def drop_database(server: str, name: str) -> bool:
    """Drop database ``name`` if this bench made it (its name and note say so); True if dropped."""
    if not name.startswith(PREFIX) or read_mark(server, name) is None:
        return False
    with psycopg.connect(admin_url(server), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
    return True


Say = Callable[[str], None]


class Builder:
    """Builds one volume database of ``runs`` runs named ``name`` on ``server``."""

    def __init__(self, server: str, name: str, runs: int, active: int, say: Say, workers: int = 2) -> None:
        """Plan a build: the history and active runs, and the 30 days they span."""
        if not name.startswith(PREFIX):
            raise ValueError(f"a volume database's name starts with {PREFIX}, not {name!r}")
        self.server, self.name, self.say, self.workers = server, name, say, workers
        self.active = min(active, max(runs // 20, 20))
        self.history = max((runs - self.active) // 20 * 20, 20)
        self.runs = self.history + self.active
        self.now = time.time()
        self.t0 = self.now - DAYS * 86400
        self.step = (self.now - 60 - self.t0) / self.history
        self.began = time.perf_counter()

    @property
    def url(self) -> str:
        """The libpq URL of the database being built."""
        return admin_url(self.server, self.name)

    def elapsed(self) -> str:
        """Seconds since the build began, for progress lines."""
        return f"{time.perf_counter() - self.began:7.1f}s"

    def create(self) -> None:
        """Create the database (refused if it exists) and note that it is unfinished."""
        with psycopg.connect(admin_url(self.server), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"'.encode())
            write_mark(conn, self.name, {"runs": self.runs, "complete": False})
        self.say(f"{self.elapsed()} created database {self.name}")

    def migrate(self) -> list[str]:
        """Bring the new database to the library's schema with ``Durable.migrate()``."""
        from celery import Celery

        from durable_celery import Durable

        durable = Durable(Celery("bench_volume_build", broker="memory://"), self.url, upkeep=False)
        try:
            applied = durable.migrate()
        finally:
            durable.db.dispose()
        self.say(f"{self.elapsed()} migrated: {', '.join(applied) or 'nothing to apply'}")
        return applied

    def session(self) -> psycopg.Connection:
        """A connection for loading, with the bench's temporary functions."""
        conn = psycopg.connect(self.url, autocommit=True)
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET work_mem = '256MB'")
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute("SET jit = off")
        conn.execute(FUNCTIONS.encode())
        return conn

    def optional_columns(self, conn: psycopg.Connection) -> tuple[str, ...]:
        """The optional columns (``OPTIONAL``) durable_runs has in this database."""
        rows = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'durable_runs'"
        ).fetchall()
        have = {r[0] for r in rows}
        return tuple(name for name in OPTIONAL if name in have)

    def load_history(self, optional: tuple[str, ...], workers: int) -> None:
        """The finished runs, ``CHUNK`` at a time (each chunk one statement), on ``workers``
        connections at once."""
        parts = (HISTORY_RUNS, HISTORY_STEPS, HISTORY_KEYS, HISTORY_EVENTS, ACTIVITY)
        sql = chunk_sql(HISTORY_BASE, parts, optional)
        since = self.now - ACTIVITY_DAYS * 86400
        chunks = [(lo, min(lo + CHUNK - 1, self.history)) for lo in range(1, self.history + 1, CHUNK)]
        t_load, done, lock = time.perf_counter(), [0], threading.Lock()

        def load(lo: int, hi: int) -> None:
            """Load one chunk on a free connection and print the progress."""
            conn = connections.get()
            try:
                conn.execute(
                    bind(sql, lo=lo, hi=hi, t0=self.t0, step=self.step, now=self.now, since=since).encode()
                )
            finally:
                connections.put(conn)
            with lock:
                done[0] += hi - lo + 1
                rate = done[0] / (time.perf_counter() - t_load)
                self.say(
                    f"{self.elapsed()} history runs {done[0]:,}/{self.history:,} "
                    f"({100 * done[0] / self.history:.0f}%), {rate:,.0f} runs/s, "
                    f"about {(self.history - done[0]) / rate:,.0f}s left"
                )

        connections: queue.Queue[psycopg.Connection] = queue.Queue()
        for _ in range(workers):
            connections.put(self.session())
        try:
            with ThreadPoolExecutor(workers) as pool:
                for future in [pool.submit(load, lo, hi) for lo, hi in chunks]:
                    future.result()
        finally:
            while not connections.empty():
                connections.get().close()

    def load_active(self, conn: psycopg.Connection, optional: tuple[str, ...]) -> Mix:
        """The unfinished runs: the same mix at every size."""
        mix = Mix.of(self.active)
        parts = (ACTIVE_RUNS, ACTIVE_STEPS, ACTIVE_KEYS, ACTIVITY)
        sql = chunk_sql(ACTIVE_BASE, parts, optional)
        since = self.now - ACTIVITY_DAYS * 86400
        values = {k: v for k, v in vars(mix).items()}
        conn.execute(bind(sql, H=self.history, N=self.runs, now=self.now, since=since, **values).encode())
        shown = ", ".join(f"{k} {v}" for k, v in values.items())
        self.say(f"{self.elapsed()} active runs: {self.active:,} (last of each class: {shown})")
        return mix

    def load_extras(self, conn: psycopg.Connection) -> None:
        """Worker nodes, a week of queue samples, schedules and the pruner's hourly entries."""
        queues = sorted({w[3] for w in WORKFLOWS})
        steps = {w[0]: list(w[1]) for w in WORKFLOWS}
        sql = bind(EXTRAS, now=self.now, pruned=round(self.runs / (DAYS * 24)))
        sql = sql.replace("@queues", "'" + json.dumps(queues) + "'").replace(
            "@steps", "'" + json.dumps(steps) + "'"
        )
        conn.execute(sql.encode())
        self.say(f"{self.elapsed()} nodes, queue samples, schedules")

    def vacuum(self, conn: psycopg.Connection) -> None:
        """VACUUM ANALYZE every table (what autovacuum would have done by now)."""
        for table in (*TABLES, "durable_nodes", "durable_queue_samples", "durable_schedules"):
            conn.execute(f"VACUUM ANALYZE {table}".encode())
            self.say(f"{self.elapsed()} vacuumed and analyzed {table}")

    def sizes(self, conn: psycopg.Connection) -> dict[str, dict[str, int]]:
        """Rows and bytes of the big tables."""
        rows = conn.execute(SIZES, (list(TABLES),)).fetchall()
        return {r[0]: {"rows": r[1], "heap": r[2], "indexes": r[3], "total": r[4]} for r in rows}

    def run(self) -> dict[str, Any]:
        """Create, migrate, load, vacuum; returns the database's note."""
        self.create()
        applied = self.migrate()
        with self.session() as conn:
            optional = self.optional_columns(conn)
            self.load_history(optional, self.workers)
            mix = self.load_active(conn, optional)
            self.load_extras(conn)
            self.vacuum(conn)
            sizes = self.sizes(conn)
        total = sum(s["total"] for s in sizes.values())
        info = {
            "runs": self.runs,
            "active": self.active,
            "mix": vars(mix),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.now)),
            "seconds": round(time.perf_counter() - self.began, 1),
            "revisions": applied,
            "bytes": total,
            "bytes_per_run": round(total / self.runs),
            "complete": True,
        }
        with psycopg.connect(admin_url(self.server), autocommit=True) as conn:
            write_mark(conn, self.name, info)
        return {**info, "sizes": sizes}
