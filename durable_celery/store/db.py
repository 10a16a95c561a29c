"""The database handle: engine creation, clock and transaction scopes for every backend."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Interval,
    String,
    bindparam,
    create_engine,
    event,
    func,
    literal_column,
)
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError, NoSuchModuleError
from sqlalchemy.pool import NullPool, QueuePool

from ..errors import DatabaseUnavailable, InvalidDefinition, SchemaOutdated, Unsupported


class Clock:
    """A time ``seconds`` from now on the database's clock, as a value in a cached statement."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(timezone.utc)


MEMORY_URLS = ("memory://", "sqlite://", "sqlite:///:memory:")


def memory_name(url: str) -> str | None:
    """The store's name for an in-memory URL (``memory://`` a fresh one, ``memory://NAME`` one
    shared by every Durable of this process given the same name); None for any other URL."""
    if url in MEMORY_URLS:
        return uuid.uuid4().hex
    if url.startswith("memory://"):
        name = url[len("memory://") :]
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", name):
            raise InvalidDefinition(f"a memory store's name is letters, digits, '_.-', not {name!r}")
        return name
    return None


_memory_root: list[str] = []  # this process's folder of in-memory stores, once made
_memory_lock = threading.Lock()


def memory_path(name: str) -> str:
    """The file of in-memory store ``name``: in a folder of this process in shared memory
    (``/dev/shm``, else the temp folder), removed when the process exits."""
    with _memory_lock:
        if not _memory_root or not os.path.isdir(_memory_root[0]):
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            folder = tempfile.mkdtemp(prefix=f"durable-memory-{os.getpid()}-", dir=shm)
            atexit.register(_remove, folder, os.getpid())
            _memory_root[:] = [folder]
        return os.path.join(_memory_root[0], f"{name}.sqlite3")


