"""``Database.single``: statements committed one by one on a pooled PostgreSQL connection, which
goes back to the pool ready for transactions whatever happened inside. PostgreSQL only."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from durable_celery.errors import DatabaseUnavailable
from durable_celery.store.db import Database

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def db(pg_url: str) -> Any:
    """A Database of one pooled connection (and one overflow), so each use takes the same one."""
    database = Database(pg_url, pool_size=1)
    with database.begin() as conn:
        conn.execute(text("CREATE TABLE single_t (id int PRIMARY KEY)"))
    yield database
    database.dispose()


def ids(db: Database) -> list[int]:
    """The rows as a connection of its own sees them (committed rows only)."""
    with Database(db.url, pool_size=1).engine.connect() as conn:
        return [row.id for row in conn.execute(text("SELECT id FROM single_t ORDER BY id"))]


def insert(conn: Any, value: int) -> None:
    conn.execute(text("INSERT INTO single_t VALUES (:v)"), {"v": value})


def backend_pid(conn: Any) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_each_statement_is_committed_when_it_returns(db):
    with db.single() as conn:
        insert(conn, 1)
        assert ids(db) == [1]  # seen by another connection before the block ends
        insert(conn, 2)
        assert ids(db) == [1, 2]
        assert conn.execute(text("SELECT now() = statement_timestamp()")).scalar_one()  # no open BEGIN


def test_the_connection_goes_back_to_transactions(db):
    with db.single() as conn:
        pid = backend_pid(conn)
        insert(conn, 1)
    with pytest.raises(RuntimeError), db.begin() as conn:
        assert backend_pid(conn) == pid  # the same pooled connection
        insert(conn, 2)
        assert ids(db) == [1]  # not committed by the statement
        raise RuntimeError("roll back")
    assert ids(db) == [1]
    with db.engine.connect() as conn:
        assert backend_pid(conn) == pid
        assert conn.connection.dbapi_connection.autocommit is False


def test_a_failed_statement_leaves_the_rest_committed_and_the_connection_usable(db):
    with pytest.raises(IntegrityError), db.single() as conn:
        pid = backend_pid(conn)
        insert(conn, 1)
        insert(conn, 1)  # a duplicate key
    assert ids(db) == [1]
    with db.engine.connect() as conn:
        assert backend_pid(conn) == pid
        assert conn.connection.dbapi_connection.autocommit is False


def test_then_transaction_is_one_transaction_after_single_statements(db):
    with pytest.raises(RuntimeError), db.single() as conn:
        insert(conn, 1)
        with db.then_transaction(conn):
            insert(conn, 2)
            insert(conn, 3)
            assert ids(db) == [1]
            raise RuntimeError("roll back")
    assert ids(db) == [1]
    with db.single() as conn:
        with db.then_transaction(conn):
            insert(conn, 2)
            insert(conn, 3)
        assert ids(db) == [1, 2, 3]
        insert(conn, 4)  # from here on the connection is in transactions: nothing commits this
    assert ids(db) == [1, 2, 3]


def test_a_connection_the_server_ended_is_dropped_not_returned(db):
    with db.single() as conn:
        pid = backend_pid(conn)
    with db.single() as conn:
        assert backend_pid(conn) == pid
        with Database(db.url, pool_size=1).engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            admin.commit()
        with pytest.raises(DatabaseUnavailable):
            insert(conn, 1)
    with db.single() as conn:  # a new connection, in autocommit for the block
        assert backend_pid(conn) != pid
        insert(conn, 1)
        assert ids(db) == [1]
    with db.engine.connect() as conn:
        assert conn.connection.dbapi_connection.autocommit is False


def test_a_connection_left_inside_a_transaction_is_dropped(db):
    # Code inside the block that opens a transaction of its own by hand and leaves it open:
    # the connection cannot be put back out of autocommit, so the pool does not get it back.
    with db.single() as conn:
        pid = backend_pid(conn)
        conn.exec_driver_sql("BEGIN")
        insert(conn, 1)
    assert ids(db) == []
    with db.engine.connect() as conn:
        assert backend_pid(conn) != pid
        assert conn.connection.dbapi_connection.autocommit is False
