"""Hot statements run straight on psycopg's connection, compiled once by SQLAlchemy.

A claim, a step's record and a start are one statement each, run thousands of times a second.
SQLAlchemy builds and compiles each once (``Database.statement``); what it costs per execution
(an execution context, a result object, a row) was a fifth of a worker's time with inline
continuation off. On a :meth:`Database.single` connection of PostgreSQL the compiled text runs
on psycopg's cursor instead, its values bound by the column types' own bind processors and its
row read by their result processors, so values go in and come out as SQLAlchemy would make them.

Whoever watches SQLAlchemy's statements (``echo``, a ``before_cursor_execute`` or
``after_cursor_execute`` listener: OpenTelemetry's instrumentation, a statement counter) gets
the ordinary path, and sees every statement. A driver error becomes what SQLAlchemy would
raise: :class:`DatabaseUnavailable` for a lost connection (the connection is dropped), else the
matching ``sqlalchemy.exc.DBAPIError`` subclass.
"""

from __future__ import annotations

import weakref
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from ..errors import DatabaseUnavailable, SchemaOutdated
from .db import connection_lost, schema_missing, short_reason


class Compiled:
    """One statement's SQL for psycopg, its fixed values, and the converters of its values."""

    __slots__ = ("sql", "base", "binds", "results", "convert", "row")

    def __init__(self, stmt: Any, dialect: Any) -> None:
        compiled = stmt.compile(dialect=dialect)
        if compiled.positiontup or getattr(compiled, "escaped_bind_names", None):
            raise ValueError("not a statement of named parameters")
        names = compiled.bind_names  # each bind parameter's name in the SQL
        if any(bind.key != name for bind, name in names.items() if bind.required):
            raise ValueError("a parameter named apart from its key")
        self.sql: str = compiled.string
        self.base: dict[str, Any] = compiled.construct_params({b.key: None for b in names if b.required})
        self.binds: list[tuple[str, Callable[[Any], Any]]] = []
        for bind, name in names.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                self.binds.append((name, process))
        self.results: list[Any] = [
            column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in stmt.exported_columns
        ]
        self.convert = any(self.results)
        # The row class, made from the first result's column names (reading a cursor's
        # description builds an object per column: done once).
        self.row: Any = None

    def params(self, values: dict[str, Any]) -> dict[str, Any]:
        """The values to send: the fixed ones, then ``values``, each through its bind processor."""
        params = {**self.base, **values}
        for name, process in self.binds:
            # None too, as SQLAlchemy does: a JSON column stores None as JSON null, not NULL.
            params[name] = process(params[name])
        return params

    def make_row(self, cursor: Any, found: Any) -> Any:
        """The row as a named tuple like SQLAlchemy's (attributes, ``_mapping``)."""
        if self.row is None:
            self.row = _row_class(tuple(d.name for d in cursor.description))
        if self.convert:
            found = [v if p is None or v is None else p(v) for p, v in zip(self.results, found, strict=True)]
        return self.row(*found)


def _row_class(names: tuple[str, ...]) -> Any:
    base = namedtuple("Row", names, rename=True)  # type: ignore[misc]
    return type("Row", (base,), {"__slots__": (), "_mapping": property(lambda row: row._asdict())})


# Each cached statement's Compiled, or None for one that takes SQLAlchemy's path.
_compiled: weakref.WeakKeyDictionary[Any, Compiled | None] = weakref.WeakKeyDictionary()


def first(
    db: Any, conn: Connection, stmt: Any, values: dict[str, Any], sent: Callable[[], None] | None = None
) -> Any:
    """``conn.execute(stmt, values).first()`` (None for a statement that returns no rows), run
    on psycopg directly where it can be.

    ``sent``: called once the statement is on its way to the server and before it commits (in
    psycopg's pipeline mode, whose Sync ends the statement's transaction); on SQLAlchemy's path,
    just before the statement."""
    compiled = _direct(db, conn, stmt)
    if compiled is None:
        if sent is not None:
            sent()
        result = conn.execute(stmt, values)
        return result.first() if result.returns_rows else None
    params = compiled.params(values)
    driver: Any = conn.connection.dbapi_connection
    try:
        with driver.cursor() as cursor:
            if sent is None:
                cursor.execute(compiled.sql, params)
            else:
                _pipelined(driver, cursor, compiled.sql, params, sent)
            found = cursor.fetchone() if compiled.results else None
            return None if found is None else compiled.make_row(cursor, found)
    except psycopg.Error as exc:
        raise _translated(db, conn, compiled.sql, exc) from exc


def _pipelined(driver: Any, cursor: Any, sql: str, params: dict[str, Any], sent: Callable[[], None]) -> None:
    """Run one statement in pipeline mode, calling ``sent`` between its send and its Sync (which
    ends its transaction). A statement that failed raises its own error once the pipeline ended
    (ending it on a lost connection fails too, and psycopg would log that second error)."""
    failed: psycopg.Error | None = None
    try:
        with driver.pipeline():
            try:
                cursor.execute(sql, params)
            except psycopg.Error as exc:
                failed = exc
            else:
                sent()
    except psycopg.Error:
        if failed is None:
            raise
    if failed is not None:
        raise failed


def _direct(db: Any, conn: Connection, stmt: Any) -> Compiled | None:
    """The statement compiled for psycopg, if this connection is a single() one of PostgreSQL
    that nobody watches; None for SQLAlchemy's path."""
    engine = conn.engine
    # Statements are logged with echo=True, or with the "sqlalchemy.engine" logger at INFO
    # (which SQLAlchemy reads into the connection when it opens).
    echo: Any = getattr(conn, "_echo", engine.echo)
    if not db.is_postgres or echo:
        return None
    dispatch = conn.dispatch  # the engine's listeners, the connection's and every Engine's
    if dispatch.before_cursor_execute or dispatch.after_cursor_execute:
        return None
    driver: Any = conn.connection.dbapi_connection
    if driver is None or not driver.autocommit:
        return None
    try:
        return _compiled[stmt]
    except KeyError:
        pass
    try:
        made: Compiled | None = Compiled(stmt, engine.dialect)
    except ValueError:
        made = None
    _compiled[stmt] = made
    return made


def _translated(db: Any, conn: Connection, sql: str, exc: psycopg.Error) -> Exception:
    dialect: Any = conn.engine.dialect
    if connection_lost(exc, dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)):
        conn.invalidate(exc)
        return DatabaseUnavailable(db.masked_url, short_reason(exc))
    if schema_missing(exc):
        return SchemaOutdated(db.masked_url, short_reason(exc), db.migrate_fix)
    return DBAPIError.instance(sql, None, exc, psycopg.Error, hide_parameters=True, dialect=dialect)