def _remove(path: str, pid: int) -> None:
    # Only by the process that made it: a forked child exiting leaves its parent's store alone.
    if os.getpid() != pid:
        return
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def normalize_url(url: str) -> str:
    """Pin PostgreSQL URLs to psycopg 3, so ``postgresql://`` works as users write it; a URL that
    does not parse or names no installed dialect (``postgresq://``) raises InvalidDefinition."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InvalidDefinition(f"not a database URL: {masked_url(url)}; {_VALID_URLS}") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername.startswith("postgresql+") and parsed.drivername != "postgresql+psycopg":
        raise InvalidDefinition(f"use the psycopg (3) driver for PostgreSQL, not {parsed.drivername}")
    try:
        parsed.get_dialect()
    except NoSuchModuleError:
        raise InvalidDefinition(
            f"unknown database scheme {parsed.drivername!r} in {masked_url(url)}; {_VALID_URLS}"
        ) from None
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise InvalidDefinition(
            f"durable keeps its runs in PostgreSQL or SQLite, not {parsed.get_backend_name()} "
            f"({masked_url(url)}); {_VALID_URLS}"
        )
    return parsed.render_as_string(hide_password=False)


_VALID_URLS = "use postgresql://user:password@host:port/dbname or sqlite:///path/to/file.sqlite3"


def masked_url(url: str) -> str:
    """``url`` with its password (in the authority or as ``?password=``) shown as ``***``."""
    try:
        parsed = make_url(url)
    except Exception:  # not a URL SQLAlchemy can parse: mask what looks like user:password@
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    if "password" in parsed.query:
        parsed = parsed.update_query_dict({"password": "***"})
    return parsed.render_as_string(hide_password=True).replace("password=%2A%2A%2A", "password=***")


# SQLSTATEs of a session the server ended or would not open: class 08 (connection exception),
# shutdown, crash and start-up (57P01-57P03), and too many connections (53300).
_SERVER_GONE = ("57P01", "57P02", "57P03", "53300")


def connection_lost(error: BaseException, is_disconnect: bool = False) -> bool:
    """Whether a driver error means the database cannot be reached or dropped the connection.

    Errors of a working session (a duplicate key, a lock or statement timeout, a deadlock,
    SQLite's "database is locked") are not: they say something about the statement.
    """
    if is_disconnect or isinstance(error, DisconnectionError):
        return True
    if not isinstance(error, psycopg.Error):
        return False
    if error.sqlstate is None:
        # Raised by psycopg itself, not sent by a server: a refused or failed connect (any
        # reason libpq gives), a socket closed under a statement, a connect timeout.
        return isinstance(error, psycopg.OperationalError)
    return error.sqlstate.startswith("08") or error.sqlstate in _SERVER_GONE


def schema_missing(error: BaseException) -> bool:
    """Whether a driver error names a table or column that is not there: the schema was never
    migrated, or is behind this code."""
    if isinstance(error, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
        return True
    text = str(error)
    missing = text.startswith(("no such table", "no such column")) or " has no column named " in text
    return isinstance(error, sqlite3.OperationalError) and missing


def short_reason(error: BaseException) -> str:
    """The first line of a driver error: for a connection error it holds no SQL and no values."""
    if isinstance(error, DisconnectionError) and error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    reason = lines[0].strip() if lines else ""
    return (reason or type(error).__name__)[:200]


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; foreign keys make step rows go with their run.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _sqlite_begin(conn: Connection) -> None:
    # A write transaction takes the write lock at BEGIN, so two writers queue on the busy
    # timeout instead of failing mid-way; reads begin deferred and never wait on a writer (WAL).
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.pop("write", False) else "BEGIN")


PING_AFTER_IDLE = 2.0  # seconds a pooled connection may rest before it is checked at checkout


def _mark_idle(_dbapi_conn: Any, record: Any) -> None:
    record.info["idle_since"] = time.monotonic()


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    # A connection in steady use is not pinged (that would be a round trip per statement);
    # one that rested, through which a database restart may have passed, is, and a dead one
    # makes the pool open a fresh connection.
    if time.monotonic() - record.info.get("idle_since", 0.0) < PING_AFTER_IDLE:
        return
    try:
        dbapi_conn.execute("SELECT 1")
        dbapi_conn.rollback()
    except Exception as exc:
        raise DisconnectionError() from exc


class TimedQueuePool(QueuePool):
    """A QueuePool that tells its ``observers`` how long each checkout waited for a connection
    to come back (``queue_time``; opening a new connection is not waiting and is left out). A
    subclass is made per ``Database`` so that the pool SQLAlchemy recreates keeps them."""

    observers: list[Callable[[float], None]] = []
    _opening = threading.local()

    def _do_get(self) -> Any:
        if not self.observers:
            return super()._do_get()
        self._opening.seconds = 0.0
        began = time.perf_counter()
        try:
            return super()._do_get()
        finally:
            waited = max(0.0, time.perf_counter() - began - self._opening.seconds)
            for observe in self.observers:
                observe(waited)

    def _create_connection(self) -> Any:
        began = time.perf_counter()
        try:
            return super()._create_connection()
        finally:
            self._opening.seconds = getattr(self._opening, "seconds", 0.0) + time.perf_counter() - began


def transaction_limits_sql(timeout: float | None, idle: float) -> str:
    """PostgreSQL's statement_timeout (``timeout`` seconds, none when None) and
    idle_in_transaction_session_timeout (``idle`` seconds), for the open transaction only."""
    statement = f"{int(timeout * 1000)}ms" if timeout else "0"
    return (
        f"SET LOCAL statement_timeout = '{statement}'; "
        f"SET LOCAL idle_in_transaction_session_timeout = '{int(idle * 1000)}ms'"
    )


def limit_transaction_txn(conn: Connection, timeout: float | None, idle: float) -> None:
    """:func:`transaction_limits_sql` in the transaction ``conn`` has open (begun by someone
    else: Django's ``atomic()``)."""
    conn.exec_driver_sql(transaction_limits_sql(timeout, idle))


class Database:
    """One engine per process; connections are held per statement, never across a step."""

    def __init__(
        self, url: str, *, pool_size: int = 5, echo: bool = False, prepared_statements: bool = True
    ) -> None:
        # A URL that cannot work is reported at first use, not here: the app's module (imported
        # by `celery -A`) still loads, so a command can say so in one line, and a worker refuses
        # to start with that line.
        self.memory: str | None = None  # the in-memory store's name (memory://NAME)
        try:
            self.memory = memory_name(url)
            if self.memory is not None:
                # A SQLite file in shared memory, in WAL mode like the embedded default: readers
                # never wait for a writer, and every thread of this process shares it.
                path = memory_path(self.memory)
                if url in MEMORY_URLS:  # a fresh store: gone with this Database
                    weakref.finalize(self, _remove, path, os.getpid())
                url = f"sqlite:///{path}"
            self.url, self.bad_url = normalize_url(url), None
        except InvalidDefinition as exc:
            self.url, self.bad_url = url, str(exc)
        self.masked_url = f"memory://{self.memory}" if self.memory else masked_url(self.url)
        self._prepared = prepared_statements
        self.is_sqlite = self.url.startswith("sqlite")
        # Where "now" comes from on SQLite (PostgreSQL uses its own now()); testing.Fake moves it.
        self.clock: Callable[[], datetime] = utcnow
        self.is_postgres = self.url.startswith("postgresql")
        self._pool_size = pool_size
        self._echo = echo
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._pid = os.getpid()
        # How this project migrates the schema, for SchemaOutdated (None: `celery durable migrate`).
        self.migrate_fix: str | None = None
        self._statements: dict[Any, Any] = {}
        # Called with the seconds each pool checkout waited (metrics.py, bench/pool.py).
        self.pool_wait_observers: list[Callable[[float], None]] = []
        if self.memory:
            # Made now, with its tables, so it is in WAL mode before anyone else opens the file.
            _ = self.engine

    @property
    def engine(self) -> Engine:
        """The engine of this process, created on first use (and anew after a fork);
        InvalidDefinition for a URL that cannot work."""
        if self.bad_url is not None:
            raise InvalidDefinition(self.bad_url)
        if self._engine is None or self._pid != os.getpid():
            if self.memory and self._engine is not None:
                # A forked process (a prefork pool child) would see a copy that parts ways
                # with this one at once: refuse, as the store is one process only.
                raise Unsupported(
                    f"worker: a forked process unsupported by this backend (missing MULTI_PROCESS): "
                    f"memory://{self.memory} lives in process {self._pid}; use --pool threads or solo"
                )
            with self._lock:
                if self._engine is None or self._pid != os.getpid():
                    if self._engine is not None:
                        self._engine.dispose(close=False)
                    self._engine = self._create_engine()
                    self._pid = os.getpid()
        return self._engine

    def _create_engine(self) -> Engine:
        if self.is_sqlite:
            path = make_url(self.url).database
            if path and path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            engine = create_engine(
                self.url,
                echo=self._echo,
                hide_parameters=True,  # an error's message never carries a run's input
                connect_args={"timeout": 60, "check_same_thread": False},
                poolclass=NullPool if path in (None, "", ":memory:") else None,
            )
            event.listen(engine, "connect", _sqlite_pragmas)

            @event.listens_for(engine, "connect")
            def _no_pysqlite_begin(dbapi_conn: Any, _record: Any) -> None:
                dbapi_conn.isolation_level = None

            event.listen(engine, "begin", _sqlite_begin)
            event.listen(engine, "handle_error", self._raise_unavailable)
            if self.memory:  # migrated on first use
                with engine.connect() as conn:
                    conn.info["write"] = True
                    with conn.begin():
                        _create_schema(conn)
            return engine
        engine = create_engine(
            self.url,
            echo=self._echo,
            hide_parameters=True,  # an error's message never carries a run's input
            poolclass=type("DurablePool", (TimedQueuePool,), {"observers": self.pool_wait_observers}),
            pool_size=self._pool_size,
            max_overflow=self._pool_size,
            # The key decision is written for READ COMMITTED: a blocked ON CONFLICT or FOR UPDATE
            # sees the row the other transaction committed.
            isolation_level="READ COMMITTED",
            pool_recycle=1800,
            # psycopg prepares a statement on the server after a few runs; a transaction-mode
            # PgBouncer may send the next run to another server connection that lacks it.
            connect_args={} if self._prepared else {"prepare_threshold": None},
        )
        event.listen(engine, "connect", lambda _conn, record: _mark_idle(_conn, record))
        event.listen(engine, "checkin", _mark_idle)
        event.listen(engine, "checkout", _ping_if_idle)
        event.listen(engine, "handle_error", self._raise_unavailable)
        return engine

    def _raise_unavailable(self, context: ExceptionContext) -> None:
        # The one place driver errors of an outage become DatabaseUnavailable: every connect,
        # statement, begin and commit of this engine passes here, whoever opened the connection.
        # SQLAlchemy raises what a handler raises ``from`` the driver's error. A missing table
        # or column becomes SchemaOutdated here too, with the fix, instead of the SQL.
        if context.is_pre_ping:
            return
        if schema_missing(context.original_exception):
            raise SchemaOutdated(self.masked_url, short_reason(context.original_exception), self.migrate_fix)
        if not connection_lost(context.original_exception, context.is_disconnect):
            return
        context.is_disconnect = True  # drop the connection (and the pool): none of it is usable
        raise DatabaseUnavailable(self.masked_url, short_reason(context.original_exception))

    def dispose(self) -> None:
        """Close every pooled connection of this process."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def drop_memory_store(self) -> None:
        """Close and delete an in-memory store (``memory://NAME`` included) now."""
        if self.memory:
            self.dispose()
            _remove(make_url(self.url).database or "", self._pid)

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction that commits on success and rolls back on error."""
        with self.engine.connect() as conn:
            conn.info["write"] = self.is_sqlite
            with conn.begin():
                yield conn

    def replica(self, url: str | None) -> Database:
        """A Database on ``url`` (a streaming replica of this one) with this one's pool and
        prepared statements; this one itself without a URL."""
        if not url:
            return self
        return Database(url, pool_size=self._pool_size, prepared_statements=self._prepared)

    def same_database(self, where: Any) -> bool:
        """Is ``where`` (a SQLAlchemy Engine or Connection, or a URL) this database?"""
        url = getattr(where, "url", None) or getattr(getattr(where, "engine", None), "url", None)
        try:
            theirs = url if url is not None else make_url(str(where))
        except ArgumentError:
            return False
        ours = make_url(self.url)
        if ours.get_backend_name() == "sqlite" or theirs.get_backend_name() == "sqlite":
            return ours.database == theirs.database and theirs.get_backend_name() == ours.get_backend_name()
        port = 5432
        return (theirs.host or "localhost", theirs.port or port, theirs.database) == (
            ours.host or "localhost",
            ours.port or port,
            ours.database,
        )

    @contextmanager
    def step_transaction(self, timeout: float | None, idle: float) -> Iterator[Connection]:
        """An atomic step's transaction (core/atomic.py): committed when the block ends, rolled
        back when it raises. On PostgreSQL a statement stops at the step's ``timeout``, and a
        session left idle in it for ``idle`` seconds (a frozen worker) is ended by the server,
        its locks freed for whoever took the run over."""
        if not self.is_postgres:
            with self.begin() as conn:
                yield conn
            return
        with self.engine.connect() as conn:
            # psycopg in autocommit sends no BEGIN of its own: ours goes with the limits, in one
            # round trip. Its commit() and rollback() still end the transaction the server has
            # open, and durable's record takes store/direct.py's path on this connection.
            driver: Any = conn.connection.dbapi_connection
            driver.autocommit = True
            try:
                with conn.begin():
                    # READ COMMITTED as the engine's own transactions (whatever the server's default).
                    limits = transaction_limits_sql(timeout, idle)
                    conn.exec_driver_sql(f"BEGIN ISOLATION LEVEL READ COMMITTED; {limits}")
                    yield conn
            finally:
                _end_autocommit(conn)

    @contextmanager
    def single(self) -> Iterator[Connection]:
        """A connection for writes of one statement each, every one committed on its own.

        On PostgreSQL this saves the BEGIN and COMMIT round trips of a transaction.
        """
        if not self.is_postgres:
            with self.begin() as conn:
                yield conn
            return
        with self.engine.connect() as conn:
            # Set on psycopg's connection itself: SQLAlchemy's isolation_level option costs a
            # reset of the connection's characteristics at every checkin as well (about a third
            # of what taking and returning a connection costs). SQLAlchemy's own BEGIN and
            # ROLLBACK are no-ops to psycopg outside a transaction.
            driver: Any = conn.connection.dbapi_connection
            driver.autocommit = True
            try:
                yield conn
            finally:
                _end_autocommit(conn)

    @contextmanager
    def then_transaction(self, conn: Connection) -> Iterator[Connection]:
        """After :meth:`single` statements on ``conn``, a transaction on the same connection
        (which stays in transactions for the rest of the block)."""
        conn.rollback()  # ends SQLAlchemy's autobegun block: each statement already committed
        _end_autocommit(conn)
        with conn.begin():
            yield conn

    def utcnow(self) -> datetime:
        """The current time on this database's clock as this process sees it."""
        return self.clock()

    def now(self) -> Any:
        """The database's clock as a SQL expression (PostgreSQL), or this host's (SQLite)."""
        return func.now() if self.is_postgres else self.clock()

    def later(self, seconds: float) -> Any:
        """``now() + seconds`` on the same clock as :meth:`now`."""
        return self.now() + timedelta(seconds=seconds)

    # -- statements built once --------------------------------------------------------------
    # Building a SQLAlchemy statement and its cache key costs more than running it; the hot
    # path (start, claim, record) builds each shape once and binds values per call. Times go
    # in as Clock values so they still come from the database's clock.

    def statement(self, key: Any, build: Callable[[], Any]) -> Any:
        """The statement cached under ``key``, built by ``build()`` the first time."""
        found = self._statements.get(key)
        if found is None:
            found = self._statements[key] = build()
        return found

    def clock_expression(self, name: str, value: Clock) -> Any:
        """The SQL for a Clock value bound as ``name``."""
        if self.is_postgres:
            return func.now() if value.seconds == 0 else func.now() + bindparam(name, type_=Interval())
        return bindparam(name, type_=DateTime(timezone=True))

    def clock_params(self, clocks: dict[str, Clock]) -> dict[str, Any]:
        """The bound values for the Clock values named in ``clocks``."""
        if self.is_postgres:
            return {n: timedelta(seconds=c.seconds) for n, c in clocks.items() if c.seconds != 0}
        now = self.clock()
        return {n: now + timedelta(seconds=c.seconds) for n, c in clocks.items()}

    def bind(
        self, name: Any, columns: Any, values: dict[str, Any], build: Callable[..., Any]
    ) -> tuple[Any, dict[str, Any]]:
        """A cached statement for these value columns, and its parameters.

        ``build(set_values)`` makes the statement; ``set_values`` maps each column to a bind
        parameter ``v_<column>`` (typed like the column) or to the clock expression.
        """
        stmt = self.statement((name, shape(values)), lambda: build(self.set_values("v_", columns, values)))
        return stmt, self.values_params("v_", values)

    def set_values(self, prefix: str, columns: Any, values: dict[str, Any]) -> dict[str, Any]:
        """Each column of ``values`` as a typed bind parameter, or as its clock expression."""
        return {
            k: self.clock_expression(prefix + k, v)
            if isinstance(v, Clock)
            else bindparam(prefix + k, type_=columns[k].type)
            for k, v in values.items()
        }

    def values_params(self, prefix: str, values: dict[str, Any]) -> dict[str, Any]:
        """The bound values for :meth:`set_values` of the same ``values``."""
        params = {prefix + k: v for k, v in values.items() if not isinstance(v, Clock)}
        params.update(self.clock_params({prefix + k: v for k, v in values.items() if isinstance(v, Clock)}))
        return params


def _end_autocommit(conn: Connection) -> None:
    """Put a :meth:`Database.single` connection back in transactions before the pool has it; one
    that cannot be (closed, or a statement cut off mid-way) is dropped instead."""
    if conn.invalidated or conn.closed:
        return
    driver = conn.connection.dbapi_connection
    if driver is None or not driver.autocommit:
        return
    try:
        driver.autocommit = False
    except psycopg.Error:
        conn.invalidate()


def _create_schema(conn: Connection) -> None:
    """An in-memory store's tables, made from schema.py and stamped with the newest revision
    (what ``migrate()`` would reach, in one step); nothing when they are there."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from .schema import SCRIPTS, VERSION_TABLE, metadata

    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    if context.get_current_revision() is not None:
        return
    metadata.create_all(conn)
    head = ScriptDirectory(str(SCRIPTS)).get_current_head()
    context.stamp(ScriptDirectory(str(SCRIPTS)), head or "base")


def shape(values: dict[str, Any]) -> tuple[Any, ...]:
    """What a cached statement for ``values`` depends on: the columns, and which are times."""
    return tuple(sorted((k, isinstance(v, Clock), getattr(v, "seconds", 0) == 0) for k, v in values.items()))


def constant(text: str) -> Any:
    """A string constant written into the SQL itself (not a bind parameter): a statement
    used on every start or step stays one fixed text, with nothing to expand per execution."""
    return literal_column("'" + text.replace("'", "''") + "'", String())


def one_of(column: Any, values: Sequence[str]) -> Any:
    """``column IN (...)`` of string constants written into the SQL (see :func:`constant`);
    ``in_`` of plain values would expand a parameter list on every execution."""
    return column.in_([constant(value) for value in values])
